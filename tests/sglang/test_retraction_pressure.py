"""Retraction under real decode memory pressure, through sglang 0.5.23's OWN scheduler path
on a PD decode rank with ECHO's coordinator (decode_rank.py: sglang's real pools and
queues, the fake transfer backend).

Each scheduler iteration is sglang's: ``process_decode_queue`` (resume, admission),
``_get_new_prebuilt_batch`` and the merge into the running batch, then
``Scheduler.update_running_batch``: its ``check_decode_mem``, ``retract_decode`` (with
``release_req``, hooked by the plugin) and ``prepare_for_decode`` (logical ids for the
step, the coordinator's backup of each previous token into the host pool). No model runs:
a step's results are one token per request, and a request that reaches its
``max_new_tokens`` is released as sglang's result processing does.

The pools are small (1216 tokens, three requests, 128 tokens reserved per request) so
that the running requests outgrow them after about 250 steps, and sglang retracts one.
Its host ids are kept (retraction.py). What must hold, whatever happens next:
- no exception (the host pool's allocation raised here before the fix);
- every request never retracted finishes whole (no 500);
- a retracted request resumes and finishes whole, or ends with exactly one 503;
- at every step no host or logical id is held twice and none is lost, and the logical
  pool never has more free than the host pool; at the end every id is free again.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from http import HTTPStatus
from types import SimpleNamespace

import plugin_testenv  # first: sets the process up before sglang loads
import pytest
import torch

plugin_testenv.require_sglang()

from decode_rank import (  # noqa: E402
    LAYERS,
    DecodeRank,
    assert_nothing_leaked,
    decode_rank,
    make_model_dir,
    rank_plan,
)
from sglang_world import PAGE  # noqa: E402
from test_plugin_args import MODEL_CONFIG  # noqa: E402

from sglang_echo.sglang.retraction import DROPPED_MESSAGE, kept_of  # noqa: E402

HOST_TOKENS = 1216  # a 19-page host pool for three requests
CONTEXT = 1024
EXTRA_ARGS = (
    "--num-reserved-decode-tokens", "128",
    "--disaggregation-decode-retraction-backup", "none",
)  # fmt: skip
MAX_ITERATIONS = 2000


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory)


@dataclass
class Run:
    """What the loop saw: who was retracted, the aborts sglang sent, the steps."""

    retracted: set[str] = field(default_factory=set)
    retracted_at: int | None = None
    retractions: int = 0
    aborts: list[tuple[str, dict]] = field(default_factory=list)
    decode_steps: int = 0
    steps_after_retraction: int = 0


def as_scheduler(rank: DecodeRank, run: Run) -> None:
    """Give the rank's Scheduler stand-in what update_running_batch, retract_decode,
    _get_new_prebuilt_batch and prepare_for_decode read (metrics, outputs and grammar
    off; aborts recorded; a retracted request goes back to the prealloc queue, as
    Scheduler._add_request_to_queue does on a decode node)."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.scheduler_components.new_token_ratio_tracker import (
        NewTokenRatioTracker,
    )

    s = rank.sched
    s.enable_skip_finishing_decode = False
    s.result_queue = []
    s.decode_offload_manager = None
    s.token_to_kv_pool_allocator = rank.allocator
    s.req_to_token_pool = rank.req_to_token
    s.tree_cache = rank.tree
    s.new_token_ratio_tracker = NewTokenRatioTracker.from_config()
    s.metrics_reporter.num_retracted_reqs = 0
    s.forward_ct = 0
    s.max_running_requests = rank.plan.per_rank_running
    s.send_abort_output = lambda abort, req: run.aborts.append((req.rid, abort.finished_reason))
    s.beam_coordinator = SimpleNamespace(retire_group=lambda req: None)
    s._add_request_to_queue = lambda req, is_retracted=False: rank.prealloc.add(
        req, is_retracted=is_retracted
    )
    s._reqs_finishing_inflight = types.MethodType(Scheduler._reqs_finishing_inflight, s)
    s.grammar_manager = SimpleNamespace(has_waiting_grammars=lambda: False)
    s.model_config = SimpleNamespace(
        num_hidden_layers=LAYERS, vocab_size=MODEL_CONFIG["vocab_size"], is_encoder_decoder=False
    )
    s.running_batch = ScheduleBatch(reqs=[], batch_is_full=False)


def iterate(rank: DecodeRank, run: Run, finished: list) -> None:
    """One iteration of sglang's decode event loop (event_loop_normal_disagg_decode),
    then the step's results by hand: one token each, finished requests released."""
    from sglang.srt.disaggregation.decode import SchedulerDisaggregationDecodeMixin as Mixin
    from sglang.srt.managers.scheduler import Scheduler

    s, coord = rank.sched, rank.coord
    Mixin.process_decode_queue(s)
    new = Mixin._get_new_prebuilt_batch(s, s.running_batch)
    if new is not None:
        new.filter_batch()
        if not new.is_empty():
            if s.running_batch.is_empty():
                s.running_batch = new
                s.running_batch.hisparse_coordinator = coord
            else:
                s.running_batch.merge_batch(new)
    if s.running_batch.is_empty():
        return
    s.metrics_reporter.num_retracted_reqs = 0
    s.running_batch = batch = Scheduler.update_running_batch(s, s.running_batch)
    s.forward_ct += 1
    run.retractions += s.metrics_reporter.num_retracted_reqs
    if run.retractions and run.retracted_at is None:
        run.retracted_at = run.decode_steps
    run.retracted.update(r.rid for r in rank.prealloc.retracted_queue)
    if batch.is_empty():
        return
    run.decode_steps += 1
    if run.retracted_at is not None:
        run.steps_after_retraction += 1
    with coord.one_release_per_step():
        for req in batch.reqs:
            req.output_ids.append(1)
            if len(req.output_ids) >= req.sampling_params.max_new_tokens:
                finish(rank, req)
                finished.append(req)
    batch.filter_batch()


def finish(rank: DecodeRank, req) -> None:
    """sglang's result processing of a finished request (HiSparse on)."""
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH
    from sglang.srt.mem_cache.common import release_kv_cache

    req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))
    rank.coord.request_finished(req)
    release_kv_cache(req, rank.tree, checkpoint=False)


def holders(rank: DecodeRank) -> list:
    """Every request holding a request slot: running, admitted, in transfer."""
    reqs = list(rank.sched.running_batch.reqs) + list(rank.sched.waiting_queue)
    reqs += [entry.req for entry in rank.transfer.queue]
    return [r for r in reqs if r.kv.req_pool_idx is not None]


def assert_disjoint_cover(parts: dict[str, torch.Tensor], every: torch.Tensor, what: str) -> None:
    ids = torch.cat([p.flatten().to(torch.int64).cpu() for p in parts.values()])
    values, counts = torch.unique(ids, return_counts=True)
    twice = values[counts > 1].tolist()
    assert not twice, f"{what} ids held twice: {twice[:8]}"
    lost = sorted(set(every.tolist()) - set(values.tolist()))
    assert not lost, f"{what} ids lost: {lost[:8]} ({len(lost)})"
    assert values.numel() == every.numel(), f"{what} ids outside the pool"


def kept_rows(rank: DecodeRank) -> list:
    """The kept rows of the requests waiting in the retracted queue, not yet released."""
    rows = [kept_of(r) for r in rank.prealloc.retracted_queue]
    return [k for k in rows if k is not None and not getattr(k, "released", False)]


def assert_ids_accounted(rank: DecodeRank) -> None:
    """No host or logical id is held twice and none is lost: the free lists, the request
    rows, the kept rows of the retracted queue (and the logical ids held for them) and the
    coordinator's reservations cover each pool exactly once; logical free <= host free."""
    coord = rank.coord
    host, logical = coord.mem_pool_host, rank.allocator.logical_attn_allocator
    reqs = holders(rank)
    slots = sorted(r.kv.req_pool_idx for r in reqs)
    in_use = set(range(1, rank.req_to_token._alloc_size)) - set(rank.req_to_token.free_slots)
    assert slots == sorted(in_use), "every request slot in use belongs to a request"
    kept = kept_rows(rank)
    none = torch.empty(0, dtype=torch.int64)

    host_parts = {
        "free": torch.cat((host.free_slots, *host.release_slots)),
        "reserved": coord.reserved_host_ids,
        "kept": torch.cat([k.row[k.row >= 0] for k in kept] or [none]),
    }
    for r in reqs:
        row = coord.releases.host_id_row(r.kv.req_pool_idx)
        host_parts[r.rid] = row[row >= 0] if row is not None else none
    assert_disjoint_cover(host_parts, torch.arange(host.size), "host")

    def pages(ids: torch.Tensor | None) -> torch.Tensor:
        return none if ids is None else (ids.to(torch.int64) // PAGE).unique()

    logical_parts = {
        "free": logical.get_all_free_pages(),
        "reserved": pages(coord.reserved_logical_ids),
        "held": torch.cat([pages(getattr(k, "logical", None)) for k in kept] or [none]),
    }
    for r in reqs:
        row = rank.req_to_token.req_to_token[r.kv.req_pool_idx, : r.kv.kv_allocated_len]
        logical_parts[r.rid] = pages(row)
    assert_disjoint_cover(logical_parts, torch.arange(1, logical.num_pages + 1), "logical")
    assert logical.available_size() <= host.available_size(), "logical free <= host free"


def drive(rank: DecodeRank, prompts: list[int], max_new: list[int]) -> tuple[Run, list, list]:
    """Submit the requests and run sglang's loop until nothing runs or waits, checking
    the ids after every iteration. Any exception fails the test."""
    run = Run()
    as_scheduler(rank, run)
    reqs = [rank.submit(p, m) for p, m in zip(prompts, max_new, strict=True)]
    finished: list = []
    for _ in range(MAX_ITERATIONS):
        iterate(rank, run, finished)
        assert_ids_accounted(rank)
        idle = rank.sched.running_batch.is_empty() and not rank.sched.waiting_queue
        if idle and rank.queued() == 0 and not rank.prealloc.retracted_queue:
            break
    else:
        pytest.fail(f"still running after {MAX_ITERATIONS} iterations")
    return run, reqs, finished


def assert_outcome(run: Run, reqs: list, finished: list) -> dict[str, str]:
    """Never retracted: finished whole. Retracted: finished whole (resumed) or exactly one
    503 with the plugin's message. No other abort. Returns each request's outcome."""
    outcome: dict[str, str] = {}
    aborted = [rid for rid, _ in run.aborts]
    for req in reqs:
        whole = req in finished and len(req.output_ids) == req.sampling_params.max_new_tokens
        if req.rid not in run.retracted:
            assert whole and req.rid not in aborted, f"{req.rid} was never retracted"
            outcome[req.rid] = "whole"
        elif whole:
            assert req.rid not in aborted
            outcome[req.rid] = "resumed"
        else:
            assert aborted.count(req.rid) == 1, f"{req.rid}: one 503, got {run.aborts}"
            reason = dict(run.aborts)[req.rid]
            assert reason["status_code"] == HTTPStatus.SERVICE_UNAVAILABLE
            assert reason["message"] == DROPPED_MESSAGE
            assert kept_of(req) is None and req not in finished
            outcome[req.rid] = "503"
    assert len(run.aborts) == len(set(aborted)), "one abort per request at most"
    return outcome


# name: (prompts, max_new_tokens, the outcome design A gives: dropped kept rows end
# with 503, a kept row that outlives the pressure resumes).
SCENARIOS = {
    # The pages are crossed in step: the newest retracted row is dropped at once.
    "in_step": ([120, 120, 120], [400, 400, 400], {"r1": "whole", "r2": "whole", "r3": "503"}),
    # Kept some steps, then dropped when the running requests need its room.
    "dropped_later": ([130, 130, 120], [400, 400, 400], {"r1": "whole", "r2": "503", "r3": "whole"}),
    # r1 finishes while r2 is kept: r2 resumes with its host ids and finishes.
    "resumes": ([130, 130, 120], [260, 400, 400], {"r1": "whole", "r2": "resumed", "r3": "whole"}),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_retraction_under_pressure_through_sglangs_loop(model_dir, name):
    prompts, max_new, expected = SCENARIOS[name]
    plan = rank_plan(len(prompts), 1, host_tokens=HOST_TOKENS)
    with decode_rank(model_dir, plan, CONTEXT, EXTRA_ARGS) as rank:
        run, reqs, finished = drive(rank, prompts, max_new)
        assert run.retracted_at is not None and run.retracted, "sglang retracted a request"
        assert run.steps_after_retraction >= 64, "decoded on well past the retraction"
        assert assert_outcome(run, reqs, finished) == expected
        assert not rank.coord.kept_rows.live and not rank.prealloc.retracted_queue
        assert_nothing_leaked(rank)


def test_sglangs_forced_retraction_keeps_and_resumes(model_dir, monkeypatch):
    """sglang's own test retraction (SGLANG_TEST_RETRACT: one request every N steps, no
    pressure): each retracted request is kept, resumed at the next iteration with its host
    ids, and every request finishes whole."""
    import sglang.srt.managers.scheduler as scheduler

    monkeypatch.setattr(scheduler, "TEST_RETRACT", True)
    monkeypatch.setattr(scheduler, "TEST_RETRACT_INTERVAL", 20)
    plan = rank_plan(3, 1)
    with decode_rank(model_dir, plan, CONTEXT, EXTRA_ARGS) as rank:
        run, reqs, finished = drive(rank, [120, 64, 200], [100, 90, 80])
        assert run.retractions >= 3 and run.retracted
        outcome = assert_outcome(run, reqs, finished)
        assert set(outcome.values()) <= {"whole", "resumed"} and not run.aborts
        assert_nothing_leaked(rank)
