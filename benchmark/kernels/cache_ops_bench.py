"""Per-layer cost of ECHO's cache management in one decode step, graph-replayed.

The step is what a layer does every decode step: append the batch's new tokens, then
resolve the exact top-k of every request (look up, protect, evict, allocate, map, recall).
Selections come from a synthetic trace with a set per-step reuse (hit rate), each request
drawing from its own context. This measures the plain-torch reference path (the baseline
the Triton cache kernels must beat; target <= 4 us per layer-step).

    python benchmark/kernels/cache_ops_bench.py --out benchmark/results
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import save_record

from sglang_echo.config import EchoConfig
from sglang_echo.offload.echo_cache import EchoKVCache


def make_trace(
    steps: int, batch: int, topk: int, context: int, reuse: float, seed: int = 0
) -> torch.Tensor:
    """[steps, batch, topk] host ids; request r owns ids r*context+1 .. (r+1)*context."""
    g = torch.Generator().manual_seed(seed)
    base = torch.arange(batch).view(batch, 1) * context + 1
    current = torch.stack([torch.randperm(context, generator=g)[:topk] for _ in range(batch)])
    out = []
    for _ in range(steps):
        out.append(current + base)
        nxt = current.clone()
        for r in range(batch):
            replace = torch.rand(topk, generator=g) > reuse
            pool = torch.ones(context, dtype=torch.bool)
            pool[current[r]] = False
            candidates = pool.nonzero().squeeze(1)
            pick = candidates[torch.randperm(candidates.numel(), generator=g)[: int(replace.sum())]]
            nxt[r, replace] = pick
        current = nxt
    return torch.stack(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmark/results")
    p.add_argument("--batch", type=int, default=48)
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--slots", type=int, default=260_000)
    p.add_argument("--context", type=int, default=16_384)
    p.add_argument("--reuse", type=float, default=0.97)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument(
        "--device", default="cuda", help="cuda (timed, graph-replayed) or cpu (smoke run)"
    )
    args = p.parse_args()
    dev = torch.device(args.device)
    host_tokens = args.batch * args.context + args.batch * (args.steps + 8)
    cache = EchoKVCache(
        EchoConfig(offload=True, dev_cache_size=args.slots),
        1,
        host_tokens,
        576,
        128,
        torch.bfloat16,
        dev,
    )
    trace = make_trace(args.steps, args.batch, args.topk, args.context, args.reuse).to(dev)
    sel = torch.empty_like(trace[0])
    new_locs = torch.empty(args.batch, dtype=torch.int64, device=dev)
    new_rows = torch.randn(args.batch, 576, device=dev, dtype=torch.bfloat16)
    keys = torch.randn(args.batch, 128, device=dev, dtype=torch.bfloat16)
    next_loc = args.batch * args.context + 1

    def step() -> None:
        cache.write(0, new_locs, new_rows, keys)
        cache.resolve(0, sel)

    # Warm the cache eagerly for the first half of the trace (fills it, reaches steady state).
    half = args.steps // 2
    for t in range(half):
        sel.copy_(trace[t])
        new_locs.copy_(torch.arange(next_loc, next_loc + args.batch, device=dev))
        next_loc += args.batch
        step()
    c = cache.cache
    hits0, misses0 = c.hits.sum().item(), c.misses.sum().item()
    on_gpu = dev.type == "cuda"
    if on_gpu:
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
    times = []
    for t in range(half, args.steps):
        sel.copy_(trace[t])
        new_locs.copy_(torch.arange(next_loc, next_loc + args.batch, device=dev))
        next_loc += args.batch
        if not on_gpu:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e6)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    hits, misses = c.hits.sum().item() - hits0, c.misses.sum().item() - misses0
    us = statistics.median(times)
    metrics = {
        "implementation": "torch reference (sort-based LRU victims), graph-replayed",
        "us_per_layer_step": us,
        "us_per_layer_step_min": min(times),
        "batch": args.batch,
        "topk": args.topk,
        "slots": args.slots,
        "trace_reuse": args.reuse,
        "hit_rate": hits / max(1, hits + misses),
        "target_us": 4.0,
        "victim_policies": {"lru_sorted": hits / max(1, hits + misses)},
    }
    save_record(args.out, "cache_ops", torch.cuda.get_device_name() if on_gpu else "cpu", metrics)
    print(
        f"cache ops (torch reference): {us:.1f} us per layer-step (min {min(times):.1f}) at batch "
        f"{args.batch} x top-k {args.topk}, {args.slots} slots, hit rate {metrics['hit_rate']:.3f}"
    )


if __name__ == "__main__":
    main()
