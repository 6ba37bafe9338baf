"""Decode traces of held-out files through our model, trained and untrained; see ``--help``.

Writes one compact npz (selections as uint16, per-step scalars) that ``analyze.py`` turns
into benchmark/results/topk_traces.json + PNGs, and that cache-policy studies can replay:
keys ``<tag>__sel`` [layers, steps, requests, k] (65535 = none), ``<tag>__prefill_sel``
[layers, requests, k] (the last prompt query's selection), ``meta`` (JSON: prompt_lens,
decode step t of request r is at position prompt_lens[r] + t).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))  # oracle_utils: transformers' top-k tie order
sys.path.insert(0, str(REPO))  # research/

from research.topk.experiment import run_experiment  # noqa: E402
from sglang_echo.model.loader import model_dtype  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/tiny-dsv32-trained", help="trained checkpoint folder")
    p.add_argument("--out-npz", default="benchmark/results/topk_traces.npz")
    p.add_argument(
        "--lengths",
        default="2048,4096,8192,16384",
        help="context lengths at the end of decode (comma-separated)",
    )
    p.add_argument("--per-length", type=int, default=2, help="requests per length")
    p.add_argument("--decode-steps", type=int, default=256)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16")
    p.add_argument("--data-roots", default=None, help="as for train_tiny_dsa.py")
    p.add_argument("--oracle-prompts", type=int, default=4, help="0 skips the transformers check")
    p.add_argument("--oracle-prompt-len", type=int, default=512)
    p.add_argument("--oracle-tokens", type=int, default=64)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> Path:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    try:
        lengths = [int(x) for x in args.lengths.split(",") if x] * args.per_length
    except ValueError as exc:
        raise SystemExit(
            f"error: --lengths must be comma-separated integers, got {args.lengths!r}"
        ) from exc
    if not lengths or args.decode_steps < 2:
        raise SystemExit("error: need at least one length and --decode-steps >= 2")
    roots = None
    if args.data_roots:
        roots = [(f"data:{r}", Path(r)) for r in args.data_roots.split(",") if r]
    from oracle_utils import lowest_index_tie_break

    meta, arrays = run_experiment(
        args.model,
        lengths,
        args.decode_steps,
        device,
        model_dtype(args.dtype),
        data_roots=roots,
        oracle_prompts=args.oracle_prompts,
        oracle_prompt_len=args.oracle_prompt_len,
        oracle_tokens=args.oracle_tokens,
        tie_break=lowest_index_tie_break,
        log=lambda msg: print(f"[trace] {msg}", flush=True),
    )
    meta["command"] = "PYTHONPATH=python python benchmark/topk/trace.py " + shlex.join(argv)
    meta["date"] = time.strftime("%Y-%m-%d")
    out = Path(args.out_npz)
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out, meta=np.array(json.dumps(meta)), **arrays)
    print(f"[trace] wrote {out} ({out.stat().st_size / 1e6:.1f} MB)", flush=True)
    return out


if __name__ == "__main__":
    main()
