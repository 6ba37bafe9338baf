"""Run one decode indexer step (the fp8 logits, then the radix top-k's six launches) at one
batch of 100K-token requests, for a profiler to read where each launch's time goes:

    ncu --clock-control none -c 7 -k "regex:_fp8_index_logits_kernel|_hist_kernel|_split_kernel|_cand_hist_kernel|_count_kernel|_collect_kernel" \\
        --section WarpStateStats python3 benchmark/kernels/indexer_once.py --batch 48

The bench (indexer_bench.py) times many launch shapes replayed from graphs; a profile of
one launch of each kernel, at the defaults the model runs, is what this is for.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from indexer_bench import make_inputs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=48)
    p.add_argument("--context", type=int, default=100_000)
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--steps", type=int, default=2, help="indexer steps (logits + top-k) to run")
    args = p.parse_args()
    from sglang_echo.kernels.indexer import fp8_index_logits
    from sglang_echo.kernels.topk import topk_positions

    q, w, keys, scales, locs, lens = make_inputs(
        args.batch, args.context, 64, 128, torch.Generator(device="cuda").manual_seed(0)
    )
    qpos = lens.long() - 1
    for _ in range(args.steps):
        logits = fp8_index_logits(q, w, keys, scales, locs, lens)
        picked = topk_positions(logits, qpos, args.topk)
    torch.cuda.synchronize()
    print(
        f"batch {args.batch} x {args.context}: {args.steps} steps, {int((picked >= 0).sum())} picks"
    )


if __name__ == "__main__":
    main()
