"""ECHO is lossless: offload output ids and every step's logits are torch.equal to
no-offload, on randomized workloads with the device cache at its legal minimum so that
evictions happen every step. The main suite runs the configuration a server runs (the
default eviction reserve; decode steps write their tokens to the host only); variants
run without a reserve and with a large one."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import pytest
import torch

from sglang_echo.config import EchoConfig
from sglang_echo.model import indexer as indexer_module
from sglang_echo.model.kv_cache import PlainKVCache
from sglang_echo.model.loader import load_model
from sglang_echo.runtime.engine import Engine
from sglang_echo.runtime.kv_factory import echo_cache_for_model

CONFIGS = ["default-rope", "yarn", "wide-moe", "fp8-indexer"]


@dataclass
class Workload:
    config: str
    dtype: torch.dtype
    batch_size: int
    chunk: int
    prompts: list[list[int]]
    new_tokens: int


def make_workload(seed: int, vocab: int = 259) -> Workload:
    rng = random.Random(seed)
    n = rng.randint(1, 6)
    # The prefill chunk is at most one decode step's selections (batch x top-k, top-k >= 12
    # in every config), so the legal minimum cache is set by the decode step: tight.
    return Workload(
        config=rng.choice(CONFIGS),
        dtype=rng.choice([torch.float32, torch.float32, torch.bfloat16]),
        batch_size=rng.randint(1, 4),
        chunk=rng.choice([4, 8, 12]),
        prompts=[[rng.randrange(3, vocab) for _ in range(rng.randint(1, 90))] for _ in range(n)],
        new_tokens=rng.randint(2, 10),
    )


@pytest.fixture(scope="module")
def models(checkpoints):
    cache: dict = {}

    def get(name: str, dtype: torch.dtype):
        if (name, dtype) not in cache:
            cache[name, dtype] = load_model(checkpoints[name], dtype=dtype)
        return cache[name, dtype]

    return get


def run_pair(
    model,
    w: Workload,
    fuse_decode: bool | str = False,
    use_kernels: bool | None = None,
    echo_baseline: bool = True,
    fuse_extend: bool = False,
    reserve_fraction: float | None = None,
    decode_place: bool = True,
) -> dict:
    """No-offload vs ECHO (and, with ``fuse_decode``, vs ECHO with decode prefetch; without
    ``echo_baseline`` only that): identical token ids and every step's logits.
    ``use_kernels``: ECHO's cache kernels (Triton, interpreted on CPU) instead of the torch
    reference. ``reserve_fraction``: ECHO's eviction reserve as a share of its slots (None:
    the default reserve for the cache's size, as a server runs). ``decode_place``: a decode
    step's new tokens placed in free slots as they are written (the default), else
    host-only (SGLANG_ECHO_DECODE_PLACE=0)."""
    cfg = model.config
    capacity = sum(len(p) + w.new_tokens for p in w.prompts)
    max_context = max(len(p) for p in w.prompts) + w.new_tokens
    echo = EchoConfig(offload=True, dev_cache_size=1)
    chunk = min(w.chunk, capacity)
    legal_min = echo.min_dev_cache_size(w.batch_size, cfg.index_topk, chunk)
    reserve = None if reserve_fraction is None else int(legal_min * reserve_fraction)
    echo = EchoConfig(
        offload=True, dev_cache_size=legal_min, eviction_reserve=reserve, decode_place=decode_place
    )
    echo.validate(
        host_tokens=capacity,
        max_running_requests=w.batch_size,
        topk=cfg.index_topk,
        chunk_size=chunk,
    )
    kw = {} if use_kernels is None else {"use_kernels": use_kernels}
    caches = {"plain": PlainKVCache.for_model(cfg, capacity, w.dtype, "cpu")}
    if echo_baseline:
        caches["echo"] = echo_cache_for_model(echo, cfg, capacity, w.dtype, "cpu", **kw)
    if fuse_decode or fuse_extend:
        fused = replace(echo, fuse_decode=fuse_decode, fuse_extend=fuse_extend)
        caches["prefetch"] = echo_cache_for_model(fused, cfg, capacity, w.dtype, "cpu", **kw)
    results = {}
    for name, cache in caches.items():
        engine = Engine(model, cache, capacity, w.batch_size, max_context, chunk, ignore_eos=True)
        results[name] = engine.generate(w.prompts, w.new_tokens, record_logits=True)
    for name in caches:
        for a, b in zip(results["plain"], results[name], strict=True):
            assert a.output == b.output, name
            assert len(a.step_logits) == len(b.step_logits) == w.new_tokens
            for step, (x, y) in enumerate(zip(a.step_logits, b.step_logits, strict=True)):
                assert torch.equal(x, y), f"{name}: logits differ at step {step}"
    for name in caches:
        if name != "plain":
            # Everything went back: slots and host rows of every finished request are free.
            free = caches[name].cache.free_count.tolist()
            assert free == [legal_min] * cfg.num_hidden_layers, name
            assert caches[name].telemetry()["release_errors"] == 0, name  # nothing refused
    tel = caches["echo" if echo_baseline else "prefetch"].telemetry()
    report = {
        "evictions": sum(tel["evictions"]) + sum(tel["append_evictions"]),
        "resolve_evictions": sum(tel["evictions"]),
        "hits": sum(tel["hits"]),
        "misses": sum(tel["misses"]),
        "dev_cache": legal_min,
        "reserve": echo.eviction_reserve,
    }
    if fuse_decode or fuse_extend:
        ptel = caches["prefetch"].telemetry()
        report["prefetched"] = sum(ptel["prefetched_rows"])
        report["prefetch_hits"] = sum(ptel["prefetch_hits"])
        report["misses_with_prefetch"] = sum(ptel["misses"])
        report["prefetch_steps"] = ptel["prefetch_steps"]  # [on, all] decode steps, auto
    return report


def run_many(
    models, seeds: range, reserve_fraction: float | None = None, host_writes_every: int = 0
) -> list[dict]:
    """``host_writes_every`` n > 0: every n-th workload writes decode tokens host-only."""
    reports = []
    for i, seed in enumerate(seeds):
        w = make_workload(seed)
        place = not (host_writes_every and i % host_writes_every == 0)
        report = run_pair(
            models(w.config, w.dtype), w, reserve_fraction=reserve_fraction, decode_place=place
        )
        reports.append({"seed": seed, **report})
    return reports


def summarize(reports: list[dict]) -> str:
    evicting = sum(1 for r in reports if r["resolve_evictions"] > 0)
    hits = sum(r["hits"] for r in reports)
    misses = sum(r["misses"] for r in reports)
    return (
        f"{len(reports)} workloads identical; {evicting} with resolve evictions; "
        f"evictions total {sum(r['evictions'] for r in reports)} "
        f"(resolve {sum(r['resolve_evictions'] for r in reports)}); "
        f"hit rate {hits / max(1, hits + misses):.3f}"
    )


def test_lossless_200_randomized_workloads(models):
    """The default configuration: every cache runs with its default eviction reserve."""
    reports = run_many(models, range(200))
    print("\n" + summarize(reports))
    assert all(r["reserve"] >= 1 for r in reports)
    # Pressure is real: nearly every workload evicts during resolve (a lone short prompt
    # that fits the cache cannot; 169 of these 200 do, with decode tokens placed in free
    # slots as they are written).
    assert sum(1 for r in reports if r["resolve_evictions"] > 0) >= 160


def test_lossless_without_an_eviction_reserve(models):
    """SGLANG_ECHO_EVICTION_RESERVE=0: each evicting step frees exactly its misses' worth;
    every other workload also writes its decode tokens host-only (SGLANG_ECHO_DECODE_PLACE=0),
    so the resolve recalls them."""
    reports = run_many(models, range(0, 200, 4), reserve_fraction=0.0, host_writes_every=2)
    print("\n" + summarize(reports))
    assert all(r["reserve"] == 0 for r in reports)
    assert sum(1 for r in reports if r["resolve_evictions"] > 0) >= 40


@pytest.mark.slow
def test_lossless_1000_randomized_workloads(models):
    reports = run_many(models, range(1000, 2000))
    print("\n" + summarize(reports))
    assert sum(1 for r in reports if r["resolve_evictions"] > 0) >= 850


def test_lossless_with_an_eviction_reserve(models):
    """SGLANG_ECHO_EVICTION_RESERVE: every evicting step also frees a quarter of the cache
    ahead; outputs and logits stay no-offload's, under the same pressure."""
    reports = []
    for seed in range(500, 540):
        w = make_workload(seed)
        reports.append(run_pair(models(w.config, w.dtype), w, reserve_fraction=0.25))
    print("\n" + summarize(reports))
    assert sum(1 for r in reports if r["resolve_evictions"] > 0) >= 30
    for seed, fuse in ((300, "decode"), (301, "decode"), (400, "extend"), (401, "extend")):
        w = make_workload(seed)  # with each prefetch, which allocates from the same stack
        flags = {"fuse_decode": fuse == "decode", "fuse_extend": fuse == "extend"}
        run_pair(models(w.config, w.dtype), w, reserve_fraction=0.25, **flags)


def _prefetch_summary(reports: list[dict], kind: str = "decode") -> str:
    prefetched = sum(r["prefetched"] for r in reports)
    hits = sum(r["prefetch_hits"] for r in reports)
    return (
        f"{len(reports)} workloads identical with {kind} prefetch; prefetched {prefetched} "
        f"rows, {hits} then selected; misses after the top-k "
        f"{sum(r['misses_with_prefetch'] for r in reports)} vs {sum(r['misses'] for r in reports)}"
        " without prefetch"
    )


def test_lossless_with_decode_prefetch(models):
    """SGLANG_NSA_FUSE_LOGITS_RECALL_DECODE=1 (the staged prefetch, torch reference):
    output identical to no-offload and to ECHO without prefetch, and prefetch does fire."""
    reports = []
    for seed in range(300, 316):
        w = make_workload(seed)
        reports.append(run_pair(models(w.config, w.dtype), w, fuse_decode=True))
    print("\n" + _prefetch_summary(reports))
    assert sum(r["prefetched"] for r in reports) > 0
    assert sum(r["prefetch_hits"] for r in reports) > 0  # some prefetched rows were selected
    assert sum(r["resolve_evictions"] for r in reports) > 0


def test_lossless_with_decode_prefetch_auto(models):
    """SGLANG_NSA_FUSE_LOGITS_RECALL_DECODE=auto: the rule turns the prefetch on after
    decode steps that missed >= 7% of their selections and off after the others; output
    identical to no-offload and to ECHO without prefetch across both kinds of step."""
    reports = []
    for seed in range(300, 316):
        w = make_workload(seed)
        reports.append(run_pair(models(w.config, w.dtype), w, fuse_decode="auto"))
    on = sum(r["prefetch_steps"][0] for r in reports)
    steps = sum(r["prefetch_steps"][1] for r in reports)
    print(f"\nauto: prefetch on in {on} of {steps} decode steps; " + _prefetch_summary(reports))
    assert 0 < on < steps  # both modes ran
    assert sum(r["prefetch_hits"] for r in reports) > 0
    assert sum(r["resolve_evictions"] for r in reports) > 0  # under cache pressure


def test_lossless_with_prefill_prefetch(models):
    """SGLANG_NSA_FUSE_LOGITS_RECALL_EXTEND=1 (histogram candidates, torch reference):
    output identical to no-offload and to ECHO without prefetch, and prefetch does fire."""
    reports = []
    for seed in range(400, 412):
        w = make_workload(seed)
        reports.append(run_pair(models(w.config, w.dtype), w, fuse_extend=True))
    print("\n" + _prefetch_summary(reports, "prefill"))
    assert sum(r["prefetched"] for r in reports) > 0
    assert sum(r["prefetch_hits"] for r in reports) > 0
    assert sum(r["resolve_evictions"] for r in reports) > 0


def test_lossless_with_decode_prefetch_kernels(models, monkeypatch):
    """The GPU code path on the CPU: the chunked fp8 logits and the staging kernels, the
    staged recall and the cache kernels (Triton interpreter) under the same equality, for
    an fp8-indexer workload."""
    monkeypatch.setattr(indexer_module, "INDEXER_KERNELS_ON_CPU", True)
    w = Workload(
        config="fp8-indexer",
        dtype=torch.float32,
        batch_size=3,
        chunk=48,  # = batch x top-k: the legal minimum cache still; fewer (slow) prefills
        prompts=[[(7 * i + 3 * j) % 250 + 3 for j in range(n)] for i, n in enumerate((40, 23, 61))],
        new_tokens=5,
    )
    model = models(w.config, w.dtype)
    report = run_pair(model, w, fuse_decode=True, use_kernels=True, echo_baseline=False)
    print(f"\nkernels: prefetched {report['prefetched']} rows, {report['prefetch_hits']} selected")
    assert report["prefetched"] > 0 and report["prefetch_hits"] > 0
    assert report["resolve_evictions"] > 0, "no resolve evicted: the test lost its pressure"


def test_lossless_with_cache_kernels_at_batch_one(models):
    """A lone request's decode resolves carry one query, which allocate_kernel takes as
    distinct ids (plain stamps, misses straight from the free stack when no eviction is
    due): the cache kernels (interpreted) on that path, under eviction, stay lossless."""
    w = Workload(
        config="default-rope",
        dtype=torch.float32,
        batch_size=1,
        chunk=12,
        prompts=[
            [(13 * j + 5) % 250 + 3 for j in range(70)],
            [(3 * j) % 250 + 3 for j in range(41)],
        ],
        new_tokens=6,
    )
    report = run_pair(models(w.config, w.dtype), w, use_kernels=True)
    assert report["resolve_evictions"] > 0, "no resolve evicted: the test lost its pressure"


@pytest.mark.parametrize("alloc_path", ["one-program", "multi-launch"])
def test_lossless_with_prefill_prefetch_kernels(models, alloc_path, monkeypatch):
    """Prefill prefetch's GPU code path on the CPU: the histogram kernels and the cache
    kernels (Triton interpreter), chunks of several query blocks, under the same equality;
    with each allocation path (this small batch takes the one program unless forced past
    it, kernels/alloc_common.py ONE_PROGRAM_LANES; past it resolves take the look-back
    launches of kernels/alloc_lookback.py and appends the five-launch pipeline)."""
    if alloc_path == "multi-launch":
        from sglang_echo.kernels import alloc_common

        monkeypatch.setattr(alloc_common, "ONE_PROGRAM_LANES", 0)
    w = Workload(
        config="default-rope",
        dtype=torch.float32,
        batch_size=2,
        chunk=12,
        prompts=[[(5 * i + 11 * j) % 250 + 3 for j in range(n)] for i, n in enumerate((50, 37))],
        new_tokens=3,
    )
    report = run_pair(models(w.config, w.dtype), w, use_kernels=True, fuse_extend=True)
    print(f"\nkernels: prefetched {report['prefetched']} rows")
    assert report["prefetched"] > 0 and report["resolve_evictions"] > 0
