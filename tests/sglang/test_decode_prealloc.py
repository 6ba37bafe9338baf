"""A PD decode node's admission through sglang 0.5.23's REAL decode queues, with ECHO's
coordinator: the pre-allocation queue admits exactly ``cap`` requests per rank (N_G //
top-k, or ``max_running_requests // attn_dp_size`` under DP attention), the next one as
soon as one finishes, and everything comes back at the end.

The rank (sglang's real pools and queues, the fake transfer backend, and the stand-ins)
is decode_rank.py's; moving a request from the waiting queue into the running batch is
done here (sglang's prebuilt-extend batch building: it takes no pool capacity).
"""

from __future__ import annotations

import plugin_testenv  # first: sets the process up before sglang loads
import pytest
import torch

plugin_testenv.require_sglang()

from decode_rank import (  # noqa: E402
    DEV_CACHE,
    TOP_K,
    DecodeRank,
    assert_nothing_leaked,
    decode_rank,
    make_model_dir,
    rank_plan,
)
from sglang_world import PAGE  # noqa: E402

PROMPTS = [40, 100, 200, 64, 150, 30, 90]  # more requests than any rank's cap


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory)


def assert_only_device_rows_bind(rank: DecodeRank) -> None:
    """At the cap, the queue stops on ECHO's device-row budget: request slots, metadata
    slots and sglang's logical-token budget would all take the next request."""
    head = rank.prealloc.queue[0].req
    assert rank.req_to_token.available_size() > 0
    assert rank.metadata_slots.available_size() > 0
    running = rank.sched.running_batch.reqs
    retractable = sum(len(r.origin_input_ids) + len(r.output_ids) for r in running)
    need = rank.prealloc._required_admission_tokens(
        head,
        rank.prealloc._required_alloc_tokens(fill_len=len(head.origin_input_ids), prefix_len=0),
        0,
        retractable,
    )
    assert rank.prealloc._allocatable_token_budgets(retractable_tokens=retractable) >= need
    per_request = rank.coord.padded_buffer_size + rank.coord.spec_swap.scratch_capacity
    assert rank.allocator.hisparse_attn_allocator.available_size() < per_request


def rids(reqs) -> list[str]:
    return [r.rid for r in reqs]


# name: (--max-running-requests, attention-DP ranks, the per-rank cap the plan must give).
# Under DP attention each rank is its own scheduler with pools of the per-rank plan; the
# rank built here is one of them (its scheduler sees its share of the running cap).
PLANS = {
    "one_rank": (None, 1, DEV_CACHE // TOP_K),
    "dp2_rank": (2 * (DEV_CACHE // TOP_K), 2, DEV_CACHE // TOP_K),
    "capped": (3, 1, 3),
}


@pytest.mark.parametrize("name", sorted(PLANS))
def test_prealloc_queue_admits_exactly_cap(model_dir, name):
    max_running, attn_dp, cap = PLANS[name]
    plan = rank_plan(max_running, attn_dp)
    assert plan.per_rank_running == cap
    with decode_rank(model_dir, plan) as rank:
        assert rank.prealloc.kv_manager.__class__.__name__ == "FakeKVManager"
        reqs = [rank.submit(n) for n in PROMPTS]

        admitted = rank.step()
        assert rids(admitted) == rids(reqs[:cap]), "FIFO admission of exactly cap requests"
        for _ in range(3):  # more iterations admit nothing while cap are running
            assert rank.step() == []
        assert rank.queued() == len(PROMPTS) - cap
        assert_only_device_rows_bind(rank)
        for req in admitted:
            assert rank.coord.ring_rows[req.kv.req_pool_idx, 0] > 0  # its ring page
            host = rank.coord.req_to_host_pool[req.kv.req_pool_idx, : len(req.origin_input_ids)]
            assert torch.all(host >= 0), "the prompt's host slots (the RDMA targets)"

        # One finishes: exactly one more is admitted, the cap holds again.
        rank.finish(admitted[1])
        assert rids(rank.step()) == [reqs[cap].rid]
        assert rank.step() == []
        assert len(rank.sched.running_batch.reqs) == cap

        # Drain: finish whatever runs, admit the rest, cap at every step.
        served = cap + 1
        while rank.sched.running_batch.reqs:
            for req in list(rank.sched.running_batch.reqs):
                rank.finish(req)
            served += len(rank.step())
            assert len(rank.sched.running_batch.reqs) <= cap
        assert served == len(PROMPTS)
        assert_nothing_leaked(rank)


def test_hisparse_per_request_charge_would_admit_fewer(model_dir):
    """Control: the count above is the plugin's doing. With HiSparse's own per-request
    device charge (its padded per-request buffer) in place of ECHO's one newest page,
    the same real queue on the same plan admits fewer than cap."""
    plan = rank_plan(None, 1)
    cap = plan.per_rank_running
    with decode_rank(model_dir, plan) as rank:
        stock = rank.coord.device_buffer_size + PAGE
        assert stock > rank.coord.padded_buffer_size == PAGE
        rank.coord.padded_buffer_size = stock
        reqs = [rank.submit(n) for n in PROMPTS[: cap + 1]]
        admitted = rank.step()
        assert len(admitted) == rank.start["device_rows"] // stock < cap
        rank.coord.padded_buffer_size = PAGE  # ECHO's charge again: the rest fit
        for req in admitted:
            rank.finish(req)
        rest = rank.step()
        assert len(admitted) + len(rest) == len(reqs) and rank.queued() == 0
        for req in rest:
            rank.finish(req)
        assert_nothing_leaked(rank)


def test_a_retracted_request_resumes_through_sglangs_queue_with_its_host_ids(model_dir):
    """sglang's own retraction and resume with the plugin's hooks: ``release_req`` keeps
    the request (no abort), the prealloc queue holds it as retracted, and
    ``process_decode_queue`` resumes it (``resume_retracted_reqs`` -> ``_pre_alloc`` ->
    ``restore_kv_cache``) in a new request slot that holds the same host ids, taking no
    host slot anew; then everything comes back."""
    import sglang.srt.managers.schedule_batch as schedule_batch

    plan = rank_plan(None, 1)
    with decode_rank(model_dir, plan) as rank:
        # Looked up at call time, as ScheduleBatch.release_req does: hooked by now (the
        # coordinator applies the hooks when it is built).
        release_req = schedule_batch.release_req
        reqs = [rank.submit(n) for n in PROMPTS[:2]]
        assert rids(rank.step()) == rids(reqs)
        victim = reqs[0]
        n = len(victim.origin_input_ids)
        host_ids = rank.coord.req_to_host_pool[victim.kv.req_pool_idx, :n].clone()
        host_free = rank.coord.mem_pool_host.available_size()
        rank.sched.running_batch.reqs.remove(victim)
        kept = release_req(
            req=victim, remaing_req_count=1, req_to_token_pool=rank.req_to_token,
            token_to_kv_pool_allocator=rank.allocator, tree_cache=rank.tree,
            hisparse_coordinator=rank.coord,
        )  # fmt: skip
        assert kept is True, "kept, not aborted with 503"
        assert rank.coord.mem_pool_host.available_size() == host_free
        rank.prealloc.extend([victim], is_retracted=True)
        assert rank.prealloc.retracted_queue == [victim]
        assert rids(rank.step()) == [victim.rid]  # resumed first
        assert not rank.prealloc.retracted_queue and victim.kv.retraction_backup is None
        idx = victim.kv.req_pool_idx
        assert torch.equal(rank.coord.req_to_host_pool[idx, :n], host_ids)
        assert rank.coord.mem_pool_host.available_size() == host_free, "no host slot anew"
        assert rank.coord.ring_rows[idx, 0] > 0  # admitted directly: its ring page
        for req in list(rank.sched.running_batch.reqs):
            rank.finish(req)
        assert_nothing_leaked(rank)
