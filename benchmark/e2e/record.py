"""The study's record, ``<out>/e2e_study.json``: what ran (command, device, date, config
with the engines and their order), the metrics, every measurement, the components, and
the errors and skipped engines. It is rewritten after every phase, so a timeout still
leaves data; ``complete`` says whether the run reached its end."""

from __future__ import annotations

import json
import shlex
import time
from pathlib import Path

import torch

from benchmark.e2e.metrics import metrics
from benchmark.e2e.plan import StudyPlan, row_bytes, tag


def assemble(
    setup: StudyPlan,
    argv: list[str],
    cuda: bool,
    runs: list[dict],
    components: dict,
    errors: list[str],
    final: bool = False,
) -> dict:
    """The record as it stands (``final``: the run reached its end)."""
    metrics_ = metrics(setup, runs, components)
    return {
        "name": "e2e_study",
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "date": time.strftime("%Y-%m-%d"),
        "command": "python3 benchmark/e2e_study.py " + shlex.join(argv),
        "metrics": metrics_,
        "config": config(setup, cuda),
        "complete": final,
        "errors": errors,
        "skipped": setup.skipped,
        "runs": runs,
        "components": components,
    }


def write(out: Path, rec: dict) -> None:
    (out / "e2e_study.json").write_text(json.dumps(rec, indent=2) + "\n")


def config(setup: StudyPlan, cuda: bool) -> dict:
    """What the run was: sizes, dtypes, steps, repeats, the run order, the engines."""
    p, a = setup.plan, setup.args
    kv, idx = row_bytes(setup.cfg, p.dtype, p.kv_cache_dtype)
    return {
        "smoke": a.smoke,
        "layers": p.layers,
        "dims": p.dims,
        "moe": p.moe,
        "vocab": p.vocab,
        "dtype": str(p.dtype),
        "kv_cache_dtype": p.kv_cache_dtype,
        "indexer_mode": p.indexer_mode,
        "kv_row_bytes": kv,
        "index_row_bytes": idx,
        "prompt_tokens": [p.ctx_min, p.ctx_max],
        "warmup_steps": a.warmup,
        "measured_steps": a.steps,
        "profile_steps": a.profile_steps,
        "stable_fraction": a.locality,
        "repeats": a.repeats,
        "order": [f"{e.label}/{tag(ph)}" for block in setup.schedule() for e, ph in block],
        "cuda_graphs": cuda,
        "torch": torch.__version__,
        "topk": "the radix select (kernels/topk.py)",
        "engines": [{k: v for k, v in vars(e).items() if k != "phases"} for e in setup.engines()],
        "notes": (
            "device times: CUDA events around each graph-replayed decode step (medians); "
            "throughput = batch / device step time; wall = host clock per step (the step "
            "is not overlapped with host work). Repeated phases (config.order, '#r' the "
            "r-th repeat) alternate with their baseline in one block; metrics use each "
            "side's median. estimate_61_layers is an estimate, not a measurement."
        ),
    }
