"""The scheduler's admission control: which waiting requests are admitted, which running ones have
a token to decode, and which are preempted when the token pool runs out.

Why apart from the scheduler: admission counts what a request holds now (its prompt)
plus a few steps of growth for every running request, never its whole budget, and
preemption retracts the newest running requests as in SGLang; both are rules about the
pool's room, apart from running the steps and from how tokens are accepted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from sglang_echo.runtime.admission import fits, future_tokens
from sglang_echo.runtime.request import ReqStatus, ServeRequest
from sglang_echo.runtime.scheduler_stats import Laps

log = logging.getLogger("sglang_echo.scheduler")


class AdmissionControl:
    """Admission, decode counts and preemption over the scheduler's queues."""

    def __init__(self, scheduler: Any) -> None:
        """``scheduler``: the Scheduler (its queues, steps, stats and limits)."""
        self.s = scheduler

    def decodable(self, req: ServeRequest) -> bool:
        """Has a token to extend. With a step in flight, a request whose token there is
        its last one (its length) is not decoded again."""
        if not (req.prefill_done and req.output and not req.finished):
            return False
        if self.s.in_flight.carries(req):
            return len(req.output) + 1 < req.params.max_new_tokens
        return True

    def decode_count(self) -> int:
        """Token locations the next decode step takes: one per decodable request; under
        speculation each one's Q = S + 1 verified positions less those it still holds
        (its last round's rejected tail keeps its locations)."""
        if not self.s.draft_tail:
            return sum(1 for r in self.s.running if self.decodable(r))
        q = 1 + self.s.draft_tail
        return sum(
            max(0, r.cached_len + q - len(r.locs)) for r in self.s.running if self.decodable(r)
        )

    def pending_prefill(self) -> int:
        return sum(len(r.prefill_ids) - r.cached_len for r in self.s.running if not r.prefill_done)

    def growth(self, req: ServeRequest) -> int:
        """Token locations set aside for a request's next few decode steps (a decode node
        and the offline engine: all of them; runtime/admission.py), and its draft tail."""
        steps = min(future_tokens(req, req.params.max_new_tokens), self.s.reserve_steps)
        return steps + self.s.draft_tail

    def count_decode_step(self, decoding: int) -> None:
        """A decode step of ``decoding`` requests ran: the stats, with what the engine held
        beside it (running, arriving, waiting requests; free token locations)."""
        s = self.s
        s.stats.count_decode_step(
            decoding,
            running=len(s.running),
            arriving=s.prompt_source.pending if s.prompt_source is not None else 0,
            waiting=len(s.waiting),
            free_tokens=s.steps.allocator.num_free,
        )

    def admit(self) -> None:
        s = self.s
        s.steps.flush_releases()
        alloc = s.steps.allocator
        while s.waiting and len(s.running) < s.max_running and s.steps.table.num_free_rows > 0:
            req = s.waiting[0]
            held_back = self.pending_prefill() + sum(self.growth(r) for r in s.running)
            need = len(req.prefill_ids) + self.growth(req)
            if not fits(alloc.num_free, held_back, need):
                break
            lap = Laps(s.stats.admission_part_s, s.stats.admission_part_cpu_s)
            t0 = lap.started
            s.waiting.popleft()
            s.steps.admit(req)
            lap("row")
            req.status = ReqStatus.RUNNING
            s.running.append(req)
            if s.prompt_source is not None:
                s.prompt_source.start(req)
                s.stats.prompt_tokens += len(req.prompt)
            took = time.perf_counter() - t0
            s.stats.admission_s += took
            s.stats.admissions += 1
            s.stats.recent_admission_s.append(took)

    def make_room(self, tokens_needed: Callable[[], int]) -> None:
        """Preempt the newest running requests until the next phase's tokens fit.

        A decode node never preempts: admission reserved every request's whole budget, so
        running short is a bookkeeping bug, and retracting would lose a prompt that no
        prefill here can recompute. It raises instead (the phase's requests fail)."""
        s = self.s
        s.steps.flush_releases()
        while s.steps.allocator.num_free < tokens_needed() and len(s.running) > 1:
            if s.prompt_source is not None:
                raise RuntimeError(
                    f"decode node out of token locations ({s.steps.allocator.num_free} free, "
                    f"{tokens_needed()} needed) although admission reserved every running "
                    "request's budget: a bookkeeping bug"
                )
            self.retract(s.running[-1])

    def retract(self, req: ServeRequest) -> None:
        s = self.s
        s._release(req)
        s.steps.flush_releases()
        s.running.remove(req)
        req.recompute_ids = req.prompt + req.output
        req.cached_len = 0
        req.status = ReqStatus.WAITING
        req.preemptions += 1
        s.stats.preemptions += 1
        s.waiting.appendleft(req)
        log.info(
            "preempted request %s (%d tokens cached); it is recomputed when room comes back",
            req.rid,
            len(req.recompute_ids),
        )
