"""The scheduler's promises about a request's life, on the CPU with the tiny model:

* a finished request is never retracted, re-queued, re-prefilled or finished twice (it
  leaves ``running`` the moment it ends);
* every request gets exactly one terminal event, and nothing after it;
* a PD decode node that reserved whole budgets never preempts, never re-emits a token and
  leaves nothing behind;
* requests compare by identity.
"""

from __future__ import annotations

import random
from collections import defaultdict

import pytest

from scheduler_utils import drain, echo_scheduler
from server_utils import make_serving
from sglang_echo.config import EchoConfig
from sglang_echo.model.loader import load_model
from sglang_echo.runtime.request import OutputEvent, SamplingParams, ServeRequest


@pytest.fixture(scope="module")
def model(small_checkpoint):
    return load_model(small_checkpoint)


class EventLog:
    """Every event of every request, in order; checks the one-terminal-event promise."""

    def __init__(self) -> None:
        self.events: dict[str, list[OutputEvent]] = defaultdict(list)

    def __call__(self, event: OutputEvent) -> None:
        self.events[event.rid].append(event)

    def tokens(self, rid: str) -> list[int]:
        return [t for e in self.events[rid] for t in e.new_token_ids]

    def assert_one_terminal_event_each(self, rids: list[str]) -> None:
        for rid in rids:
            evs = self.events[rid]
            ends = [i for i, e in enumerate(evs) if e.finished]
            assert ends == [len(evs) - 1], f"request {rid}: terminal events at {ends} of {len(evs)}"


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


_drain = drain


def _echo_scheduler(model, pool: int, max_running: int = 4, reserve_steps: int = 0):
    """ECHO at its smallest legal cache with its default eviction reserve; admission
    reserves no growth (``reserve_steps=0``) so the pool runs short and preempts."""
    return echo_scheduler(model, max_running, pool, reserve_steps=reserve_steps)


def test_a_request_finished_at_prefill_is_never_retracted(model):
    """A and C decode with one free location left; B (one token, max_new_tokens=1) is
    admitted into it, prefilled, and finishes at the prefill's accept. The decode phase
    then needs two locations: the scheduler must preempt C, not "retract" the finished B
    (which used to come back as WAITING, be prefilled again and stream a second token and
    a second final event)."""
    sched, cache, n_g = _echo_scheduler(model, pool=12)
    log = EventLog()
    a = ServeRequest([5, 6, 7, 8, 9], rid="A", params=_greedy(7), on_output=log)
    c = ServeRequest([10, 11, 12, 13], rid="C", params=_greedy(8), on_output=log)
    sched.add(a)
    sched.add(c)
    sched.step()  # both prefilled and decoded once: 5 + 4 + 2 locations of 12
    assert sched.steps.allocator.num_free == 1
    b = ServeRequest([20], rid="B", params=_greedy(1), on_output=log)
    sched.add(b)
    sched.step()
    assert b.finished and b not in sched.running and b not in sched.waiting
    assert sched.stats.preemptions == 1 and c.preemptions == 1 and b.preemptions == 0
    _drain(sched)
    log.assert_one_terminal_event_each(["A", "B", "C"])
    assert log.tokens("B") == b.output and len(b.output) == 1
    assert len(log.tokens("A")) == 7 and len(log.tokens("C")) == 8
    assert sched.stats.finished_requests == 3 and sched.stats.aborted_requests == 0
    assert sched.steps.allocator.num_free == 12 and not sched.live
    assert cache.cache.free_count.tolist() == [n_g] * cache.num_layers


def test_soak_of_preemptions_keeps_every_promise(model):
    """Random arrivals, lengths of 1-12 new tokens (many end at their first token), aborts
    and a pool so tight that preemption is constant: each request streams exactly its
    outputs with one terminal event at the end, greedy outputs equal an unpressured run,
    and the stats count each request once."""
    rng = random.Random(7)
    specs = [
        ([rng.randrange(3, 259) for _ in range(rng.randint(1, 12))], rng.randint(1, 12))
        for _ in range(40)
    ]
    expected = {}
    roomy, _, _ = _echo_scheduler(model, pool=2_000, reserve_steps=32)
    reqs = [ServeRequest(p, rid=str(i), params=_greedy(n)) for i, (p, n) in enumerate(specs)]
    for r in reqs:
        roomy.add(r)
    _drain(roomy)
    expected = {r.rid: r.output for r in reqs}

    sched, cache, n_g = _echo_scheduler(model, pool=28)
    log = EventLog()
    reqs = [
        ServeRequest(p, rid=str(i), params=_greedy(n), on_output=log)
        for i, (p, n) in enumerate(specs)
    ]
    aborted = set()
    for i, r in enumerate(reqs):
        sched.add(r)
        sched.step()
        if i % 9 == 4 and not reqs[i - 2].finished:  # an abort now and then
            assert sched.abort(reqs[i - 2].rid)
            aborted.add(reqs[i - 2].rid)
    _drain(sched)
    rids = [r.rid for r in reqs]
    log.assert_one_terminal_event_each(rids)
    for r in reqs:
        assert log.tokens(r.rid) == r.output
        if r.rid not in aborted:
            assert r.output == expected[r.rid], f"request {r.rid}"
    assert sched.stats.preemptions > 10
    ended = sched.stats.finished_requests + sched.stats.aborted_requests
    assert ended == len(reqs) and sched.stats.aborted_requests == len(aborted)
    assert sched.steps.allocator.num_free == 28 and not sched.live
    assert cache.cache.free_count.tolist() == [n_g] * cache.num_layers
    sched.fail_all("shutting down")  # nothing live: nothing is ended again
    log.assert_one_terminal_event_each(rids)


def test_fail_all_ends_only_live_requests(model):
    sched, _, _ = _echo_scheduler(model, pool=200, reserve_steps=32)
    log = EventLog()
    done = ServeRequest([3, 4], rid="done", params=_greedy(1), on_output=log)
    live = ServeRequest([3, 4, 5], rid="live", params=_greedy(50), on_output=log)
    sched.add(done)
    sched.add(live)
    sched.step()
    assert done.finished and not live.finished
    sched.fail_all("shutting down")
    log.assert_one_terminal_event_each(["done", "live"])
    assert done.finish_reason["type"] == "length"
    assert live.finish_reason["status_code"] == 503
    assert sched.stats.finished_requests == 1 and sched.stats.aborted_requests == 1
    assert sched.steps.allocator.num_free == 200


def _decode_node(small_checkpoint, pool: int, echo: bool):
    topk = load_model(small_checkpoint).config.index_topk
    n_g = EchoConfig(offload=True).min_dev_cache_size(4, topk, 32)
    serving = make_serving(
        small_checkpoint,
        EchoConfig(offload=echo, dev_cache_size=n_g),
        max_total_tokens=pool,
        max_running_requests=4,
        context_length=256,
        chunked_prefill_size=32,
        disaggregation_mode="decode",
        disaggregation_transfer_backend="fake",
    )
    return serving.scheduler


@pytest.mark.parametrize("echo", [False, True], ids=["no-offload", "echo"])
def test_decode_node_reserves_whole_budgets_and_never_preempts(small_checkpoint, echo):
    """Three requests of 20-location budgets decode a step in a pool of 80; then a fourth
    asks for 23 locations when exactly 20 are not promised to the others. Admission that
    counted one location short per running request (as it did) let it in, the pool ran
    dry, and a retraction re-emitted a first token while a cancelled transfer could still
    write into freed locations. Whole budgets reserved: it waits, nothing preempts."""
    sched = _decode_node(small_checkpoint, pool=80, echo=echo)
    log = EventLog()
    rng = random.Random(11)
    first = [
        ServeRequest([rng.randrange(3, 259) for _ in range(11)], rid=f"r{i}") for i in (1, 2, 3)
    ]
    for r in first:
        r.params = _greedy(10)
        r.on_output = log
        sched.add(r)
    sched.step()
    # each decoded one step (its token may still be on the device: overlap scheduling)
    assert all(r.cached_len == len(r.prompt) + 1 for r in first)
    late = ServeRequest(
        [rng.randrange(3, 259) for _ in range(14)], rid="r4", params=_greedy(10), on_output=log
    )
    sched.add(late)
    _drain(sched)
    reqs = [*first, late]
    log.assert_one_terminal_event_each([r.rid for r in reqs])
    for r in reqs:
        assert log.tokens(r.rid) == r.output and len(r.output) == 10, r.rid
    assert sched.stats.preemptions == 0
    assert sched.steps.allocator.num_free == 80 and not sched.live
    assert sched.prompt_source.pending == 0


def test_requests_compare_by_identity():
    a = ServeRequest([1, 2, 3], rid="x")
    b = ServeRequest([1, 2, 3], rid="x")
    assert a != b and a == a
    queue = [a, b]
    queue.remove(b)
    assert queue[0] is a
    assert len({a, b}) == 2  # hashable by identity
