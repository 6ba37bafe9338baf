"""Our radix top-k beside FlashInfer's (topk_peers.py) at batch 48 x 100K context, k 2048.

The scores are the fp8 indexer's logits over the bench's keys (indexer_bench.make_inputs),
so the distribution is the one the indexer bench times; a tie-heavy copy (the logits on a
0.25 grid) checks the tie order. Correct first: each peer mode's set is compared with
ours on both inputs (``same_set``), and only then timed, replayed from a CUDA graph where
the mode captures (eager otherwise, and the record says which), at the bench's batch and
at batch 1. The first FlashInfer call builds its top-k module (JIT, about 4 minutes on a
fresh H200 machine, skipped where stage topk_peer installs a module built before); it
is timed apart as ``build_and_first_call_s``.

Records made before the serving adapter left the package also time it (FlashInfer's top-k
sorted into our tensor: ``serving_adapter`` and ``by_rows``); it left when it lost its A/B,
and docs/ARCHITECTURE.md section 15 names the record that decided.

    python benchmark/kernels/topk_peer_bench.py --out benchmark/results
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import graph_us, save_record, time_us
from indexer_bench import make_inputs
from topk_peers import FLASHINFER_MODES, flashinfer_topk, same_set, tie_heavy

from sglang_echo.kernels.indexer import fp8_index_logits
from sglang_echo.kernels.topk import topk_positions


def timings(fn, rows: int) -> dict:
    """Graph-replayed us at ``rows`` and at one row (eager where capture fails)."""
    out = {}
    for name, n in (("us", rows), ("us_b1", 1)):
        try:
            out[name] = graph_us(lambda n=n: fn(n))
            out[f"{name}_basis"] = "CUDA-graph replay (device time)"
        except RuntimeError as exc:
            out[name] = time_us(lambda n=n: fn(n))
            out[f"{name}_basis"] = f"eager (graph capture failed: {str(exc)[:120]})"
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmark/results")
    p.add_argument("--batch", type=int, default=48)
    p.add_argument("--context", type=int, default=100_000)
    p.add_argument("--topk", type=int, default=2048)
    args = p.parse_args()
    B, L, k = args.batch, args.context, args.topk
    g = torch.Generator(device="cuda").manual_seed(0)
    q, w, keys, scales, locs, lens = make_inputs(B, L, 64, 128, g)
    logits = fp8_index_logits(q, w, keys, scales, locs, lens)
    qpos = lens.long() - 1
    inputs = {"logits": logits, "tie_heavy": tie_heavy(logits)}
    ours = {name: topk_positions(x, qpos, k) for name, x in inputs.items()}

    metrics: dict = {"batch": B, "context": L, "topk": k}
    metrics["ours"] = timings(lambda n: topk_positions(logits[:n], qpos[:n], k), B)
    print(f"ours: {metrics['ours']}", flush=True)
    peers = {}
    for mode in FLASHINFER_MODES:
        fn = flashinfer_topk(mode)
        if isinstance(fn, str):
            peers[mode] = {"missing": fn}
            print(f"flashinfer {mode}: {fn}", flush=True)
            continue
        start = time.perf_counter()
        got = {name: fn(x, k) for name, x in inputs.items()}
        torch.cuda.synchronize()
        row = {"build_and_first_call_s": time.perf_counter() - start}
        row.update({f"same_set_{name}": same_set(ours[name], got[name]) for name in inputs})
        row["repeatable_order"] = torch.equal(fn(logits, k), got["logits"])
        if row["same_set_logits"]:
            row.update(timings(lambda n, fn=fn: fn(logits[:n], k), B))
            row["ours_over_peer"] = metrics["ours"]["us"] / row["us"]
            row["ours_over_peer_b1"] = metrics["ours"]["us_b1"] / row["us_b1"]
        peers[mode] = row
        print(f"flashinfer {mode}: {row}", flush=True)
    metrics["flashinfer"] = peers
    path = save_record(args.out, "topk_peers", torch.cuda.get_device_name(), metrics)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
