"""The scheduler in-process, on the CPU: preemption instead of whole-context reservations,
and one bad request never harms another.

- A pool that cannot hold every request's full budget admits by what requests hold now,
  preempts the newest when it runs out, and still gives offline generate's greedy tokens
  (and a seeded sampled request its tokens without preemption), under ECHO with evictions,
  leaving every slot, host row and request row free.
- A request without a token budget (max_new_tokens up to the context) does not block the
  queue behind it.
- A failed step ends only the requests of that phase; a row of non-finite logits ends only
  its request; a live request id is refused. The rest complete with the right tokens.
"""

from __future__ import annotations

import pytest

from sglang_echo.runtime.request import SamplingParams, ServeRequest
from sglang_echo.runtime.scheduler import RequestRejected
from test_scheduler import (  # the same tiny model, prompts, engines and checks
    _assert_all_free,
    _drain,
    _echo_scheduler,
    _greedy,
    _offline,
    _prompts,
    model,  # noqa: F401 - the module-scoped model fixture
)


def _evictions(cache) -> int:
    return int(sum(cache.telemetry()["evictions"]))


def test_preemption_keeps_greedy_outputs_and_frees_everything(model):  # noqa: F811
    prompts = _prompts(21, 8)
    new = 40
    expected = _offline(model, prompts, new)
    # Each request needs up to ~80 tokens; 8 of them ~450: a 260-token pool must preempt.
    sched, cache, n_g = _echo_scheduler(model, max_running=8, pool=260, chunk=16)
    sched.reserve_steps = 2  # admit eagerly, so that the pool really runs out
    reqs = [ServeRequest(p, rid=str(i), params=_greedy(new)) for i, p in enumerate(prompts)]
    events = []
    for r in reqs:
        r.on_output = events.append
        sched.add(r)
    before = _evictions(cache)
    _drain(sched)
    assert sched.stats.preemptions > 0
    assert _evictions(cache) > before  # ECHO evicted under the pressure too
    assert [r.output for r in reqs] == expected
    _assert_all_free(sched, cache, n_g)
    # Each client saw every token exactly once, in order, and one final event.
    for r in reqs:
        mine = [e for e in events if e.rid == r.rid]
        assert [t for e in mine for t in e.new_token_ids] == r.output
        assert sum(e.finished for e in mine) == 1 and mine[-1].finished


def test_seeded_sampling_survives_preemption(model):  # noqa: F811
    prompts = _prompts(22, 6)

    def run(pool: int) -> tuple[list[list[int]], int]:
        sched, _, _ = _echo_scheduler(model, max_running=6, pool=pool, chunk=16)
        sched.reserve_steps = 1
        reqs = []
        for i, p in enumerate(prompts):
            params = SamplingParams(max_new_tokens=30, temperature=0.9, top_k=40, seed=100 + i)
            params.ignore_eos = True
            reqs.append(ServeRequest(p, rid=str(i), params=params))
            sched.add(reqs[-1])
        _drain(sched)
        return [r.output for r in reqs], sched.stats.preemptions

    roomy, none = run(2000)
    tight, some = run(160)
    assert none == 0 and some > 0
    assert tight == roomy


def test_request_without_budget_does_not_block_the_queue(model):  # noqa: F811
    sched, cache, n_g = _echo_scheduler(model, max_running=4, pool=300, chunk=16)
    long_ = ServeRequest([5] * 10, rid="long", params=_greedy(100))  # 110 of 300 tokens
    sched.add(long_)
    small = [ServeRequest(p, rid=f"s{i}", params=_greedy(4)) for i, p in enumerate(_prompts(3, 3))]
    for r in small:
        sched.add(r)
    sched.step()
    # Admission counted what the requests hold now: all four run at once.
    assert {r.rid for r in sched.running} == {"long", "s0", "s1", "s2"}
    _drain(sched)
    _assert_all_free(sched, cache, n_g)


def test_failed_decode_step_ends_only_its_requests(model):  # noqa: F811
    sched, cache, n_g = _echo_scheduler(model, max_running=2, pool=400, chunk=16)
    prompts = _prompts(8, 4)
    expected = _offline(model, prompts[2:], 6)
    reqs = [ServeRequest(p, rid=str(i), params=_greedy(6)) for i, p in enumerate(prompts)]
    for r in reqs:
        sched.add(r)
    real_decode = sched.steps.decode
    calls = {"n": 0}

    def flaky(active):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return real_decode(active)

    sched.steps.decode = flaky
    _drain(sched)
    failed = [r for r in reqs if r.finish_reason["type"] == "abort"]
    assert {r.rid for r in failed} == {"0", "1"}  # the two that were decoding
    assert all("decode step" in r.finish_reason["message"] for r in failed)
    assert [r.output for r in reqs[2:]] == expected  # the queued ones were not touched
    assert sched.stats.failed_requests == 2
    _assert_all_free(sched, cache, n_g)


def test_non_finite_logits_end_only_that_request(model):  # noqa: F811
    sched, cache, n_g = _echo_scheduler(model, max_running=3, pool=400, chunk=16)
    prompts = _prompts(9, 3)
    expected = _offline(model, prompts, 5)
    reqs = [ServeRequest(p, rid=str(i), params=_greedy(5)) for i, p in enumerate(prompts)]
    for r in reqs:
        sched.add(r)
    real_decode = sched.steps.decode

    def poisoned(active):
        logits = real_decode(active).clone()
        for i, r in enumerate(active):
            if r.rid == "1":
                logits[i, 3] = float("nan")
        return logits

    sched.steps.decode = poisoned
    _drain(sched)
    assert reqs[1].finish_reason["type"] == "abort"
    assert "non-finite" in reqs[1].finish_reason["message"]
    assert reqs[1].finish_reason["status_code"] == 500
    assert [reqs[0].output, reqs[2].output] == [expected[0], expected[2]]
    _assert_all_free(sched, cache, n_g)


@pytest.mark.parametrize("temperature", [1e-320, 1e-308, 1e-6])
def test_tiny_temperatures_sample_greedily(model, temperature):  # noqa: F811
    prompt = _prompts(10, 1)[0]
    sched, cache, n_g = _echo_scheduler(model, max_running=1, pool=200)
    params = SamplingParams(max_new_tokens=6, temperature=temperature, ignore_eos=True)
    req = ServeRequest(prompt, rid="t", params=params)
    sched.add(req)
    _drain(sched)
    assert req.output == _offline(model, [prompt], 6)[0]
    _assert_all_free(sched, cache, n_g)


def test_live_request_id_is_refused(model):  # noqa: F811
    sched, _, _ = _echo_scheduler(model, max_running=2, pool=300)
    sched.add(ServeRequest([5, 6, 7], rid="same", params=_greedy(3)))
    with pytest.raises(RequestRejected, match="still running"):
        sched.add(ServeRequest([8, 9], rid="same", params=_greedy(3)))
    _drain(sched)
    sched.add(ServeRequest([8, 9], rid="same", params=_greedy(3)))  # ended: free again
    _drain(sched)
    assert not sched.live
