"""Victim policies of ECHO's shared per-layer cache on real selection traces: the trained
model's decode top-k (benchmark/topk/trace.py, `topk_traces.npz`), untrained beside it.

Why a study of its own: a synthetic trace with uniform reuse gives every policy the same
hit rate (cache_ops.json showed 0.971 for all four), so it cannot choose between them.
Each layer's trace is one shared cache across the batch's requests (each request's
positions mapped to disjoint host ids), at several cache sizes in units of one step's
selections (batch x top-k). Runs on the CPU in about a minute.

    python benchmark/kernels/victim_policy_study.py --npz benchmark/results/topk_traces.npz
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import pyplot, save_record
from victim_policies import POLICIES, policy_hit_rates


def layer_traces(npz: np.lib.npyio.NpzFile, model: str) -> tuple[torch.Tensor, int]:
    """[layers, steps, batch, k] host ids (request r's position p -> r * stride + p) and
    the host pool size they need."""
    sel = torch.from_numpy(npz[f"{model}__sel"].astype(np.int64))
    stride = int(sel.max()) + 1
    offsets = torch.arange(sel.shape[2], dtype=torch.int64).view(1, 1, -1, 1) * stride
    return sel + offsets, stride * sel.shape[2] + 1


def study(npz_path: Path, factors: list[float]) -> dict:
    npz = np.load(npz_path)
    result: dict = {}
    for model in ("trained", "untrained"):
        traces, host = layer_traces(npz, model)
        n_layers, steps, batch, k = traces.shape
        per_factor = {}
        for factor in factors:
            slots = int(factor * batch * k)
            per_layer = [
                policy_hit_rates(traces[layer], slots, host, steps // 2)
                for layer in range(n_layers)
            ]
            per_factor[str(factor)] = {
                "slots": slots,
                "per_layer": per_layer,
                "mean": {p: statistics.fmean(r[p] for r in per_layer) for p in POLICIES},
            }
            means = per_factor[str(factor)]["mean"]
            print(
                f"{model:9s} x{factor:<5} {slots:6d} slots  "
                + "  ".join(f"{p} {means[p]:.4f}" for p in POLICIES)
            )
        result[model] = per_factor
    return result


def plot(record_path: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    record = json.loads(record_path.read_text())
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, model in zip(axes, ("trained", "untrained"), strict=True):
        data = record["metrics"][model]
        factors = sorted(data, key=float)
        for policy in POLICIES:
            ax.plot(
                [float(f) for f in factors],
                [data[f]["mean"][policy] for f in factors],
                marker="o",
                label=policy,
            )
        ax.set_title(f"{model} model: shared cache, mean over layers")
        ax.set_xlabel("cache size (x batch x top-k)")
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("hit rate (second half of the trace)")
    axes[0].legend()
    fig.tight_layout()
    out = record_path.with_suffix(".png")
    fig.savefig(out, dpi=120)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--npz", required=True, help="topk_traces.npz from benchmark/topk/trace.py")
    p.add_argument(
        "--factors",
        default="1.25,2,4",
        help="cache sizes in units of batch x top-k, comma-separated (default 1.25,2,4)",
    )
    p.add_argument("--out", default="benchmark/results", help="folder for the JSON and PNG")
    args = p.parse_args()
    npz = Path(args.npz)
    if not npz.is_file():
        p.error(f"{npz} not found: run benchmark/topk/run_on_gpu.sh (or trace.py) first")
    try:
        factors = [float(f) for f in args.factors.split(",")]
    except ValueError:
        p.error(f"--factors must be numbers separated by commas, got {args.factors!r}")
    if any(f <= 1.0 for f in factors):
        p.error("every factor must exceed 1 (the cache must hold one step's selections)")
    start = time.time()
    metrics = study(npz, factors)
    trained_best = {
        f: max(POLICIES, key=lambda pol, f=f: metrics["trained"][f]["mean"][pol])
        for f in metrics["trained"]
    }
    metrics["best_policy_trained"] = trained_best
    path = save_record(args.out, "victim_policy", "cpu (simulation)", metrics, trace=str(npz))
    png = plot(path)
    print(f"wrote {path}{' and ' + str(png) if png else ''} in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
