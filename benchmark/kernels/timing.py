"""Device-event timing shared by the kernel benchmarks (METHOD.md: warm up, then medians)."""

from __future__ import annotations

import statistics
from collections.abc import Callable

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
