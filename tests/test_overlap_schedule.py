"""Overlap scheduling (runtime/scheduler.py): decode step N+1 is launched from step N's
choices on the device before the host reads them.

The promises: the schedule really runs one step ahead; outputs, sampled ones included,
equal the synchronous schedule's; a request that stops at step N (a stop token, a stop
string) is decoded once more and that token is discarded, with exactly one terminal event
and nothing after it; an abort while its token is in flight loses nothing else and emits
nothing after its end; everything held goes back.
"""

from __future__ import annotations

import pytest

from scheduler_utils import drain, echo_scheduler, random_prompts
from server_utils import make_serving
from sglang_echo.config import EchoConfig
from sglang_echo.model.loader import load_model
from sglang_echo.runtime.request import SamplingParams, ServeRequest
from sglang_echo.runtime.scheduler import Scheduler
from sglang_echo.runtime.server_args import parse_server_args


@pytest.fixture(scope="module")
def model(small_checkpoint):
    return load_model(small_checkpoint)


def _scheduler(model, overlap: bool, max_running: int = 3, pool: int = 2000, detokenize=None):
    return echo_scheduler(model, max_running, pool, overlap=overlap, detokenize=detokenize)


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, **kw)


_drain = drain


def _all_free(sched: Scheduler, cache, n_g: int) -> None:
    assert sched.steps.allocator.num_free == sched.capacity
    assert sched.steps.table.num_free_rows == sched.steps.max_requests
    assert not sched.live and sched.in_flight.step is None
    assert cache.cache.free_count.tolist() == [n_g] * cache.num_layers


def _run(model, overlap: bool, params: list[SamplingParams], detokenize=None, seed: int = 1):
    sched, cache, n_g = _scheduler(model, overlap, detokenize=detokenize)
    launches: list[tuple[list[str], bool]] = []  # (rids, took ids from the device)
    decode = sched.steps.decode

    def logged(active, carried=None):
        launches.append(([r.rid for r in active], carried is not None))
        return decode(active, carried)

    sched.steps.decode = logged
    events: dict[str, list] = {}
    reqs = []
    for i, (prompt, p) in enumerate(zip(random_prompts(seed, len(params)), params, strict=True)):
        r = ServeRequest(prompt, rid=str(i), params=p)
        r.on_output = lambda ev: events.setdefault(ev.rid, []).append(ev)
        reqs.append(r)
        sched.add(r)
    _drain(sched)
    _all_free(sched, cache, n_g)
    for r in reqs:  # every token once, in order; one terminal event, the last
        mine = events[r.rid]
        assert [t for e in mine for t in e.new_token_ids] == r.output
        assert [k for k, e in enumerate(mine) if e.finished] == [len(mine) - 1]
    return reqs, launches


def _free_run(model, prompt: list[int], n: int) -> list[int]:
    sched, _, _ = _scheduler(model, overlap=False, max_running=1)
    r = ServeRequest(prompt, rid="free", params=_greedy(n))
    sched.add(r)
    _drain(sched)
    return r.output


def test_the_schedule_runs_one_step_ahead_with_the_same_outputs(model):
    params = [_greedy(9), _greedy(14), _greedy(5), _greedy(11)]
    sync, sync_launches = _run(model, False, params)
    ahead, ahead_launches = _run(model, True, params)
    assert [r.output for r in ahead] == [r.output for r in sync]
    assert not any(carried for _, carried in sync_launches)
    assert sum(carried for _, carried in ahead_launches) >= len(ahead_launches) // 2
    # a request ending by its length is known before: never decoded past its budget
    for r in ahead:
        assert sum(r.rid in rids for rids, _ in ahead_launches) == len(r.output) - 1


def test_sampled_outputs_equal_the_synchronous_schedules(model):
    params = [
        SamplingParams(max_new_tokens=10, temperature=0.9, top_p=0.9, top_k=40, seed=s)
        for s in (3, 4, 5)
    ] + [_greedy(7, logprobs=True, top_logprobs=2)]
    sync, _ = _run(model, False, params, seed=2)
    ahead, _ = _run(model, True, params, seed=2)
    assert [r.output for r in ahead] == [r.output for r in sync]


def test_a_request_stopping_at_step_n_is_decoded_once_more_and_that_token_dropped(model):
    prompts = random_prompts(1, 2)
    free = _free_run(model, prompts[0], 24)
    # late enough that both prompts are prefilled (a prefill reads the step in flight first)
    stop_at = next(i for i in range(10, 24) if free[i] not in free[:i])
    params = [_greedy(24, stop_token_ids=[free[stop_at]]), _greedy(24)]
    for overlap in (False, True):
        reqs, launches = _run(model, overlap, params)
        stopped, other = reqs
        assert stopped.output == free[: stop_at + 1]
        assert stopped.finish_reason == {"type": "stop", "matched": free[stop_at]}
        assert len(other.output) == 24
        # decode steps: one per output token after the prefill's, plus the discarded one
        assert sum("0" in rids for rids, _ in launches) == stop_at + int(overlap)


def test_a_stop_string_ends_the_request_where_the_synchronous_schedule_does(model):
    prompts = random_prompts(1, 2)
    free = _free_run(model, prompts[0], 12)
    stop_at = next(i for i in range(2, 12) if free[i] not in free[:i])

    def detok(ids: list[int]) -> str:
        return "".join(f"<{i}>" for i in ids)

    params = [_greedy(12, stop=[f"<{free[stop_at]}>"]), _greedy(12)]
    sync, _ = _run(model, False, params, detokenize=detok)
    ahead, _ = _run(model, True, params, detokenize=detok)
    assert [r.output for r in ahead] == [r.output for r in sync]
    assert ahead[0].output == free[: stop_at + 1]
    assert ahead[0].finish_reason["type"] == "stop"


def test_an_abort_while_its_token_is_in_flight_emits_nothing_after_its_end(model):
    sched, cache, n_g = _scheduler(model, overlap=True)
    events: list = []
    reqs = [
        ServeRequest(p, rid=str(i), params=_greedy(20), on_output=events.append)
        for i, p in enumerate(random_prompts(5, 3))
    ]
    for r in reqs:
        sched.add(r)
    for _ in range(12):  # well into decoding: a step is in flight
        sched.step()
    assert sched.in_flight.step is not None and reqs[1] in sched.in_flight.step.reqs
    held = list(reqs[1].output)
    assert sched.abort("1")
    _drain(sched)
    _all_free(sched, cache, n_g)
    mine = [e for e in events if e.rid == "1"]
    assert mine[-1].finish_reason["type"] == "abort"
    assert [k for k, e in enumerate(mine) if e.finished] == [len(mine) - 1]
    assert reqs[1].output == held  # its token in flight was not added after the abort
    assert all(len(r.output) == 20 for r in (reqs[0], reqs[2]))


def test_preemption_under_overlap_loses_nothing(model):
    prompts = random_prompts(7, 6)
    params = [_greedy(10) for _ in prompts]
    longest = max(len(p) for p in prompts) + 10

    def run(overlap: bool):
        sched, cache, n_g = _scheduler(model, overlap, max_running=4, pool=2 * longest)
        sched.reserve_steps = 1  # admit on the prompt alone: growth must preempt
        reqs = [
            ServeRequest(p, rid=str(i), params=q)
            for i, (p, q) in enumerate(zip(prompts, params, strict=True))
        ]
        events: list = []
        for r in reqs:
            r.on_output = events.append
            sched.add(r)
        _drain(sched)
        _all_free(sched, cache, n_g)
        for r in reqs:
            assert [t for e in events if e.rid == r.rid for t in e.new_token_ids] == r.output
        return [r.output for r in reqs], sched.stats.preemptions

    sync, _ = run(False)
    ahead, preempted = run(True)
    assert preempted > 0
    assert ahead == sync


def test_the_server_overlaps_by_default_and_the_sglang_flag_turns_it_off(small_checkpoint):
    assert parse_server_args(["--model-path", "m"]).disable_overlap_schedule is False
    args = parse_server_args(["--model-path", "m", "--disable-overlap-schedule"])
    assert args.disable_overlap_schedule is True
    for flags, overlap in (({}, True), ({"disable_overlap_schedule": True}, False)):
        serving = make_serving(small_checkpoint, EchoConfig(offload=False), **flags)
        assert serving.scheduler.overlap is overlap
        assert serving.info["overlap_schedule"] is overlap
