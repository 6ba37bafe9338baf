"""``scripts/train_tiny_dsa.py``: train, export the checkpoint, write the loss-curve record."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import asdict, fields, replace
from pathlib import Path

import torch

from research.train.data import eval_windows, load_corpus
from research.train.export import (
    SAVE_DTYPES,
    checkpoint_bytes,
    model_card,
    save_checkpoint,
)
from research.train.loop import TrainConfig, Trainer, config_dict
from research.train.spec import TRAINED_SPEC, build_model, check_trainable, parameter_count

DEFAULT_OUT = "models/tiny-dsv32-trained"
DEFAULT_LOG = "benchmark/results/topk_train.json"
SPEC_FLAGS = (
    "layers",
    "hidden",
    "heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "intermediate",
    "index_heads",
    "index_dim",
    "index_topk",
    "max_position",
    "rope",
    "yarn_factor",
    "init_std",
)
# Flags the retrain command pins (it replays the fitted step counts).
PINNED_FLAGS = ("--steps", "--dense-steps", "--time-budget-s")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Train a small DeepSeek-V3.2 (MLA + DSA indexer) model on the Python "
        "sources of this machine: dense warm-up with indexer KL, then top-k sparse training. "
        "Writes a Hugging Face checkpoint, model card and loss-curve JSON.",
    )
    p.add_argument("--out", default=DEFAULT_OUT, help=f"checkpoint folder (default {DEFAULT_OUT})")
    p.add_argument("--log-json", default=DEFAULT_LOG, help=f"loss-curve record ({DEFAULT_LOG})")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
    p.add_argument("--save-dtype", default="bfloat16", choices=sorted(SAVE_DTYPES))
    p.add_argument(
        "--data-roots",
        default=None,
        help="comma-separated folders of *.py files (default: the stdlib and site-packages)",
    )
    p.add_argument("--eval-fraction", type=float, default=0.02)
    p.add_argument("--max-train-mb", type=float, default=160.0)
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.name in ("steps", "dense_steps"):
            p.add_argument(flag, type=int, default=None)
        else:
            p.add_argument(flag, type=type(f.default), default=f.default)
    for name in SPEC_FLAGS:
        value = getattr(TRAINED_SPEC, name)
        p.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    return p.parse_args(argv)


def retrain_command(argv: list[str], steps: int, dense_steps: int) -> str:
    """This run's command with its fitted step counts pinned (deterministic replay)."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in PINNED_FLAGS:
            skip = True
            continue
        if arg.split("=", 1)[0] in PINNED_FLAGS:
            continue
        kept.append(arg)
    kept += ["--steps", str(steps), "--dense-steps", str(dense_steps), "--time-budget-s", "900"]
    return "PYTHONPATH=python python scripts/train_tiny_dsa.py " + shlex.join(kept)


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but no CUDA device is available; use --device cpu")
    return device


def main(argv: list[str] | None = None) -> dict:
    t_start = time.time()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    spec = replace(
        TRAINED_SPEC,
        seed=args.seed,
        dense_layers=args.layers,
        **{name: getattr(args, name) for name in SPEC_FLAGS},
    )
    check_trainable(spec)
    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig)})
    cfg.validate()
    device = _device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"

    roots = None
    if args.data_roots:
        roots = [(f"data:{r}", Path(r)) for r in args.data_roots.split(",") if r]
    corpus = load_corpus(
        roots, eval_fraction=args.eval_fraction, max_train_bytes=int(args.max_train_mb * 2**20)
    )
    data = corpus.summary()
    print(f"[train] data loaded in {time.time() - t_start:.1f} s: {json.dumps(data)}", flush=True)

    from research.train.data import WindowSampler

    sampler = WindowSampler(corpus.train_tokens, device, seed=cfg.seed)
    held_out = eval_windows(corpus.eval_docs, cfg.eval_windows, cfg.seq_len)
    trainer = Trainer(
        lambda: build_model(spec, cfg.seed),
        sampler,
        cfg,
        device,
        held_out,
        log=lambda msg: print(f"[train] {msg}", flush=True),
    )
    params = parameter_count(trainer.model)
    print(f"[train] {name}; parameters {params}; spec {asdict(spec)}", flush=True)
    result = trainer.run(t_start)

    last = result.curve[-1] if result.curve else {"lm_loss": float("nan"), "kl_loss": float("nan")}
    results = {
        "device": name,
        "steps_planned": result.steps,
        "steps_done": result.steps_done,
        "dense_steps": min(result.dense_steps, result.steps_done),
        "stopped_by_time": result.stopped_by_time,
        "tokens_seen": result.tokens_seen,
        "train_seconds": result.train_seconds,
        "last_train_lm": last["lm_loss"],
        "last_train_kl": last["kl_loss"],
        "heldout_dense": result.final_eval("dense"),
        "heldout_sparse": result.final_eval("sparse"),
        "calibration": result.calibration,
    }
    info = {
        "model_spec": asdict(spec),
        "train": config_dict(cfg),
        "data": data,
        "eval_fraction": args.eval_fraction,
        "max_train_mb": args.max_train_mb,
        "parameters": params,
        "save_dtype": args.save_dtype,
        "retrain_command": retrain_command(argv, result.steps_done, results["dense_steps"]),
        "results": results,
    }
    out = save_checkpoint(trainer.model, spec, args.out, args.save_dtype, metadata=info)
    info["checkpoint_bytes"] = checkpoint_bytes(out)
    results["total_seconds"] = time.time() - t_start
    (out / "README.md").write_text(model_card(info))
    (out / "train_spec.json").write_text(json.dumps(info, indent=2) + "\n")
    record = {
        "name": Path(args.log_json).stem,
        "device": name,
        "date": time.strftime("%Y-%m-%d"),
        "command": "PYTHONPATH=python python scripts/train_tiny_dsa.py " + shlex.join(argv),
        "metrics": {k: v for k, v in results.items() if k != "calibration"},
        "curve": result.curve,
        "evals": result.evals,
        "calibration": result.calibration,
        "config": config_dict(cfg),
        "model_spec": asdict(spec),
        "parameters": params,
        "data": data,
        "checkpoint": str(out),
        "checkpoint_bytes": info["checkpoint_bytes"],
        "retrain_command": info["retrain_command"],
    }
    log_path = Path(args.log_json)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.write_text(json.dumps(record, indent=2) + "\n")
    print(
        f"[train] wrote {out} ({info['checkpoint_bytes'] / 1e6:.1f} MB) and {log_path} "
        f"in {results['total_seconds']:.0f} s",
        flush=True,
    )
    return record
