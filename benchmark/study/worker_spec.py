"""The study's model as a folder the server can serve: ``study_worker.json`` + a tokenizer.

Why: the request-rate sweeps (Figures 12-15) go through the HTTP server and the serving
benchmark, like any model; the study's worker (DeepSeek-V3.2 attention dimensions, one DP
worker's routed MoE) is random and cheap to rebuild, so instead of gigabytes of weights
the folder holds its recipe (dimensions, layers, seed), and the server builds it in
memory, deterministically, when ``--model-path`` points there and the benchmarks' loader
is given (``--model-loader benchmark.study.loader:load``, benchmark/study/loader.py).

    python -m benchmark.study.worker_spec --out DIR [--layers 8] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from benchmark.study.worker import (
    DSV32_DIMS,
    DSV32_MOE,
    SMOKE_DIMS,
    SMOKE_MOE,
    build_worker,
    study_config,
)
from sglang_echo.tokenizer import save_byte_tokenizer

SPEC_FILE = "study_worker.json"
SIZES = {"dsv32": (DSV32_DIMS, DSV32_MOE), "smoke": (SMOKE_DIMS, SMOKE_MOE)}


def is_study_worker(model_path: str | Path) -> bool:
    return (Path(model_path) / SPEC_FILE).is_file()


def write_spec(
    out: str | Path,
    layers: int = 8,
    size: str = "dsv32",
    vocab: int = 4096,
    max_position: int = 131_072,
    indexer_mode: str = "fp8_hadamard",
    seed: int = 0,
) -> Path:
    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    spec = {
        "size": size,
        "layers": layers,
        "vocab": vocab,
        "max_position": max_position,
        "indexer_mode": indexer_mode,
        "seed": seed,
    }
    path = out / SPEC_FILE
    path.write_text(json.dumps(spec, indent=2) + "\n")
    save_byte_tokenizer(out)  # text prompts work; ids >= 259 are sent as input_ids
    return path


def load_study_worker(model_path: str | Path, device: torch.device | str, dtype: torch.dtype):
    """Build the worker the folder's spec describes (random, deterministic by its seed)."""
    spec = json.loads((Path(model_path) / SPEC_FILE).read_text())
    dims, moe = SIZES[spec["size"]]
    cfg = study_config(
        dims, spec["layers"], spec["vocab"], spec["max_position"], spec["indexer_mode"]
    )
    model, _ = build_worker(cfg, moe, dtype, device, seed=spec["seed"])
    return model


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmark.study.worker_spec", description=__doc__)
    ap.add_argument("--out", required=True, help="folder to write study_worker.json into")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--smoke", action="store_true", help="tiny dimensions (CPU tests)")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--max-position", type=int, default=131_072)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        path = write_spec(
            args.out,
            args.layers,
            "smoke" if args.smoke else "dsv32",
            args.vocab,
            args.max_position,
            seed=args.seed,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
