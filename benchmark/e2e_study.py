"""The end-to-end study on one GPU (issue 14): a fake-transfer PD decode node holding
100K-110K-token requests, ECHO vs no-offload, at DeepSeek-V3.2's per-layer dimensions.

    PYTHONUNBUFFERED=1 python3 benchmark/e2e_study.py --out DIR      # the H200 run
    python benchmark/e2e_study.py --smoke --out DIR                  # tiny, on the CPU

benchmark/results/e2e_study.json (+ .log) came from the stage ``study`` of
``benchmark/device_session.sh`` (``--repeats 5 --deadline-s 260``) on one H200, and
e2e_study_fp8.json from its stage ``study_fp8`` (``--kv-cache-dtype fp8_e4m3``); each record
holds its command, and benchmark/results/PROVENANCE.md names the code.

The model (benchmark/study/worker.py) is random, built in memory: DeepSeek-V3.2's real
attention and indexer dimensions (hidden 7168, 128 heads, q_lora 1536, kv_lora 512, rope
64, v_head 128, indexer 64 x 128 fp8, top-k 2048), bf16 KV, and in every layer one DP
worker's share of the 4-bit MoE at equal bytes (study/moe.py: 32 local experts touched by
a global batch of 8 x b tokens). Requests are admitted by the decode node
(study/decode_node.py) as their engine's capacity rules allow (no-offload: pool //
context; ECHO: min(N_G // top-k, host pool // context)), with synthetic prompt KV
(sglang_echo/runtime/synthetic_kv.py) whose top-k locality is set by one knob (study/locality.py;
every result carries ``locality_source``). Decode steps run from CUDA graphs after a
warm-up; per-step device time is measured with CUDA events (medians), host time with
the wall clock; output tokens/s = batch / device step time.

Settings: the paper's (no-offload pool 380K tokens vs NSA_DEV_CACHE_SIZE 260K with a host
pool of 1.8M; then both at 200K and at 110K), equal HBM at 380K (every byte of KV state
counted: ECHO's device rows and metadata, the index keys and host->device map of every
host token), and batch 1-4 without pressure.

Noise: one H200's step times drift ~15% from run to run, so a ratio of two measurements
taken minutes apart says little. Each ratio's phases are measured ``--repeats`` times in
one run, ECHO and its no-offload baseline interleaved (baseline, ECHO, baseline, ECHO: the
engines of such a block live together), and the metrics take each side's median; the
spread (``ratio_min``/``ratio_max`` over every pair, ``details.repeats``) comes with them.

Depth: the measured steps have L layers (8). ``estimate_61_layers`` is an estimate, not a
measurement: the step's fixed part (embedding, final norm, the 4096-entry LM head,
sampling) is timed alone at each batch, the rest of the step is L identical layers, and
a 61-layer step is the fixed part plus 61 such layers (DeepSeek-V3.2's 3 dense-FFN layers
counted as MoE layers); on a GPU also with a timed 129,280-entry LM head. The record
(<out>/e2e_study.json) is rewritten after every phase, so a timeout still leaves data.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmark.e2e, benchmark.study

from benchmark.e2e import timing
from benchmark.e2e.lossless import MIN_TOKENS_COMPARED
from benchmark.e2e.study import Study
from sglang_echo.offload.hisparse_cache import DEFAULT_DEVICE_BUFFER_SIZE

# This file is the study's command line; the harness is benchmark/e2e/ (plan, engines,
# measure, lossless, extrapolate, metrics, record: its __init__ says which does what).
timing.start()  # the log's clock and --deadline-s count from here, the imports done

# Repeats of each baseline/ECHO pair when --repeats is not given: two on the GPU (the
# noise there is ~15% run to run), two in the smoke run too so its record has spreads.
GPU_REPEATS = 2
SMOKE_REPEATS = 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default="benchmark/results")
    ap.add_argument("--smoke", action="store_true", help="tiny configuration on the CPU")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "fp8_e4m3"],
        help="KV rows as stored by every backend: auto = the model dtype (bf16 on the GPU); "
        "fp8_e4m3 = 656-byte rows (with --smoke the tiny latent becomes one 128-wide tile)",
    )
    ap.add_argument("--warmup", type=int, default=8, help="decode steps before measuring")
    ap.add_argument("--steps", type=int, default=32, help="measured decode steps")
    ap.add_argument("--profile-steps", type=int, default=3, help="profiled steps (0: none)")
    ap.add_argument("--locality", type=float, default=0.9, help="stable fraction of the top-k")
    ap.add_argument("--random-keys", action=argparse.BooleanOptionalAction, default=True,
                    help="also the random-keys run (the pessimistic bound)")  # fmt: skip
    ap.add_argument("--only", default="", help="comma-separated engine labels to run")
    ap.add_argument(
        "--decode-prefetch",
        action="store_true",
        help="the decode prefetch's A/B: echo_paper (SGLANG_NSA_FUSE_LOGITS_RECALL_DECODE=auto, "
        "the default) beside ECHO without it (engine echo_noprefetch), phase by phase at the "
        "paper's setting and on random keys",
    )
    ap.add_argument(
        "--fill-max",
        type=int,
        default=150,
        help="ECHO: at most this many extra warm-up steps until the cache evicts",
    )
    ap.add_argument("--locality-sweep", default="0.5,0.7",
                    help="extra stable fractions run at the paper's all-HBM setting")  # fmt: skip
    ap.add_argument("--skip-components", action="store_true")
    ap.add_argument(
        "--hisparse-buffer",
        type=int,
        default=0,
        help="the HiSparse-like backend's device_buffer_size per request and layer "
        f"(default {DEFAULT_DEVICE_BUFFER_SIZE}, HiSparse's)",
    )
    ap.add_argument("--deadline-s", type=float, default=0.0,
                    help="start no engine and no repeat after this many seconds (0: no limit)")  # fmt: skip
    ap.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="measurements of each ratio's phases, ECHO and its baseline interleaved "
        f"(A B A B); ratios use the medians (default {GPU_REPEATS}, smoke {SMOKE_REPEATS})",
    )
    ap.add_argument("--skip-fixed", action="store_true",
                    help="do not time the fixed part (the 61-layer estimate then leaves it out)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.repeats is None:
        args.repeats = SMOKE_REPEATS if args.smoke else GPU_REPEATS
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    if not args.smoke and 1 + args.warmup + args.steps < MIN_TOKENS_COMPARED:
        ap.error(
            f"the lossless checks compare at least {MIN_TOKENS_COMPARED} tokens per request: "
            f"--warmup + --steps must be at least {MIN_TOKENS_COMPARED - 1}"
        )
    if args.smoke:
        args.warmup, args.steps, args.profile_steps = min(args.warmup, 2), min(args.steps, 3), 0
        args.fill_max = min(args.fill_max, 20)
    return args


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    return Study(parse_args(argv), argv).run()


if __name__ == "__main__":
    main()
