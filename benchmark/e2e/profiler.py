"""Where a decode step's device time goes, from the torch profiler: kernel time per step
by category (indexer logits, top-k, cache management, recall, sparse MLA, GEMMs, ...),
the heaviest kernels, and one CUDA graph's kernels by name (a component's parts)."""

from __future__ import annotations

import torch

from benchmark.study.decode_node import DecodeNode

# Kernel name -> part of the step (Triton kernels are named by their function).
CATEGORY_RULES = (
    ("indexer_logits", ("fp8_index_logits", "fp8_logits")),
    ("topk", ("topk", "_hist_kernel", "_collect_kernel")),
    ("cache_mgmt", ("_lookup_kernel", "_rank_kernel", "_assign_kernel", "_finish_kernel")),
    ("recall", ("recall",)),
    ("sparse_mla", ("sparse_mla", "_combine_kernel")),
    ("moe_grouped_gemm", ("grouped", "group")),
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "gemv", "matmul")),
)
AMBIGUOUS = ("_count_kernel",)  # in both the top-k and the allocation kernels


def categorize(names: list[str]) -> list[str]:
    """Category per kernel, in launch order; an ambiguous name takes the category of the
    nearest earlier top-k or cache-management kernel (they run in separate phases)."""
    out, last = [], "topk"
    for name in names:
        low = name.lower()
        cat = "other"
        if any(a in name for a in AMBIGUOUS):
            cat = last
        else:
            for label, keys in CATEGORY_RULES:
                if any(k in low for k in keys):
                    cat = label
                    break
        if cat in ("topk", "cache_mgmt"):
            last = cat
        out.append(cat)
    return out


def profile_breakdown(node: DecodeNode, steps: int) -> dict:
    """Device time per step by kernel category, from the profiler over ``steps`` graph-
    replayed decode steps."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            node.step()
        torch.cuda.synchronize()
    kernels = sorted(
        (e.time_range.start, e.time_range.elapsed_us(), e.name)
        for e in prof.events()
        if e.device_type == DeviceType.CUDA
    )
    cats = categorize([k[2] for k in kernels])
    per: dict[str, float] = {}
    for (_, us, _), cat in zip(kernels, cats, strict=True):
        per[cat] = per.get(cat, 0.0) + us
    total = sum(per.values())
    top: dict[str, float] = {}
    for _, us, name in kernels:
        top[name] = top.get(name, 0.0) + us
    heavy = sorted(top.items(), key=lambda kv: -kv[1])[:12]
    return {
        "ms_per_step": {k: round(v / steps / 1000, 4) for k, v in sorted(per.items())},
        "fraction": {k: round(v / total, 4) for k, v in sorted(per.items())} if total else {},
        "kernels": len(kernels) // max(1, steps),
        "top_kernels_ms_per_step": {n[:120]: round(us / steps / 1000, 4) for n, us in heavy},
    }


def profile_graph(fn, replays: int = 5) -> dict:
    """Device time per replay of ``fn``'s CUDA graph by kernel name (microseconds): where a
    component's time goes (e.g. the MoE's grouped GEMMs against its routing and gathers)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    per: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            per[e.name[:100]] = per.get(e.name[:100], 0.0) + e.time_range.elapsed_us()
    ranked = sorted(per.items(), key=lambda kv: -kv[1])
    return {name: round(us / replays, 2) for name, us in ranked}
