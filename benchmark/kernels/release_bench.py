"""The cost of finishing a request under ECHO: releasing its tokens from every layer's
device cache. The batched release (kernels/release.py, one launch for all layers) against
the per-layer torch release it replaced (~12 ops per layer) and the vectorised torch
reference, at SGLang's 61 layers, N_G 260K slots and a 2M-token host pool.

Correct first: all three leave the same cache state (torch.equal) before anything is timed.
Timed with device events, warm-up, medians; the cache state is restored between runs
(outside the timed region). Launches are counted with the profiler.

Floor: the release must read each released id once per layer and its host-to-device entry
(4 B), and write that entry back; for resident ids also a slot-to-host entry, a priority
(8 B) and a free-stack entry: bytes over the measured copy bandwidth (~4.2 TB/s here).

    python3 benchmark/kernels/release_bench.py --out benchmark/results
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import save_record

from sglang_echo.kernels.alloc import AllocWorkspace, allocate_kernel
from sglang_echo.kernels.release import release_kernel, release_reference
from sglang_echo.offload.device_cache import ABSENT, FREE, DeviceCache

STATE = ("host_to_device", "device_to_host", "priority", "free_stack", "free_count")
HBM_COPY_BYTES_PER_S = 4.2e12  # docs: the H200's device-to-device copy, measured here


def per_layer_release(c: DeviceCache, locs: torch.Tensor) -> None:
    """The release before kernels/release.py: a dozen torch ops for each layer."""
    for layer in range(c.num_layers):
        slot = c.host_to_device[layer][locs].to(torch.int64)
        resident = slot != ABSENT
        rank = torch.cumsum(resident.to(torch.int64), 0) - 1
        free = c.free_count[layer].to(torch.int64)
        push = torch.where(resident, free + rank, torch.full_like(rank, c.num_slots))
        c.free_stack[layer].scatter_(0, push, torch.where(resident, slot, 0).to(torch.int32))
        target = torch.where(resident, slot, torch.full_like(slot, c.scratch_slot))
        c.device_to_host[layer].scatter_(
            0, target, torch.full_like(target, FREE, dtype=torch.int32)
        )
        c.priority[layer].scatter_(0, target, torch.full_like(target, FREE))
        c.host_to_device[layer].index_fill_(0, locs, ABSENT)
        c.free_count[layer] = (free + resident.sum()).to(torch.int32)


def launches(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmark/results")
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--slots", type=int, default=260_000)
    ap.add_argument("--host", type=int, default=2_000_000)
    ap.add_argument("--tokens", type=int, default=100_000, help="the finished request's tokens")
    ap.add_argument("--resident", type=int, default=20_000, help="of them resident per layer")
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    dev = torch.device("cuda")
    cache = DeviceCache(args.layers, args.slots, args.host, 1, torch.float32, dev)
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randperm(args.host, generator=g)[: args.tokens].add_(1).to(dev)
    ws = AllocWorkspace(cache, max_lanes=args.resident)
    for layer in range(args.layers):  # a different resident share in every layer
        pick = torch.randperm(args.tokens, generator=g)[: args.resident].to(dev)
        allocate_kernel(cache, layer, ids[pick], True, ws)
    torch.cuda.synchronize()
    start = {name: getattr(cache, name).clone() for name in STATE}

    def restore() -> None:
        for name in STATE:
            getattr(cache, name).copy_(start[name])

    errors = torch.zeros(1, dtype=torch.int64, device=dev)
    ids_host = ids.cpu()
    variants = {
        "per_layer_torch": lambda: per_layer_release(cache, ids),
        "batched_reference": lambda: release_reference(cache, ids, errors),
        "batched_kernel": lambda: release_kernel(cache, ids, errors),
    }
    # Correct first: every variant leaves the per-layer release's state.
    restore()
    variants["per_layer_torch"]()
    expected = {name: getattr(cache, name).clone() for name in STATE}
    for name, fn in variants.items():
        restore()
        fn()
        torch.cuda.synchronize()
        for field in STATE:
            if not torch.equal(getattr(cache, field), expected[field]):
                raise SystemExit(f"{name}: {field} differs from the per-layer release")
    assert errors.item() == 0
    assert bool((cache.free_count == args.slots).all()), "not everything was freed"
    results = {}
    for name, fn in variants.items():
        times = []
        for _ in range(3 + args.reps):
            restore()
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1000)
        times = times[3:]
        restore()
        results[name] = {
            "median_us": statistics.median(times),
            "min_us": min(times),
            "max_us": max(times),
            "launches": launches(fn),
        }
    resident_total = args.layers * args.resident
    floor_bytes = args.layers * args.tokens * (8 + 4 + 4) + resident_total * (4 + 8 + 4)
    floor_us = floor_bytes / HBM_COPY_BYTES_PER_S * 1e6
    base = results["per_layer_torch"]["median_us"]
    metrics = {
        **{f"{k}_us": v["median_us"] for k, v in results.items()},
        **{f"{k}_launches": v["launches"] for k, v in results.items()},
        "speedup_kernel_vs_per_layer": base / results["batched_kernel"]["median_us"],
        "floor_us": floor_us,
        "kernel_over_floor": results["batched_kernel"]["median_us"] / floor_us,
    }
    name = torch.cuda.get_device_name()
    print(f"{'variant':<20}{'median us':>12}{'spread us':>20}{'launches':>10}")
    for k, v in results.items():
        spread = f"{v['min_us']:.0f}-{v['max_us']:.0f}"
        print(f"{k:<20}{v['median_us']:>12.1f}{spread:>20}{v['launches']:>10}")
    print(
        f"floor (bytes / HBM copy) {floor_us:.1f} us; kernel {metrics['kernel_over_floor']:.1f}x it"
    )
    save_record(
        args.out, "release", name, metrics,
        details={"config": vars(args), "variants": results, "ids_host_bytes": ids_host.nbytes},
    )  # fmt: skip


if __name__ == "__main__":
    main()
