"""The server's counters sampled during a run, for its steady stretch (``--poll-counters-s``).

Why: a run's counters are read before and after it, so its hit rate, mean decode batch and
served efficiency include the ramp (the batch filling, each arrival's first steps) and the
drain; the in-process study measures full batches only. Sampled every few tenths of a
second, the counters give the same figures over the run's steady window (the one
``steady_output_throughput`` uses): the samples at or before its start and at or after its
end bound it. The server takes a counter snapshot per sample (on its engine thread, between
steps), so sampling is opt-in.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

Counters = dict[str, dict[str, float]]


@dataclass
class CounterPoll:
    """Samples ``(seconds from the run's start, counters)`` every ``interval`` seconds."""

    read: Callable[[], Awaitable[Counters]]  # the server's counters now
    interval: float
    samples: list[tuple[float, Counters]] = field(default_factory=list)

    async def run(self, start: float, stop: asyncio.Event) -> None:
        """Sample until ``stop`` is set, and once more then, after the run's last request
        (``start``: the run's ``time.perf_counter()``)."""
        while True:
            counters = await self.read()
            self.samples.append((time.perf_counter() - start, counters))
            if stop.is_set():
                return
            try:
                await asyncio.wait_for(stop.wait(), self.interval)
            except TimeoutError:
                continue

    def bounds(self, window: list[float] | None) -> tuple[tuple[float, Counters], ...] | None:
        """The last sample at or before the window's start and the first at or after its
        end; None without a window or such samples."""
        if not window:
            return None
        lo, hi = window
        before = [s for s in self.samples if s[0] <= lo]
        after = [s for s in self.samples if s[0] >= hi]
        if not before or not after:
            return None
        return before[-1], after[0]


def steady_fields(poll: CounterPoll | None, window: list[float] | None, served) -> dict:
    """``steady_*`` fields over the samples bounding ``window``: the counters' window
    (``steady_counters_window_s``), ECHO's hit rate, the mean decode batch, the served
    efficiency and the MTP accept length there (``served``: bench.server_counters.served_fields).
    Empty when there is no poll or no bounding samples."""
    if poll is None:
        return {}
    bounds = poll.bounds(window)
    if bounds is None:
        return {}
    (t_a, a), (t_b, b) = bounds
    fields = served(a, b, t_b - t_a)
    echo = fields.get("server_echo") or {}
    return {
        # to the millisecond outward: rounded to the nearest, a start just before the
        # steady window's could read as after it
        "steady_counters_window_s": [math.floor(t_a * 1e3) / 1e3, math.ceil(t_b * 1e3) / 1e3],
        "steady_hit_rate": echo.get("hit_rate"),
        "steady_mean_decode_batch": fields.get("mean_decode_batch"),
        "steady_served_efficiency": fields.get("served_efficiency"),
        "steady_spec_accept_length": fields.get("spec_accept_length"),
    }


# The series' columns: what each sampling interval says about the engine's batch.
SERIES_COLUMNS = (
    "t_s",  # the interval's end, seconds from the run's start
    "decode_steps",
    "mean_decode_batch",
    "running",  # requests held at a step on average, by state
    "arriving",
    "waiting",
    "free_tokens",  # free token locations at a step on average
    "received",  # requests the engine queued, admitted and saw arrive in the interval
    "admitted",
    "arrived",
    "triton_compiles",
)


def counter_series(poll: CounterPoll | None, served) -> dict | None:
    """The run as a time series, one row per sampling interval (``SERIES_COLUMNS``).

    Why: a run's means cannot tell a batch short of requests (none waiting: demand or
    ingress) from one short of memory (requests waiting, free tokens below a prompt) or of
    arrivals (admitted, KV in flight), nor the ramp and drain from the middle; the intervals
    can. None without a poll or with fewer than two samples; a cell is None where the
    server does not expose that counter."""
    if poll is None or len(poll.samples) < 2:
        return None
    rows = []
    for (t_a, a), (t_b, b) in itertools.pairwise(poll.samples):
        fields = served(a, b, t_b - t_a)
        eng = fields.get("server_engine") or {}
        held = fields.get("mean_step_requests") or {}
        rows.append(
            [
                round(t_b, 3),
                eng.get("decode_steps"),
                _rounded(fields.get("mean_decode_batch")),
                held.get("running"),
                held.get("arriving"),
                held.get("waiting"),
                fields.get("mean_free_tokens"),
                eng.get("requests_received"),
                eng.get("admissions"),
                eng.get("transfers"),
                eng.get("triton_compiles"),
            ]
        )
    return {"columns": list(SERIES_COLUMNS), "rows": rows}


def _rounded(x: float | None) -> float | None:
    return None if x is None else round(x, 3)
