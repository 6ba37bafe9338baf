"""Metrics and figures from ``trace.py``'s npz (and the training record); see ``--help``.

Writes <out-dir>/topk_traces.json ({name, device, date, command, metrics, ...}) with the
trained and untrained numbers side by side, topk_overlap_hits.png, topk_threshold.png and,
when the training record exists, topk_train_loss.png.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # research/

from research.topk.experiment import unpack
from research.topk.plots import plot_overlap_hits, plot_threshold, plot_training
from research.topk.stats import loss_metrics, summarize

HEADLINE = (
    "consecutive_overlap",
    "recall_of_attention_topk",
    "attention_mass_selected",
    "hisparse_2k_hit_rate",
    "ema_rel_error_median",
    "above_theta_over_k_median",
    "bin_fp16_raw_median",
    "bin_fp16_offset_median",
    "bin_fp32_raw_median",
    "bin_fp32_offset_median",
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--npz", default="benchmark/results/topk_traces.npz")
    p.add_argument("--train-json", default="benchmark/results/topk_train.json")
    p.add_argument("--out-dir", default="benchmark/results")
    return p.parse_args(argv)


def side_by_side(metrics: dict) -> dict:
    tags = list(metrics)
    table = {}
    for key in HEADLINE:
        table[key] = {t: metrics[t]["topk"]["mean_over_layers"][key] for t in tags}
    for size in metrics[tags[0]]["topk"]["mean_over_layers"]["echo_shared_hit_rate"]:
        table[f"echo_shared_hit_rate_x{size}"] = {
            t: metrics[t]["topk"]["mean_over_layers"]["echo_shared_hit_rate"][size] for t in tags
        }
    for key in ("prefill_nll", "prefill_bits_per_byte", "decode_nll", "decode_bits_per_byte"):
        table[f"heldout_{key}"] = {t: metrics[t]["heldout"][key] for t in tags}
    return table


def main(argv: list[str] | None = None) -> Path:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    with np.load(args.npz) as npz:
        meta, models = unpack(npz)
    k = int(meta["index_topk"])
    prompt_lens = np.asarray(meta["prompt_lens"], dtype=np.int64)
    metrics = {}
    for tag, arr in models.items():
        splits = np.cumsum(prompt_lens)[:-1]
        prefill = np.split(arr["prefill_nll"], splits)
        metrics[tag] = {
            "heldout": loss_metrics(prefill, arr["decode_nll"]),
            "topk": summarize(arr, prompt_lens, k),
        }
        print(f"[analyze] {tag}: {json.dumps(metrics[tag]['topk']['mean_over_layers'])}")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    figures = [
        plot_overlap_hits(
            {t: m["topk"] for t, m in metrics.items()}, k, out_dir / "topk_overlap_hits.png"
        ),
        plot_threshold(models, meta, out_dir / "topk_threshold.png"),
    ]
    train_json = Path(args.train_json)
    if train_json.is_file():
        figures.append(
            plot_training(json.loads(train_json.read_text()), out_dir / "topk_train_loss.png")
        )
    record = {
        "name": "topk_traces",
        "device": meta["device"],
        "date": meta.get("date", time.strftime("%Y-%m-%d")),
        "command": meta.get("command", ""),
        "analyze_command": "PYTHONPATH=python python benchmark/topk/analyze.py " + shlex.join(argv),
        "metrics": {"side_by_side": side_by_side(metrics), **metrics},
        "setup": {key: value for key, value in meta.items() if key not in ("command", "date")},
        "notes": {
            "k": "index_topk of the checkpoint; requests decode teacher-forced held-out text",
            "echo_shared_hit_rate": "exact LRU, one cache per layer shared by all requests; "
            "keys = cache slots / (requests x k); appended tokens enter the cache; starts "
            "holding the last prompt query's selection",
            "hisparse_2k_hit_rate": "exact LRU per request and layer, 2k slots",
            "recall_of_attention_topk": "|indexer top-k & top-k of head-averaged dense attention| / k",
            "bins": "256-bin histogram of the top 8 bits of the order-preserving key of the "
            "fp16-rounded (fp16) or fp32 score, minus 0 (raw) or the EMA prediction (offset); "
            "size of the bin where the suffix count reaches k",
        },
        "figures": [str(f) for f in figures],
    }
    path = out_dir / "topk_traces.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"[analyze] wrote {path} and {', '.join(f.name for f in figures)}", flush=True)
    return path


if __name__ == "__main__":
    main()
