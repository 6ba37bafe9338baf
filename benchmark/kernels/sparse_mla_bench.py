"""Sparse MLA: the Triton kernel (kernels/sparse_mla.py) vs the torch path, with its roofline.

Sizes (DeepSeek-V3.2, bf16): decode = batch 48 x top-k 2048 x 128 heads x 576-wide rows
(512 latent + 64 rope), and a prefill block of 64 queries x 2048. Rows are drawn at random
from a 262,144-row buffer (ECHO's device-cache slots are scattered), three index sets
rotated so no run re-reads the last one's rows from L2.

- kernel: ``sparse_mla_from_buffer`` reads each query's rows through the index, no copy;
  every configuration of the sweep (head and row blocks, warps, stages, K splits) is
  checked and timed, the fastest is reported (and the default's time beside it);
- torch: ``sparse_mla_reference`` = gather ``buffer[rows]`` into [Q, K, 576] + the model's
  ``sparse_mla`` (two batched matmuls, float32 softmax): what MLAttention runs today.

Roofline, both ceilings measured in this run: bytes = Q*K*576*2 (the rows, read once) +
q (Q*H*576*2) + out (Q*H*512*2) + the index (Q*K*8) at the HBM copy bandwidth (a 4 GiB
device copy, read + write); FLOPs = Q*H*K*(576 + 512)*2 at the bf16 matmul rate (8192^3
torch.matmul). The larger time is the floor. Correctness: relative L2 error of every
configuration against the float32 torch path on the same bf16 inputs (bf16 tolerance 1e-2).
Times: CUDA events, warm-up, medians (common.time_us).

    python benchmark/kernels/sparse_mla_bench.py --out benchmark/results
    python benchmark/kernels/sparse_mla_bench.py --device cpu --out /tmp/smla   # smoke, tiny
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import graph_us, pyplot, save_record, time_us
from mla_peers import flashinfer_mla, slot_invariant

LAT, ROPE = 512, 64
# (block_h, block_k, num_warps, num_stages, splits). The launcher's default config
# (kernels/sparse_mla.py DEFAULT_*) is timed too, listed or not: it is the "default" column.
# 32-head tiles use mma.sync (no wgmma: Hopper's warpgroup MMA needs 64 rows); 64-head tiles
# use wgmma without spills at 8 warps (sm90_resources.json); splits > 1 add programs at the
# cost of a merge pass; 64-row blocks need 2-3 stages to fit shared memory (221 KB).
CONFIGS = [
    (32, 32, 8, 2, 1),
    (32, 32, 8, 3, 1),
    (32, 32, 8, 2, 2),
    (32, 32, 8, 2, 4),
    (32, 16, 4, 2, 1),
    (32, 16, 4, 3, 2),
    (16, 32, 4, 2, 1),
    (16, 16, 4, 2, 1),
    (64, 32, 8, 2, 1),
    (64, 16, 8, 2, 1),
    (64, 32, 16, 2, 1),
    (64, 32, 8, 2, 2),
    (64, 32, 8, 5, 1),
    (64, 64, 8, 2, 1),
    (64, 64, 8, 3, 1),
]
CPU_CONFIGS = [(32, 32, 8, 2, 1), (16, 16, 4, 2, 2)]


def cpu_time_us(fn, warmup: int = 1, reps: int = 3) -> float:
    """Median host time (the CPU smoke run: the Triton interpreter, no device events)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def hbm_gbps(dev: torch.device, nbytes: int, timer) -> float:
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    us = timer(lambda: dst.copy_(src))
    return 2 * nbytes / us / 1e3  # read + write


def bf16_tflops(dev: torch.device, n: int, timer) -> float:
    a = torch.randn(n, n, device=dev).to(torch.bfloat16)
    b = torch.randn(n, n, device=dev).to(torch.bfloat16)
    us = timer(lambda: torch.matmul(a, b))
    return 2 * n**3 / us / 1e6


def make_inputs(queries, heads, topk, slots, dev, sets=3):
    """Index sets (rotated), their queries, and one shared buffer; nothing is zero."""
    g = torch.Generator(device=dev).manual_seed(queries * 7 + topk)
    buffer = torch.randn(slots, LAT + ROPE, device=dev, generator=g).to(torch.bfloat16)
    inputs = []
    for _ in range(sets):
        q = torch.randn(queries, heads, LAT + ROPE, device=dev, generator=g).to(torch.bfloat16)
        rows = torch.randint(0, slots, (queries, topk), device=dev, generator=g)
        inputs.append((q, rows))
    return buffer, inputs


def roofline(queries, heads, topk, bw_gbps, tflops) -> dict:
    moved = queries * topk * (LAT + ROPE) * 2 + queries * heads * (2 * LAT + ROPE) * 2
    moved += queries * topk * 8
    flops = queries * heads * topk * (LAT + ROPE + LAT) * 2
    mem_us, flop_us = moved / bw_gbps / 1e3, flops / tflops / 1e6
    return {
        "bytes": moved,
        "flops": flops,
        "mem_us": mem_us,
        "flop_us": flop_us,
        "roofline_us": max(mem_us, flop_us),
    }


CONFIG_KEYS = ("block_h", "block_k", "num_warps", "num_stages", "splits")


def launcher_default(decode: bool = True) -> tuple[int, int, int, int, int]:
    """The config the model runs: the launcher's block sizes, split ``DECODE_SPLITS`` ways
    in decode and unsplit in prefill. Imported late: TRITON_INTERPRET must be set before
    the kernel module loads."""
    from sglang_echo.kernels import sparse_mla as k

    return (
        k.DEFAULT_BLOCK_H,
        k.DEFAULT_BLOCK_K,
        k.DEFAULT_NUM_WARPS,
        k.DEFAULT_NUM_STAGES,
        k.DECODE_SPLITS if decode else k.DEFAULT_SPLITS,
    )


def measure(name, queries, heads, topk, slots, dev, configs, timer, bw, tflops) -> dict:
    from sglang_echo.kernels.sparse_mla import sparse_mla_from_buffer, sparse_mla_reference

    scale = (LAT + ROPE) ** -0.5
    buffer, inputs = make_inputs(queries, heads, topk, slots, dev)
    q0, rows0 = inputs[0]
    want = sparse_mla_reference(q0.float(), buffer.float(), rows0, LAT, scale).double()
    it = iter(range(1 << 30))

    def rotate():
        return inputs[next(it) % len(inputs)]

    default = launcher_default(decode=name == "decode")
    configs = configs if default in configs else [default, *configs]
    results = []
    for bh, bk, warps, stages, splits in configs:
        cfg = {"block_h": bh, "block_k": bk, "num_warps": warps, "num_stages": stages}
        cfg["splits"] = splits
        try:
            got = sparse_mla_from_buffer(q0, buffer, rows0, LAT, scale, **cfg)
        except Exception as exc:  # a config this Triton cannot compile: recorded, skipped
            results.append({**cfg, "error": str(exc).splitlines()[0][:200]})
            continue
        err = ((got.double() - want).norm() / want.norm()).item()
        finite = bool(torch.isfinite(got).all())

        def run(cfg=cfg):
            q, rows = rotate()
            sparse_mla_from_buffer(q, buffer, rows, LAT, scale, **cfg)

        results.append({**cfg, "rel_err": err, "finite": finite, "us": timer(run)})

    def run_torch():
        q, rows = rotate()
        sparse_mla_reference(q, buffer, rows, LAT, scale)

    # fp8 KV rows (kernels/fp8_kv.py, 656 bytes), dequantized in registers, at the default
    # config: checked against the float32 attention on the same dequantized rows.
    from sglang_echo.kernels.fp8_kv import dequantize_kv_rows, quantize_kv_rows

    packed = quantize_kv_rows(buffer, LAT)
    deq = dequantize_kv_rows(packed, LAT, buffer.dtype)
    want_fp8 = sparse_mla_reference(q0.float(), deq.float(), rows0, LAT, scale).double()
    splits = default[4]  # the model's split count for this run
    got_fp8 = sparse_mla_from_buffer(q0, packed, rows0, LAT, scale, splits=splits)
    fp8_err = ((got_fp8.double() - want_fp8).norm() / want_fp8.norm()).item()

    def run_fp8():
        q, rows = rotate()
        sparse_mla_from_buffer(q, packed, rows, LAT, scale, splits=splits)

    torch_err = sparse_mla_reference(q0, buffer, rows0, LAT, scale).double()
    torch_err = ((torch_err - want).norm() / want.norm()).item()
    good = [r for r in results if r.get("finite") and r["rel_err"] <= 1e-2]
    best = min(good, key=lambda r: r["us"]) if good else None
    out = {
        "queries": queries,
        "heads": heads,
        "topk": topk,
        "slots": slots,
        "configs": results,
        "best": best,
        "default_config": dict(zip(CONFIG_KEYS, default, strict=True)),
        "default_us": next(
            (r.get("us") for r in results if tuple(r[k] for k in CONFIG_KEYS) == default), None
        ),
        "torch_us": timer(run_torch),
        "fp8_us": timer(run_fp8),
        "fp8_rel_err": fp8_err,
        "fp8_row_bytes": packed.shape[1],
        "torch_rel_err": torch_err,
        "max_rel_err": max((r["rel_err"] for r in results if "rel_err" in r), default=None),
        "all_correct": len(good) == len(results),
        **roofline(queries, heads, topk, bw, tflops),
    }
    print(
        f"{name}: kernel {best['us'] if best else float('nan'):.1f} us (best of "
        f"{len(results)}), torch {out['torch_us']:.1f} us, roofline {out['roofline_us']:.1f} us"
    )
    return out


# Our configs timed at every batch of --batches: the launcher's default and its neighbours.
# 64-row blocks became the default on 2026-12-01 (eighth session): a step of the walk costs
# nearly the same whatever the rows in it, so wider blocks amortize it. The 32-row default
# before it stays as "k32" (the same run's baseline), with its split counts; deeper
# pipelines of 32- and 16-row blocks (5-10 stages) were no faster
# (history/2026-12-01-sparse-mla-stages-c4a9e6c/). The merge no longer spills
# (kernels/sparse_mla.py _combine_kernel), so many splits are timed too.
BATCH_SWEEP_CONFIGS = {
    "k32": (64, 32, 8, 2, 4),
    "split4_h32": (32, 32, 8, 2, 4),
    "k32_split8": (64, 32, 8, 2, 8),
    "k32_split16": (64, 32, 8, 2, 16),
    # 64 rows split 4 ways is the launcher's default, timed as "default"
    "k64_stages3": (64, 64, 8, 3, 4),
    "k64_split2": (64, 64, 8, 2, 2),
    "k64_split8": (64, 64, 8, 2, 8),
}
L2_DEFEAT_BYTES = 96 << 20  # index sets per batch: enough distinct rows to overflow L2


CPU_BATCH_SWEEP = ("split4_h32", "k64_split2")  # the smoke run's few


def batch_sweep(batches, heads, topk, slots, dev, peers: list[str], timer=graph_us) -> dict:
    """Decode at each batch: our default and small-batch configs and each peer, every one
    checked against float64, for slot invariance, and timed (``graph_us`` on CUDA) over
    enough index sets that no replay finds its rows in L2 (all sets in one graph, time /
    sets)."""
    from sglang_echo.kernels.sparse_mla import sparse_mla_from_buffer, sparse_mla_reference

    scale = (LAT + ROPE) ** -0.5
    sweep = BATCH_SWEEP_CONFIGS
    if dev.type == "cpu":  # interpreted: a few configs, enough to exercise every path
        sweep = {k: v for k, v in sweep.items() if k in CPU_BATCH_SWEEP}
    ours = {"default": launcher_default(), **sweep}
    planners: dict = {}
    for name, cfg in ours.items():
        kw = dict(zip(CONFIG_KEYS, cfg, strict=True))
        planners[f"ours_{name}"] = lambda q, b, r, kw=kw: (
            lambda: sparse_mla_from_buffer(q, b, r, LAT, scale, **kw)
        )
    missing = {}
    for peer in peers:
        made = flashinfer_mla(LAT, scale) if peer == "flashinfer" else f"unknown peer {peer!r}"
        if isinstance(made, str):
            missing[peer] = made
        else:
            planners[peer] = made
    basis = "CUDA-graph replay (device time)" if timer is graph_us else "host time (smoke run)"
    out = {"batches": {}, "missing_peers": missing, "basis": basis}
    for b in batches:
        set_bytes = b * topk * (LAT + ROPE) * 2
        sets = max(3, min(16, -(-L2_DEFEAT_BYTES // set_bytes)))
        buffer, inputs = make_inputs(b, heads, topk, slots, dev, sets=sets)
        q0, rows0 = inputs[0]
        want = sparse_mla_reference(q0.float(), buffer.float(), rows0, LAT, scale).double()
        row = {"index_sets": sets}
        for name, plan in planners.items():
            try:
                thunks = [plan(q, buffer, rows) for q, rows in inputs]
                got = thunks[0]()  # inputs[0] is (q0, rows0)
                invariant = slot_invariant(plan, q0, buffer, rows0)
            except Exception as exc:  # a peer that fails at this shape: recorded, skipped
                row[name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
                continue
            err = ((got.double() - want).norm() / want.norm()).item()

            def all_sets(thunks=thunks):
                for t in thunks:
                    t()

            entry = {"rel_err": err, "slot_invariant": invariant, "basis": basis}
            if hasattr(thunks[0], "layout"):  # a peer says how it read the rows
                entry["layout"] = thunks[0].layout
            try:
                entry["us"] = timer(all_sets) / sets
            except Exception as exc:  # e.g. a peer that cannot be captured in a graph
                entry["graph_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                entry["basis"] = "eager launches (CUDA events; includes launch overhead)"
                entry["us"] = time_us(all_sets) / sets if dev.type == "cuda" else None
            row[name] = entry
        out["batches"][str(b)] = row
        print(f"batch {b}: " + ", ".join(
            f"{k} {v['us']:.1f} us" if v.get("us") else f"{k} failed"
            for k, v in row.items() if isinstance(v, dict)
        ))  # fmt: skip
    return out


def plot(path: Path, metrics: dict, device: str) -> None:
    plt = pyplot()
    if plt is None:
        print("matplotlib missing: no PNG")
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, name in zip(axes, ("decode", "prefill"), strict=True):
        r = metrics["runs"][name]
        labels = ["kernel (best)", "kernel (default)", "torch gather+matmul", "roofline"]
        values = [
            r["best"]["us"] if r["best"] else float("nan"),
            r["default_us"] or float("nan"),
            r["torch_us"],
            r["roofline_us"],
        ]
        ax.bar(labels, values, color=["C0", "C9", "C1", "0.6"])
        for i, v in enumerate(values):
            ax.text(i, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
        ax.set_title(f"{name}: {r['queries']} q x top-k {r['topk']} x {r['heads']} heads")
        ax.set_ylabel("us")
        ax.tick_params(axis="x", rotation=20, labelsize=8)
    fig.suptitle(f"sparse MLA, bf16, 576-wide rows ({device})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmark/results")
    p.add_argument("--device", default="cuda", help="cuda (timed) or cpu (interpreter smoke run)")
    p.add_argument("--batch", type=int, default=None, help="decode queries (48; cpu 2)")
    p.add_argument("--prefill-queries", type=int, default=None, help="(64; cpu 3)")
    p.add_argument("--topk", type=int, default=None, help="(2048; cpu 40)")
    p.add_argument("--heads", type=int, default=None, help="(128; cpu 40)")
    p.add_argument("--slots", type=int, default=None, help="buffer rows (262144; cpu 256)")
    p.add_argument(
        "--batches",
        default="",
        help="also time decode at these batches (e.g. 3,17,48), graph-replayed, ours and "
        "--peer beside it",
    )
    p.add_argument(
        "--peer",
        action="append",
        default=[],
        choices=["flashinfer"],
        help="a peer kernel for --batches: flashinfer (MLA paged decode at page size 1 "
        "over the selected rows; carried as .peer/, installed as benchmark/device_session.sh "
        "does)",
    )
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    dev = torch.device(args.device)
    cpu = dev.type == "cpu"
    if cpu:  # set before the kernel module (and Triton's jit) is imported
        os.environ["TRITON_INTERPRET"] = "1"
        torch.set_num_threads(1)
    elif not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --device cpu for the smoke run")

    def pick(value, gpu, small):
        return value if value is not None else (small if cpu else gpu)

    batch, pre = pick(args.batch, 48, 2), pick(args.prefill_queries, 64, 3)
    topk, heads, slots = (
        pick(args.topk, 2048, 40),
        pick(args.heads, 128, 40),
        pick(args.slots, 262_144, 256),
    )
    timer = cpu_time_us if cpu else time_us
    bw = hbm_gbps(dev, 64 << 20 if cpu else 4 << 30, timer)
    tflops = bf16_tflops(dev, 512 if cpu else 8192, timer)
    configs = CPU_CONFIGS if cpu else CONFIGS
    runs = {
        name: measure(name, q, heads, topk, slots, dev, configs, timer, bw, tflops)
        for name, q in (("decode", batch), ("prefill", pre))
    }
    dec, pf = runs["decode"], runs["prefill"]
    device = "cpu (Triton interpreter; smoke run)" if cpu else torch.cuda.get_device_name()
    errs = [r["max_rel_err"] for r in runs.values() if r["max_rel_err"] is not None]
    metrics = {
        "decode_us": dec["best"]["us"] if dec["best"] else None,
        "decode_default_us": dec["default_us"],
        "decode_torch_us": dec["torch_us"],
        "decode_fp8_us": dec["fp8_us"],
        "prefill_fp8_us": pf["fp8_us"],
        "fp8_rel_err": max(r["fp8_rel_err"] for r in runs.values()),
        "decode_roofline_us": dec["roofline_us"],
        "decode_roofline_mem_us": dec["mem_us"],
        "decode_roofline_flop_us": dec["flop_us"],
        "decode_best_config": dec["best"],
        "prefill_us": pf["best"]["us"] if pf["best"] else None,
        "prefill_default_us": pf["default_us"],
        "prefill_torch_us": pf["torch_us"],
        "prefill_roofline_us": pf["roofline_us"],
        "prefill_best_config": pf["best"],
        "max_rel_err": max(errs) if errs else None,
        "torch_bf16_rel_err": max(r["torch_rel_err"] for r in runs.values()),
        "all_correct": all(r["all_correct"] for r in runs.values())
        and all(r["fp8_rel_err"] <= 1e-2 for r in runs.values()),
        "hbm_GBps": bw,
        "bf16_TFLOPs": tflops,
        "sizes": {"batch": batch, "prefill_queries": pre, "topk": topk, "heads": heads},
        "runs": runs,
    }
    if batches:
        sweep_timer = cpu_time_us if cpu else graph_us
        sweep = batch_sweep(batches, heads, topk, slots, dev, args.peer, sweep_timer)
        metrics["batch_sweep"] = sweep
        for b, row in sweep["batches"].items():  # flat names for the README's rows
            for name, v in row.items():
                if isinstance(v, dict) and v.get("us"):
                    metrics[f"decode_b{b}_{name}_us"] = v["us"]
    path = save_record(args.out, "sparse_mla", device, metrics)
    plot(Path(args.out) / "sparse_mla.png", metrics, device)
    for name, r in runs.items():  # every configuration first: the summary prints last
        for c in r["configs"]:
            print(name, {k: (round(v, 6) if isinstance(v, float) else v) for k, v in c.items()})
    print(f"HBM copy {bw:.0f} GB/s, bf16 matmul {tflops:.1f} TFLOP/s; record {path}")
    print(f"{'run':8s} {'kernel us':>10s} {'default':>9s} {'torch us':>9s} {'roofline':>9s} "
          f"{'mem':>7s} {'flop':>7s} {'max err':>8s}")  # fmt: skip
    for name, r in runs.items():
        best = r["best"]["us"] if r["best"] else float("nan")
        print(
            f"{name:8s} {best:10.1f} {r['default_us'] or float('nan'):9.1f} {r['torch_us']:9.1f} "
            f"{r['roofline_us']:9.1f} {r['mem_us']:7.1f} {r['flop_us']:7.1f} "
            f"{r['max_rel_err'] or float('nan'):8.1e}"
        )
        print(f"{'':8s} best config {r['best']}")


if __name__ == "__main__":
    main()
