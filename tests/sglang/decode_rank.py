"""One PD decode rank built from sglang 0.5.23's REAL pools and decode queues, with ECHO's
coordinator (shared by test_decode_prealloc.py and test_retraction_pressure.py).

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
- the attention-TP group handle (``get_parallel().attn_tp_group``): a single-rank gloo
  group, which the queues use only for their poll all-reduces.
- the CPU shims of sglang_world (CUDA host-register, device-capability query).
"""

from __future__ import annotations

import json
import os
from array import array
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import SimpleNamespace

import plugin_testenv  # first: sets the process up before sglang loads
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


def make_model_dir(tmp_path_factory):
    """What a module's ``model_dir`` fixture returns: sglang's classes on the CPU (the
    shims), a one-rank gloo process group, and a DeepSeek-V3.2 config to launch with."""
    apply_cpu_shims()
    init_process_group(str(tmp_path_factory.mktemp("pg")))
    model = tmp_path_factory.mktemp("dsv32")
    (model / "config.json").write_text(json.dumps(MODEL_CONFIG))
    return model


def rank_plan(max_running: int | None, attn_dp: int, host_tokens: int = HOST_TOKENS) -> EchoPlan:
    view = SimpleNamespace(
        max_total_tokens=host_tokens,
        max_running_requests=max_running,
        disaggregation_mode="decode",
        attn_dp_size=attn_dp,
    )
    return plan_echo(view, EchoConfig(dev_cache_size=DEV_CACHE), top_k=TOP_K, context_len=None)


def decode_context(
    model_dir, per_rank_running: int, context: int = CONTEXT, extra_args: Sequence[str] = ()
):
    """sglang's resolved config of one decode rank with the fake transfer backend (the
    disaggregation settings the queues read: policy, reservations, extra slots), plus
    ``extra_args`` (more server flags)."""
    from sglang.srt.runtime_context import create_context
    from sglang.srt.server_args import prepare_server_args

    server_args = prepare_server_args(
        ["--model-path", str(model_dir), "--device", "cpu", "--skip-tokenizer-init",
         "--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "fake",
         "--random-seed", "1", "--context-length", str(context),
         "--max-running-requests", str(per_rank_running), *extra_args]
    )  # fmt: skip
    server_args.resolve_once()
    return server_args, create_context(server_args, role="scheduler")


class SchedulerStandIn(SimpleNamespace):
    """What DecodePreallocQueue / DecodeTransferQueue / process_decode_queue read from
    the Scheduler on a HiSparse PD decode node without LoRA, priorities, HiCache,
    speculative decoding or metrics (see the module docstring for why a stand-in)."""


class DecodeRank:
    """One decode rank: sglang's real pools and queues with ECHO's coordinator."""

    def __init__(self, plan: EchoPlan, server_args, context: int = CONTEXT) -> None:
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
            context, torch.bfloat16, pre_alloc_size=disagg.disaggregation_decode_extra_slots,
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

    def submit(self, prompt_len: int, max_new_tokens: int = 64):
        """A request arriving from the router, addressed to the fake prefill."""
        from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        room = self.next_room
        self.next_room += 1
        req = Req(
            f"r{room}", "", array("q", [1] * prompt_len), SamplingParams(max_new_tokens=max_new_tokens),
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
def decode_rank(
    model_dir, plan: EchoPlan, context: int = CONTEXT, extra_args: Sequence[str] = ()
) -> Iterator[DecodeRank]:
    """Build and use one rank inside its runtime context (scoped: nothing outlives it)."""
    from sglang.srt.runtime_context import get_parallel, use_context

    server_args, runtime = decode_context(model_dir, plan.per_rank_running, context, extra_args)
    attn_tp_group = SimpleNamespace(cpu_group=dist.group.WORLD, world_size=1)
    saved = os.environ.get(ENV_DEV_CACHE)
    # N_G as the launcher publishes it (hand-built coordinators read the environment).
    os.environ[ENV_DEV_CACHE] = str(plan.dev_cache_size)
    reset_settings()  # parsed afresh by the coordinator built next (config.settings())
    try:
        with (
            use_context(runtime),
            get_parallel().override(
                tp_rank=0, pp_rank=0, attn_tp_rank=0, dp_rank=0, attn_tp_group=attn_tp_group
            ),
        ):
            yield DecodeRank(plan, server_args, context)
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
