"""What the kernel benchmarks share: device-event timing (METHOD.md: warm up, then
medians) and the result record saved under benchmark/results/."""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch


def time_us(fn: Callable[[], object], warmup: int = 3, reps: int = 20) -> float:
    """Median wall time of ``fn`` on the current CUDA stream, in microseconds."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


def save_record(out_dir: str | Path, name: str, device: str, metrics: dict, **extra) -> Path:
    """Write ``<out_dir>/<name>.json`` = {name, device, date, command, metrics, ...extra}."""
    record = {
        "name": name,
        "device": device,
        "date": time.strftime("%Y-%m-%d"),
        "command": "python " + " ".join(sys.argv),
        "metrics": metrics,
        **extra,
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def pyplot():
    """matplotlib's pyplot on a file-only backend, or None where matplotlib is missing
    (the GPU machine has it; a bare environment may not: the JSON is the record)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt
