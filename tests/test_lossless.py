"""ECHO is lossless: offload output ids and every step's logits are torch.equal to
no-offload, on randomized workloads with the device cache at its legal minimum so that
evictions happen every step."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from sglang_echo.config import EchoConfig
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


def run_pair(model, w: Workload) -> dict:
    cfg = model.config
    capacity = sum(len(p) + w.new_tokens for p in w.prompts)
    max_context = max(len(p) for p in w.prompts) + w.new_tokens
    echo = EchoConfig(offload=True, dev_cache_size=1)
    chunk = min(w.chunk, capacity)
    legal_min = echo.min_dev_cache_size(w.batch_size, cfg.index_topk, chunk)
    echo = EchoConfig(offload=True, dev_cache_size=legal_min)
    echo.validate(
        host_tokens=capacity,
        max_running_requests=w.batch_size,
        topk=cfg.index_topk,
        chunk_size=chunk,
    )
    caches = {
        "plain": PlainKVCache.for_model(cfg, capacity, w.dtype, "cpu"),
        "echo": echo_cache_for_model(echo, cfg, capacity, w.dtype, "cpu"),
    }
    results = {}
    for name, cache in caches.items():
        engine = Engine(model, cache, capacity, w.batch_size, max_context, chunk, ignore_eos=True)
        results[name] = engine.generate(w.prompts, w.new_tokens, record_logits=True)
    for a, b in zip(results["plain"], results["echo"], strict=True):
        assert a.output == b.output
        assert len(a.step_logits) == len(b.step_logits) == w.new_tokens
        for step, (x, y) in enumerate(zip(a.step_logits, b.step_logits, strict=True)):
            assert torch.equal(x, y), f"logits differ at step {step}"
    echo_cache = caches["echo"]
    tel = echo_cache.telemetry()
    # Everything went back: slots and host rows of every finished request are free.
    assert echo_cache.cache.free_count.tolist() == [legal_min] * cfg.num_hidden_layers
    return {
        "evictions": sum(tel["evictions"]) + sum(tel["append_evictions"]),
        "resolve_evictions": sum(tel["evictions"]),
        "hits": sum(tel["hits"]),
        "misses": sum(tel["misses"]),
        "dev_cache": legal_min,
    }


def run_many(models, seeds: range) -> list[dict]:
    reports = []
    for seed in seeds:
        w = make_workload(seed)
        report = run_pair(models(w.config, w.dtype), w)
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
    reports = run_many(models, range(200))
    print("\n" + summarize(reports))
    # Pressure is real: nearly every workload evicts during resolve (a lone short prompt
    # that fits the cache cannot).
    assert sum(1 for r in reports if r["resolve_evictions"] > 0) >= 170


@pytest.mark.slow
def test_lossless_1000_randomized_workloads(models):
    reports = run_many(models, range(1000, 2000))
    print("\n" + summarize(reports))
    assert sum(1 for r in reports if r["resolve_evictions"] > 0) >= 850
