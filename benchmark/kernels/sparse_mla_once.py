"""Launch the decode sparse-MLA kernel a few times at one batch and config, for a profiler
(``ncu --kernel-name _sparse_mla_kernel``) to read where its time goes: the benchmark's
graph replays and many configs would drown the one launch to look at.

    ncu --clock-control none -k _sparse_mla_kernel -c 1 --section WarpStateStats \\
        python3 benchmark/kernels/sparse_mla_once.py --batch 3
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from sparse_mla_bench import CONFIG_KEYS, LAT, ROPE, launcher_default, make_inputs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=3)
    p.add_argument(
        "--config", default="", help="block_h,block_k,warps,stages,splits (default: the launcher's)"
    )
    p.add_argument("--launches", type=int, default=3, help="the first warms up and compiles")
    args = p.parse_args()
    from sglang_echo.kernels.sparse_mla import sparse_mla_from_buffer

    cfg = tuple(int(x) for x in args.config.split(",")) if args.config else launcher_default()
    kw = dict(zip(CONFIG_KEYS, cfg, strict=True))
    buffer, inputs = make_inputs(args.batch, 128, 2048, 262_144, torch.device("cuda"), sets=1)
    q, rows = inputs[0]
    for _ in range(args.launches):
        sparse_mla_from_buffer(q, buffer, rows, LAT, (LAT + ROPE) ** -0.5, **kw)
    torch.cuda.synchronize()
    print(f"batch {args.batch}, config {kw}: {args.launches} launches")


if __name__ == "__main__":
    main()
