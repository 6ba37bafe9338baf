"""Building each engine of the plan on the device, behind one ``StepRunner`` each: the
no-offload pool (every token's rows in HBM), ECHO (one shared device cache of N_G slots per
layer over a host pool) and the HiSparse-like baseline (a private buffer per request and
layer over the same host pool); the equal-HBM and pressure engines are these backends at
other sizes. Also reading a built backend's state: its device bytes, its eviction
counters, and whether a released batch left anything behind."""

from __future__ import annotations

import torch

from benchmark.e2e.plan import Engine, StudyPlan
from benchmark.e2e.timing import EventTimer
from sglang_echo.config import EchoConfig, settings
from sglang_echo.kernels.decode_write import PROMPT_PRIORITY
from sglang_echo.model.kv_cache import PlainKVCache
from sglang_echo.offload.hisparse_cache import HiSparseKVCache
from sglang_echo.runtime.kv_factory import echo_cache_for_model
from sglang_echo.runtime.step_runner import StepRunner


def build(
    setup: StudyPlan, eng: Engine, model, device: torch.device
) -> tuple[object, StepRunner, EventTimer | None]:
    """(KV cache, step runner, event timer) of ``eng`` over ``model``. On a GPU the runner
    decodes from CUDA graphs and its graph call is wrapped in an ``EventTimer``."""
    cfg, p, topk = setup.cfg, setup.plan, setup.cfg.index_topk
    cuda = device.type == "cuda"
    if eng.backend == "no-offload":
        kv = PlainKVCache.for_model(cfg, eng.pool, p.dtype, device, p.kv_cache_dtype)
        tokens, rows = eng.pool, eng.max_batch
    elif eng.backend == "hisparse":
        buffer = eng.buffer or setup.buffer_size
        rows = min(eng.max_batch, eng.dev_cache // buffer)
        kv = HiSparseKVCache.for_model(
            cfg, eng.host, rows, buffer, p.dtype, device, p.kv_cache_dtype, pdl=settings().pdl
        )
        tokens = eng.host
    else:
        echo = EchoConfig(
            offload=True,
            dev_cache_size=eng.dev_cache,
            decode_place=eng.decode_place,
            resolve_overlap=eng.resolve_overlap,
            fuse_decode=eng.fuse_decode,
        )
        kv = echo_cache_for_model(
            echo, cfg, eng.host, p.dtype, device, kv_cache_dtype=p.kv_cache_dtype
        )
        tokens, rows = eng.host, min(eng.max_batch, echo.max_running(topk))
    runner = StepRunner(
        model,
        kv,
        tokens,
        max_requests=rows,
        max_context=p.ctx_max + setup.max_new + 8,
        use_cuda_graph=cuda,
    )
    timer = None
    if cuda:
        timer = EventTimer(runner.decode_runner)
        runner.decode_runner = timer
    return kv, runner, timer


def kv_device_bytes(kv_cache) -> int:
    """Every device byte of KV state the backend holds (all layers)."""
    if isinstance(kv_cache, PlainKVCache):
        return kv_cache.nbytes
    if isinstance(kv_cache, HiSparseKVCache):
        maps = (kv_cache.host_to_slot, kv_cache.slot_to_host, kv_cache.stamp, kv_cache.owner)
        return kv_cache.rows.nbytes + kv_cache.index.nbytes + sum(t.nbytes for t in maps)
    total = kv_cache.cache.nbytes + kv_cache.index.nbytes
    ws = getattr(kv_cache.manager, "_workspace", None)
    if ws is not None:
        total += sum(t.nbytes for t in vars(ws).values() if isinstance(t, torch.Tensor))
    return total


def eviction_counter(kv) -> torch.Tensor | None:
    """The backend's per-layer eviction counts (None for the plain pool)."""
    if isinstance(kv, HiSparseKVCache):
        return kv.evictions
    cache = getattr(kv, "cache", None)
    return cache.evictions if cache is not None else None


def placed_unselected(kv) -> int:
    """Device slots of an ECHO cache that hold a transferred prompt's row no step has
    selected yet (still at the placement's priority): 0 for other backends."""
    cache = getattr(kv, "cache", None)
    if cache is None or isinstance(kv, HiSparseKVCache):
        return 0
    n = cache.num_slots
    occupied = cache.device_to_host[:, 1 : n + 1] >= 1
    return int((occupied & (cache.priority[:, 1 : n + 1] == PROMPT_PRIORITY)).sum())


def leak_free(eng: Engine, kv, runner: StepRunner) -> bool:
    """After releasing every request: all pool tokens and request rows free again, and
    every device slot of ECHO's caches (or the HiSparse-like buffers) free."""
    ok = runner.allocator.num_free == runner.allocator.capacity
    ok = ok and runner.table.num_free_rows == runner.max_requests
    if eng.backend == "echo":
        ok = ok and kv.cache.free_count.tolist() == [eng.dev_cache] * kv.num_layers
    if eng.backend == "hisparse":
        ok = ok and kv.free_slots() == [kv.max_requests * kv.buffer_size] * kv.num_layers
    return bool(ok)
