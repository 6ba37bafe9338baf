"""The benchmarks' model loader for the server: the study's worker folders, and the top-k
locality knob, which ALTERS THE SERVED MODEL'S WEIGHTS.

The product server loads checkpoints and never changes weights. The e2e sweeps need two
things more: serving the study's worker (a folder with ``study_worker.json``, written by
``python -m benchmark.study.worker_spec``: DeepSeek-V3.2 attention dimensions and one DP
worker's routed MoE, built in memory from its recipe), and a decode node whose synthetic
prompt KV keeps a set fraction of each step's top-k, which takes biased indexers. Both go
through the runtime's one extension point, ``--model-loader`` (its contract:
python/sglang_echo/runtime/model_loader.py). From the repository root::

    PYTHONPATH=.:python python -m sglang_echo.launch_server --model-path DIR \\
        --disaggregation-mode decode --disaggregation-transfer-backend fake \\
        --model-loader benchmark.study.loader:load \\
        --model-loader-args="--fake-kv-locality 0.9"

    python -m benchmark.study.loader --help        # the flags --model-loader-args takes

A checkpoint folder loads as the server would load it; a study worker folder is built.
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmark.study.locality import favoured_directions, install_preference
from benchmark.study.worker_spec import is_study_worker, load_study_worker
from sglang_echo.config import settings
from sglang_echo.model.attention import ModelKernels
from sglang_echo.model.deepseek_v32 import DeepseekV32ForCausalLM
from sglang_echo.model.loader import load_model
from sglang_echo.runtime.model_loader import LOCALITY_KEY

SPEC = "benchmark.study.loader:load"  # what the scripts pass to --model-loader

FAKE_KV_LOCALITY_HELP = (
    "ALTERS THE SERVED MODEL'S WEIGHTS (benchmark-only). For a PD decode node with the fake "
    "transfer backend: the fraction of each step's top-k that a fixed set of prompt tokens "
    "holds in the synthetic prompt KV (0 = random keys, labelled 'random'; 0.9 gives hit "
    "rates near DeepSeek-V3.2's). Above 0, every layer's indexer gets biases on its query "
    "and head-weight projections toward the hot keys' favoured direction "
    "(benchmark/study/locality.py install_preference), so the model served is no longer the "
    "checkpoint: its outputs are meaningless, its speed is the point. Needs "
    "--disaggregation-mode decode. Default 0 (weights untouched)"
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # a start-up error of the server, not an exit
        raise ValueError(f"{message} (python -m benchmark.study.loader --help)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m benchmark.study.loader",
        description="Flags of the benchmarks' model loader, given to the server as "
        '--model-loader benchmark.study.loader:load --model-loader-args="FLAGS".',
    )
    p.add_argument("--fake-kv-locality", type=float, default=0.0, help=FAKE_KV_LOCALITY_HELP)
    return p


def load(
    model_path: str,
    *,
    device: torch.device,
    dtype: torch.dtype,
    argv: list[str],
    server_args,
) -> tuple[DeepseekV32ForCausalLM, dict]:
    """``--model-loader`` entry: (model, info) for ``model_path`` (see the module doc)."""
    opts = build_parser().parse_args(argv)
    p = opts.fake_kv_locality
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"--fake-kv-locality {p} must be in [0, 1]")
    if p and server_args.disaggregation_mode != "decode":
        raise ValueError("--fake-kv-locality needs --disaggregation-mode decode")
    study = is_study_worker(model_path)
    if study:
        model = load_study_worker(model_path, device, dtype)
    else:
        kernels = ModelKernels.from_settings(settings())  # the server applies them too
        model = load_model(model_path, device=device, dtype=dtype, kernels=kernels)
    info = {"loader": SPEC, "model": "study worker" if study else "checkpoint"}
    if p > 0:
        cfg = model.config
        # Seed 0: the directions the runtime's synthetic keys use (runtime/fake_transfer.py).
        directions = favoured_directions(
            cfg.num_hidden_layers, cfg.index_head_dim, cfg.qk_rope_head_dim
        )
        install_preference(model, directions)  # the indexers favour the hot keys
        info["weights_altered"] = "indexer biases toward the hot keys (--fake-kv-locality)"
    info[LOCALITY_KEY] = p
    return model, info


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = sys.argv[1:] if argv is None else argv
    if not args:
        parser.print_help()
        return 0
    try:
        print(parser.parse_args(args))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
