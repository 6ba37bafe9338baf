"""The study's clocks: the run's clock (log lines and ``--deadline-s`` count from one
start), CUDA events around each graph-replayed decode step, graph-replayed timing of a
callable, and the medians and spreads the record keeps."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

T0 = time.perf_counter()


def start() -> None:
    """Start the run's clock. The CLI does once its imports are done, so the log's first
    line reads +0.0s and the deadline leaves the import time out (as it always has)."""
    global T0
    T0 = time.perf_counter()


def elapsed() -> float:
    """Seconds since the run's clock started."""
    return time.perf_counter() - T0


def log(msg: str) -> None:
    stamp = time.strftime("%H:%M:%S")
    print(f"[{stamp} +{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


class EventTimer:
    """Wraps the runner's CUDA-graph decode call: device time by events around it, and
    the host clock at its entry and exit (the rest of a step is host work)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.entered = self.left = 0.0

    def __call__(self, batch):
        self.entered = time.perf_counter()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = self.inner(batch)
        end.record()
        self.events.append((start, end))
        self.left = time.perf_counter()
        return out


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def spread(values: list[float]) -> list[float] | None:
    """[p10, p90] of the values (None for fewer than two)."""
    if len(values) < 2:
        return None
    q = statistics.quantiles(values, n=10)
    return [round(q[0], 4), round(q[-1], 4)]


def graph_us(fn, reps: int = 20, chain: int = 10) -> float:
    """Median device time of ``fn`` replayed from a CUDA graph (benchmark/kernels/common.py
    does the same; kept here so the study runs alone)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(chain):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / chain)
    del graph
    return statistics.median(times)


def time_ms(fn: Callable[[], object], cuda: bool) -> float:
    """Milliseconds per call of ``fn``: graph-replayed on a GPU, else the median of 20
    wall-clock calls after two warm-up calls."""
    if cuda:
        return graph_us(fn) / 1e3
    for _ in range(2):
        fn()
    times = []
    for _ in range(20):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)
