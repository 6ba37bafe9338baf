"""A PD decode node's admission through sglang 0.5.23's REAL decode queues, with ECHO's
coordinator: the pre-allocation queue admits exactly ``cap`` requests per rank (N_G //
top-k, or ``max_running_requests // attn_dp_size`` under DP attention), the next one as
soon as one finishes, and everything comes back at the end.

What runs is sglang's own code: ``SchedulerDisaggregationDecodeMixin.process_decode_queue``
(the scheduler's per-iteration step) drives ``DecodePreallocQueue.pop_preallocated`` (its
HiSparse device-row budget, logical-token budget, request-slot and metadata-slot checks,
``_pre_alloc`` into the logical and host pools), ``DecodeTransferQueue.pop_transferred``
and ``EchoCoordinator.admit_request_direct``; KV transfer is sglang's fake backend
(``--disaggregation-transfer-backend fake``, what SGLang benchmarks decode nodes with:
FakeKVManager/FakeKVReceiver, requests addressed to FAKE_BOOTSTRAP_HOST). The pools are
sglang's (HiSparseDSATokenToKVPool, HiSparseTokenToKVPoolAllocator, DecodeReqToTokenPool,
the host pool, MetadataBuffers, a disabled UnifiedRadixCache as a decode node without a
radix cache builds it), sized by the plugin's own plan (``plan_echo``). Finishing is the
scheduler's release: ``request_finished`` then sglang's ``release_kv_cache``.

Stand-ins, and nothing else:
- the Scheduler object: a namespace with the state the queues read (running batch,
  waiting queue, flags that are off on this node, no-op output streaming and metrics).
  A real Scheduler loads a model and starts its ZMQ sockets; the queues only read these.
  Moving a request from the waiting queue into the running batch is done here (sglang's
  prebuilt-extend batch building: it takes no pool capacity).
- the attention-TP group handle (``get_parallel().attn_tp_group``): a single-rank gloo
  group, which the queues use only for their poll all-reduces.
- the CPU shims of sglang_world (CUDA host-register, device-capability query).
"""

from __future__ import annotations

import json
import os
from array import array
from contextlib import contextmanager
from types import SimpleNamespace

import plugin_testenv  # first: sets the process up before sglang loads
import pytest
import torch
import torch.distributed as dist

plugin_testenv.require_sglang()

from sglang_world import (  # noqa: E402
    PAGE,
    apply_cpu_shims,
    assert_coordinator_clean,
    build_pools,
    ceil_page,
    init_process_group,
)
from test_plugin_args import MODEL_CONFIG  # noqa: E402

from sglang_echo.config import ENV_DEV_CACHE, EchoConfig, reset_settings  # noqa: E402
from sglang_echo.sglang.args import EchoPlan, plan_echo  # noqa: E402

TOP_K, DEV_CACHE, LAYERS, CONTEXT = 16, 64, 2, 512
HOST_TOKENS = 4096
PROMPTS = [40, 100, 200, 64, 150, 30, 90]  # more requests than any rank's cap


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    apply_cpu_shims()
    init_process_group(str(tmp_path_factory.mktemp("pg")))
    model = tmp_path_factory.mktemp("dsv32")
    (model / "config.json").write_text(json.dumps(MODEL_CONFIG))
    return model


def rank_plan(max_running: int | None, attn_dp: int) -> EchoPlan:
    view = SimpleNamespace(
        max_total_tokens=HOST_TOKENS,
        max_running_requests=max_running,
        disaggregation_mode="decode",
        attn_dp_size=attn_dp,
    )
    return plan_echo(view, EchoConfig(dev_cache_size=DEV_CACHE), top_k=TOP_K, context_len=None)


def decode_context(model_dir, per_rank_running: int):
    """sglang's resolved config of one decode rank with the fake transfer backend (the
    disaggregation settings the queues read: policy, reservations, extra slots)."""
    from sglang.srt.runtime_context import create_context
    from sglang.srt.server_args import prepare_server_args

    server_args = prepare_server_args(
        ["--model-path", str(model_dir), "--device", "cpu", "--skip-tokenizer-init",
         "--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "fake",
         "--random-seed", "1", "--context-length", str(CONTEXT),
         "--max-running-requests", str(per_rank_running)]
    )  # fmt: skip
    server_args.resolve_once()
    return server_args, create_context(server_args, role="scheduler")


class SchedulerStandIn(SimpleNamespace):
    """What DecodePreallocQueue / DecodeTransferQueue / process_decode_queue read from
    the Scheduler on a HiSparse PD decode node without LoRA, priorities, HiCache,
    speculative decoding or metrics (see the module docstring for why a stand-in)."""


class DecodeRank:
    """One decode rank: sglang's real pools and queues with ECHO's coordinator."""

    def __init__(self, plan: EchoPlan, server_args) -> None:
        from sglang.srt.disaggregation.decode import DecodePreallocQueue, DecodeTransferQueue
        from sglang.srt.disaggregation.utils import (
            MetadataBuffers,
            ReqToMetadataIdxAllocator,
            TransferBackend,
        )
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
        from sglang.srt.runtime_context import get_disagg
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        from sglang_echo.sglang.coordinator import EchoCoordinator

        disagg = get_disagg()
        self.plan = plan
        self.pool, self.allocator, self.req_to_token = build_pools(
            plan.device_rows, plan.host_to_device_ratio, LAYERS, plan.per_rank_running,
            CONTEXT, torch.bfloat16, pre_alloc_size=disagg.disaggregation_decode_extra_slots,
        )  # fmt: skip
        self.coord = EchoCoordinator(
            self.req_to_token,
            self.allocator,
            top_k=TOP_K,
            device_buffer_size=ceil_page(TOP_K),
            device="cpu",
            tp_group=dist.group.WORLD,
            host_to_device_ratio=plan.host_to_device_ratio,
        )
        self.tree = UnifiedRadixCache(
            CacheInitParams(
                disable=True,
                req_to_token_pool=self.req_to_token,
                token_to_kv_pool_allocator=self.allocator,
                page_size=PAGE,
                tree_components=(ComponentType.FULL,),
            )
        )
        # As Scheduler.init_disaggregation sizes them on a decode node.
        slots = self.req_to_token.size * 2
        self.metadata_slots = ReqToMetadataIdxAllocator(slots)
        metadata = MetadataBuffers(
            slots, hidden_size=16, hidden_states_dtype=torch.float32, max_sampling_mask_tokens=0
        )
        self.sched = SchedulerStandIn(
            server_args=server_args,
            random_seed=1,
            spec_algorithm=SpeculativeAlgorithm.NONE,
            enable_hisparse=True,
            hisparse_coordinator=self.coord,
            tp_worker=SimpleNamespace(
                is_hybrid_swa=False,
                model_runner=SimpleNamespace(
                    kv_cache_dtype_str="bfloat16",
                    max_token_pool_size=self.allocator.size_full,
                ),
            ),
            model_config=SimpleNamespace(num_hidden_layers=LAYERS),
            running_batch=SimpleNamespace(reqs=[]),
            waiting_queue=[],
            last_batch=None,
            enable_priority_scheduling=False,
            enable_overlap=False,  # read by resume_retracted_reqs
            enable_lora=False,
            enable_decode_hicache=False,
            scheduler_stage_metrics=None,
            output_streamer=SimpleNamespace(stream_output=lambda reqs, logprob: None),
            metrics_reporter=SimpleNamespace(
                enable_metrics=False, current_scheduler_metrics_enabled=False
            ),
            batch_result_processor=SimpleNamespace(
                _maybe_update_reasoning_tokens=lambda req, token: None
            ),
            disagg_decode_prealloc_queue=None,
        )
        self.transfer = DecodeTransferQueue(self.metadata_slots, metadata, self.sched, self.tree)
        self.sched.disagg_decode_transfer_queue = self.transfer
        self.prealloc = DecodePreallocQueue(
            self.req_to_token, self.allocator, None, self.metadata_slots, metadata,
            self.sched, self.transfer, self.tree, 0, 8998, plan.device_rows,
            disagg.num_reserved_decode_tokens, TransferBackend.FAKE,
        )  # fmt: skip
        self.sched.disagg_decode_prealloc_queue = self.prealloc
        self.start = self.counters()
        self.next_room = 1

    def counters(self) -> dict[str, int]:
        return {
            "device_rows": self.allocator.hisparse_attn_allocator.available_size(),
            "logical": self.allocator.logical_attn_allocator.available_size(),
            "host": self.coord.mem_pool_host.available_size(),
            "req_slots": self.req_to_token.available_size(),
            "metadata_slots": self.metadata_slots.available_size(),
        }

    def submit(self, prompt_len: int):
        """A request arriving from the router, addressed to the fake prefill."""
        from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        room = self.next_room
        self.next_room += 1
        req = Req(
            f"r{room}", "", array("q", [1] * prompt_len), SamplingParams(max_new_tokens=64),
            bootstrap_host=FAKE_BOOTSTRAP_HOST, bootstrap_port=8998, bootstrap_room=room,
            vocab_size=MODEL_CONFIG["vocab_size"],
        )  # fmt: skip
        self.prealloc.add(req)
        return req

    def step(self) -> list:
        """sglang's scheduler iteration on the queues, then the admitted requests join
        the running batch. Returns the requests admitted this step."""
        from sglang.srt.disaggregation.decode import SchedulerDisaggregationDecodeMixin

        SchedulerDisaggregationDecodeMixin.process_decode_queue(self.sched)
        admitted = list(self.sched.waiting_queue)
        self.sched.waiting_queue.clear()
        self.sched.running_batch.reqs.extend(admitted)
        return admitted

    def finish(self, req) -> None:
        """The scheduler's release of a finished request (HiSparse on)."""
        from sglang.srt.mem_cache.common import release_kv_cache

        self.sched.running_batch.reqs.remove(req)
        self.coord.request_finished(req)
        release_kv_cache(req, self.tree, checkpoint=False)

    def queued(self) -> int:
        return len(self.prealloc.queue) + len(self.transfer.queue)


@contextmanager
def decode_rank(model_dir, plan: EchoPlan):
    """Build and use one rank inside its runtime context (scoped: nothing outlives it)."""
    from sglang.srt.runtime_context import get_parallel, use_context

    server_args, context = decode_context(model_dir, plan.per_rank_running)
    attn_tp_group = SimpleNamespace(cpu_group=dist.group.WORLD, world_size=1)
    saved = os.environ.get(ENV_DEV_CACHE)
    # N_G as the launcher publishes it (hand-built coordinators read the environment).
    os.environ[ENV_DEV_CACHE] = str(plan.dev_cache_size)
    reset_settings()  # parsed afresh by the coordinator built next (config.settings())
    try:
        with (
            use_context(context),
            get_parallel().override(
                tp_rank=0, pp_rank=0, attn_tp_rank=0, dp_rank=0, attn_tp_group=attn_tp_group
            ),
        ):
            yield DecodeRank(plan, server_args)
    finally:
        if saved is None:
            os.environ.pop(ENV_DEV_CACHE, None)
        else:
            os.environ[ENV_DEV_CACHE] = saved
        reset_settings()


def assert_nothing_leaked(rank: DecodeRank) -> None:
    coord = rank.coord
    assert rank.counters() == rank.start
    assert rank.queued() == 0 and not rank.sched.running_batch.reqs
    assert_coordinator_clean(coord, rank.allocator)


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
            assert rank.coord.newest_row[req.kv.req_pool_idx] > 0  # its newest page
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
        assert rank.coord.newest_row[idx] > 0  # admitted directly: its newest page
        for req in list(rank.sched.running_batch.reqs):
            rank.finish(req)
        assert_nothing_leaked(rank)
