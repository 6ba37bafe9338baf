"""Continuous batching: requests join and leave the running batch at every step.

Each step: admit waiting requests while capacity allows (first come, first served; the
head of the queue is never skipped, so long prompts do not starve), run one chunked
prefill forward over running requests whose prompt is not yet cached, then one decode
forward over all requests that have a token to extend, choose tokens, and release the
requests that ended. Admission reserves a request's whole budget (prompt + new tokens)
of token locations, so a step never runs out of them: requests queue instead.

Capacity is the token pool (``--max-total-tokens``; the host pool under ECHO) and the
request rows (``--max-running-requests``). Under ECHO the device cache must also hold one
decode step's selections, max running requests x top-k; ``SchedulerConfig`` checks that
at start-up through ``EchoConfig.validate``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from sglang_echo.runtime.request import OutputEvent, ReqStatus, ServeRequest
from sglang_echo.runtime.sampling import make_generator, sample_token
from sglang_echo.runtime.step_runner import StepRunner


class RequestRejected(ValueError):
    """A request that can never run here (too long for the context or the pool)."""


@dataclass
class SchedulerStats:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished_requests: int = 0
    aborted_requests: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    # (time, generation_tokens) samples of the last few seconds, for a throughput gauge.
    recent: deque = field(default_factory=lambda: deque(maxlen=256))


class Scheduler:
    def __init__(
        self,
        steps: StepRunner,
        max_running_requests: int,
        chunked_prefill_size: int,
        context_length: int,
        eos_token_ids: list[int],
        detokenize: Callable[[list[int]], str] | None = None,
    ) -> None:
        self.steps = steps
        self.capacity = steps.allocator.capacity
        self.max_running = min(max_running_requests, steps.max_requests)
        self.chunk = chunked_prefill_size
        self.context_length = context_length
        self.eos_ids = set(eos_token_ids)
        self.detokenize = detokenize
        self.waiting: deque[ServeRequest] = deque()
        self.running: list[ServeRequest] = []
        self.reserved = 0  # token locations promised to running requests
        self.stats = SchedulerStats()

    # ------------------------------------------------------------ requests
    def check(self, req: ServeRequest) -> None:
        """Raise ``RequestRejected`` for a request that could never be admitted."""
        n = len(req.prompt)
        total = n + req.params.max_new_tokens
        if total > self.context_length:
            raise RequestRejected(
                f"the prompt has {n} tokens and max_new_tokens is {req.params.max_new_tokens}: "
                f"{total} tokens exceed the context length of {self.context_length}; shorten "
                "the prompt or lower max_new_tokens"
            )
        if req.token_budget() > self.capacity:
            raise RequestRejected(
                f"the request needs {req.token_budget()} KV token slots but the pool holds "
                f"{self.capacity} (--max-total-tokens); shorten it or raise --max-total-tokens"
            )

    def add(self, req: ServeRequest) -> None:
        self.check(req)
        req.status = ReqStatus.WAITING
        req.generator = make_generator(req.params)
        self.waiting.append(req)

    def abort(self, rid: str) -> bool:
        """End a request wherever it is; its slots and host rows go back at once."""
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                self._finish(req, {"type": "abort", "message": "aborted"})
                return True
        for req in self.running:
            if req.rid == rid:
                self._finish(req, {"type": "abort", "message": "aborted"})
                self.running.remove(req)
                return True
        return False

    def reject(self, req: ServeRequest, message: str) -> None:
        """End a request that was never admitted (its ``on_output`` hears why)."""
        self._finish(req, {"type": "abort", "message": message})

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---------------------------------------------------------------- step
    def step(self) -> bool:
        """One scheduling round; returns False when there was nothing to do."""
        self._admit()
        if not self.running:
            return False
        prefilling = [r for r in self.running if not r.prefill_done]
        if prefilling:
            before = sum(r.cached_len for r in prefilling)
            done, logits = self.steps.prefill_chunk(prefilling, self.chunk)
            self.stats.prompt_tokens += sum(r.cached_len for r in prefilling) - before
            self.stats.prefill_steps += 1
            for req, row in zip(done, logits, strict=True):
                self._accept(req, row)
        decoding = [r for r in self.running if r.prefill_done and r.output and not r.finished]
        if decoding:
            logits = self.steps.decode(decoding)
            self.stats.decode_steps += 1
            for req, row in zip(decoding, logits, strict=True):
                self._accept(req, row)
        self.running = [r for r in self.running if not r.finished]
        self.stats.recent.append((time.perf_counter(), self.stats.generation_tokens))
        return True

    def fail_all(self, message: str) -> None:
        """After an engine error: end every request with an abort that carries the message."""
        for req in [*self.waiting, *self.running]:
            self._finish(req, {"type": "abort", "message": message})
        self.waiting.clear()
        self.running = []

    # ------------------------------------------------------------- helpers
    def _admit(self) -> None:
        while (
            self.waiting
            and len(self.running) < self.max_running
            and self.steps.table.num_free_rows > 0
        ):
            req = self.waiting[0]
            need = req.token_budget()
            if self.reserved + need > self.capacity:
                break
            self.waiting.popleft()
            req.reserved_tokens = need
            self.reserved += need
            self.steps.admit(req)
            req.status = ReqStatus.RUNNING
            self.running.append(req)

    def _accept(self, req: ServeRequest, logits: torch.Tensor) -> None:
        token = sample_token(logits, req.params, req.generator)
        req.output.append(token)
        self.stats.generation_tokens += 1
        p = req.params
        reason = None
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_ids):
            reason = {"type": "stop", "matched": token}
        elif p.stop and self.detokenize is not None:
            text = self.detokenize(req.output)
            matched = next((s for s in p.stop if s in text), None)
            if matched is not None:
                reason = {"type": "stop", "matched": matched}
        if reason is None and len(req.output) >= p.max_new_tokens:
            reason = {"type": "length", "length": p.max_new_tokens}
        if reason is not None:
            self._finish(req, reason, new_tokens=(token,))
        else:
            self._emit(req, (token,), None)

    def _finish(self, req: ServeRequest, reason: dict, new_tokens: tuple[int, ...] = ()) -> None:
        if req.status is ReqStatus.RUNNING:
            self.steps.release(req)
            self.reserved -= req.reserved_tokens
            req.reserved_tokens = 0
        req.status = ReqStatus.FINISHED
        req.finish_reason = reason
        if reason["type"] == "abort":
            self.stats.aborted_requests += 1
        else:
            self.stats.finished_requests += 1
        self._emit(req, new_tokens, reason)

    @staticmethod
    def _emit(req: ServeRequest, new_tokens: tuple[int, ...], reason: dict | None) -> None:
        if req.on_output is not None:
            req.on_output(
                OutputEvent(req.rid, new_tokens, len(req.prompt), len(req.output), reason)
            )

    # ------------------------------------------------------------- metrics
    def gen_throughput(self, window_s: float = 5.0) -> float:
        """Generated tokens per second over the last ``window_s`` seconds of steps."""
        recent = self.stats.recent
        if len(recent) < 2:
            return 0.0
        now_t, now_n = recent[-1]
        if time.perf_counter() - now_t > window_s:
            return 0.0
        old_t, old_n = next(((t, n) for t, n in recent if now_t - t <= window_s), recent[0])
        return (now_n - old_n) / (now_t - old_t) if now_t > old_t else 0.0
