"""What the engine thread counts as it schedules: requests and tokens, steps, admissions,
and where its time goes by phase (wall and thread-CPU seconds).

Why apart from the scheduler: the server's /metrics, the benchmark client's record and
the engine process's reports read these counters; they need the numbers, not the
scheduling.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

# Where the engine thread's time goes (seconds, cumulative): ``commands`` applying queued
# submissions and aborts, ``idle`` waiting for work (both counted by the engine loop),
# ``admit`` admission (a decode node's transfer start included), ``receive`` taking a
# decode node's arrived transfers, ``prefill`` and ``decode`` the model steps (the host
# waits for the device there), ``accept`` sampling, emitting and finishing requests.
ENGINE_PHASES = ("commands", "idle", "admit", "receive", "prefill", "decode", "accept")


@dataclass
class SchedulerStats:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished_requests: int = 0
    received_requests: int = 0  # taken into the waiting queue (the engine's ingress)
    aborted_requests: int = 0
    failed_requests: int = 0  # ended by a step error or non-finite logits
    preemptions: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    decode_batch_requests: int = 0  # requests over all decode steps (mean batch = / steps)
    # At each decode step, the requests held by state, summed over the steps (mean = / steps):
    # ``running`` (admitted: decoding, prefilling or, on a decode node, their KV still
    # arriving), ``arriving`` (that last part) and ``waiting`` (not admitted); and the free
    # token locations. Why: a decode batch below the study's is either memory (few running,
    # few free tokens), arrivals (running but not yet decodable) or no demand (none waiting).
    step_requests: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(("running", "arriving", "waiting"), 0)
    )
    step_free_tokens: int = 0
    # Engine-thread seconds of each admission (the request's row, locations and, on a
    # decode node, its transfer's start): the total, the count, and the last few.
    admission_s: float = 0.0
    admissions: int = 0
    recent_admission_s: deque = field(default_factory=lambda: deque(maxlen=1024))
    # Of those seconds, the table row's (``row``; a decode node's transfer start keeps its
    # own parts: runtime/fake_transfer.py ``start_part_s``), for /metrics by part.
    admission_part_s: dict[str, float] = field(default_factory=lambda: {"row": 0.0})
    admission_part_cpu_s: dict[str, float] = field(default_factory=lambda: {"row": 0.0})
    # (time, generation_tokens) samples of the last few seconds, for a throughput gauge.
    recent: deque = field(default_factory=lambda: deque(maxlen=256))
    phase_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(ENGINE_PHASES, 0.0))
    # The engine thread's CPU time in the same phases: wall much above CPU is waiting (on
    # the device, or for the GIL while another thread runs Python); wall close to CPU is
    # host work of its own.
    phase_cpu_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(ENGINE_PHASES, 0.0))

    def count_decode_step(
        self, decoding: int, running: int, arriving: int, waiting: int, free_tokens: int
    ) -> None:
        """One decode step of ``decoding`` requests, and what the engine held beside it."""
        self.decode_steps += 1
        self.decode_batch_requests += decoding
        held = self.step_requests
        held["running"] += running
        held["arriving"] += arriving
        held["waiting"] += waiting
        self.step_free_tokens += free_tokens

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Adds the block's wall and thread-CPU time to ``phase_s`` / ``phase_cpu_s``
        (about a microsecond per use)."""
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:  # CPU read first: the wall interval holds the CPU one (CPU never above)
            self.phase_cpu_s[phase] += time.thread_time() - c0
            self.phase_s[phase] += time.perf_counter() - t0


class Laps:
    """Adds the wall seconds since the previous lap to ``into[part]`` and the calling
    thread's CPU seconds to ``cpu_into[part]``: wall well above CPU is the thread waiting
    (for the GIL, or on the device), wall close to CPU is work of its own. The start reads
    wall then CPU and each lap CPU then wall, so a part timed once has its CPU interval
    inside its wall interval (CPU never above wall)."""

    def __init__(self, into: dict[str, float], cpu_into: dict[str, float]) -> None:
        self.into, self.cpu_into = into, cpu_into
        self.started = self.last = time.perf_counter()
        self.last_cpu = time.thread_time()

    def __call__(self, part: str) -> None:
        now_cpu = time.thread_time()
        now = time.perf_counter()
        self.into[part] += now - self.last
        self.cpu_into[part] += now_cpu - self.last_cpu
        self.last, self.last_cpu = now, now_cpu
