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


def event_us(fn: Callable[[], object]) -> float:
    """One run of ``fn`` between two events on the current CUDA stream, in microseconds."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000


def time_us(fn: Callable[[], object], warmup: int = 3, reps: int = 20) -> float:
    """Median wall time of ``fn`` on the current CUDA stream, in microseconds."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return statistics.median(event_us(fn) for _ in range(reps))


def capture(fn: Callable[[], object], warmup: int = 3) -> tuple[torch.cuda.CUDAGraph, object]:
    """``fn`` warmed up on a side stream (compiles, allocator) and captured in a CUDA graph:
    (the graph, the captured call's output, which each replay rewrites in place)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    torch.cuda.synchronize()
    return graph, out


def graph_us(fn: Callable[[], object], warmup: int = 3, reps: int = 20, chain: int = 10) -> float:
    """Median device time of ``fn`` replayed from a CUDA graph, in microseconds: ``chain``
    replays back to back between two events, divided by ``chain``. This is what a decode
    step (captured in a graph) pays. ``time_us`` also counts the CPU's launch overhead
    whenever launches take longer than the GPU work they start, which inflates functions
    of several short launches (the radix top-k: six)."""
    graph, _ = capture(fn, warmup)

    def replays() -> None:
        for _ in range(chain):
            graph.replay()

    return time_us(replays, warmup=1, reps=reps) / chain


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
