"""Continuous batching: requests join and leave the running batch at every step.

Each step: admit waiting requests while capacity allows (first come, first served; the
head of the queue is never skipped, so long prompts do not starve), run one chunked
prefill forward over running requests whose prompt is not yet cached, then one decode
forward over all requests that have a token to extend, choose tokens for the batch on the
device, and release the requests that ended.

Admission counts what a request holds now (its prompt) plus a few steps of growth for
every running request, never its whole budget, so a chat request without max_tokens does
not block the queue. When the pool runs out anyway, the newest running requests are
preempted as in SGLang: their token slots and host rows (and ECHO's device slots) go back,
they return to the head of the queue with their outputs, and are recomputed (prompt +
outputs prefilled) when room comes back. Tokens already streamed stay; greedy outputs
equal those of a run without preemption, and sampled ones too (the sampler's noise is a
function of the request's key and output index).

Overlap (``overlap=True``, the server's default; ``--disable-overlap-schedule``): decode
step N+1 is launched before step N's tokens are read, its inputs taken from N's choices on
the device, so the host's work on N (stop checks, events, admission) runs while the device
runs N+1. A request that ends at N by a stop token or string was decoded once more at N+1:
that token is discarded, and what it wrote went to the location it held (released with
it). One that ends by its length is known before and not decoded again. Prefill chunks,
preemption and an idle batch first take the step in flight's tokens. Tokens, their order
and the events are those of the synchronous schedule.

A step that raises ends the requests of the phase that raised (prefill or decode) with
the error; a row of non-finite logits ends only its request. Everything else goes on.

Capacity is the token pool (``--max-total-tokens``; the host pool under ECHO) and the
request rows (``--max-running-requests``). Under ECHO the device cache must also hold one
decode step's selections, max running requests x top-k; ``SchedulerConfig`` checks that
at start-up through ``EchoConfig.validate``.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sglang_echo.runtime.admission import fits, future_tokens
from sglang_echo.runtime.detokenizer import IncrementalText
from sglang_echo.runtime.request import OutputEvent, ReqStatus, ServeRequest, TokenLogprob
from sglang_echo.runtime.sampling import (
    DeviceSample,
    SampledBatch,
    new_sample_key,
    sample_batch,
    sample_on_device,
)
from sglang_echo.runtime.scheduler_stats import SchedulerStats
from sglang_echo.runtime.step_runner import CarriedTokens, StepRunner

if TYPE_CHECKING:
    from sglang_echo.runtime.fake_transfer import FakeTransfer

log = logging.getLogger("sglang_echo.scheduler")

# Admission leaves every running request room for this many more tokens, so a preemption
# (a recompute) is rare and a retracted request is not re-admitted only to be retracted
# again at the next step.
DECODE_RESERVE_STEPS = 32


def abort_reason(message: str, status_code: int) -> dict:
    """How an aborted request ends, as SGLang reports it: with the HTTP status a client
    should see (499 aborted by a client, 400 refused, 500 engine error, 503 shutting down)."""
    return {"type": "abort", "message": message, "status_code": status_code}


class RequestRejected(ValueError):
    """A request that can never run here (too long for the context or the pool, or a
    request id already in use)."""


@dataclass(eq=False)
class _InFlight:
    """A launched decode step whose tokens the host has not read yet (overlap)."""

    reqs: list[ServeRequest]
    logits: torch.Tensor
    sample: DeviceSample
    ids: set[int]  # id() of each request, for membership without comparing requests


class Scheduler:
    def __init__(
        self,
        steps: StepRunner,
        max_running_requests: int,
        chunked_prefill_size: int,
        context_length: int,
        eos_token_ids: list[int],
        detokenize: Callable[[list[int]], str] | None = None,
        reserve_steps: int = DECODE_RESERVE_STEPS,
        prompt_source: FakeTransfer | None = None,
        overlap: bool = False,
    ) -> None:
        self.steps = steps
        self.overlap = overlap
        self._inflight: _InFlight | None = None  # overlap: the decode step not yet read
        self.capacity = steps.allocator.capacity
        self.max_running = min(max_running_requests, steps.max_requests)
        self.chunk = chunked_prefill_size
        self.context_length = context_length
        self.eos_ids = set(eos_token_ids)
        self.detokenize = detokenize
        # A PD decode node (fake transfer): prompts arrive cached, so nothing is prefilled
        # and nothing could be recomputed: admission reserves each request's whole budget.
        self.prompt_source = prompt_source
        self.reserve_steps = context_length if prompt_source is not None else reserve_steps
        self.waiting: deque[ServeRequest] = deque()
        self.running: list[ServeRequest] = []  # in admission order: newest last
        self.live: dict[str, ServeRequest] = {}  # rid -> request, waiting or running
        self.stats = SchedulerStats()
        # Called with (requests, their logits) before each batch's tokens are chosen: the
        # offline engine records every step's logits there for the lossless checks.
        self.on_logits: Callable[[list[ServeRequest], torch.Tensor], None] | None = None
        # Whether the events carry text. False in an engine process: the front decodes the
        # text itself (runtime/engine_process.py), so the engine decodes only what its stop
        # strings need, for requests that have some.
        self.text_in_engine = True
        # Events of a decode step's tokens, held while its tokens are accepted and handed
        # out once the next step is launched (``_hand_out_held``): whoever consumes them (an
        # HTTP thread, the engine process's sender) then runs while the device works instead
        # of between two steps, where it took the GIL from the engine thread preparing the
        # next launch. The order of events is kept: any event made outside that window
        # hands out the held ones first, so nothing follows a request's terminal event.
        self._held_events: list[tuple[ServeRequest, OutputEvent]] = []
        self._holding = False

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
        if req.rid in self.live:
            raise RequestRejected(
                f"request id {req.rid!r} belongs to a request that is still running; "
                "give each request its own rid"
            )

    def add(self, req: ServeRequest) -> None:
        self.check(req)
        req.status = ReqStatus.WAITING
        req.sample_key = new_sample_key(req.params)
        if self.detokenize is not None and (self.text_in_engine or req.params.stop):
            req.text = IncrementalText(self.detokenize, req.params.stop)
        self.waiting.append(req)
        self.live[req.rid] = req

    def abort(self, rid: str, message: str = "aborted") -> bool:
        """End a request wherever it is; its slots and host rows go back at once."""
        req = self.live.get(rid)
        if req is None:
            return False
        self._finish(req, abort_reason(message, 499))
        self.steps.flush_releases()
        return True

    def reject(self, req: ServeRequest, message: str) -> None:
        """End a request that was never admitted (its ``on_output`` hears why)."""
        self._emit(req, (), abort_reason(message, 400))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---------------------------------------------------------------- step
    def step(self) -> bool:
        """One scheduling round; returns False when there was nothing to do."""
        with self.stats.timed("admit"):
            self._admit()
        with self.stats.timed("receive"):
            self._receive_arrived()
        if not self.running:
            # A decode node's arrival can end its request at once (its first token is a stop
            # token or its whole budget): what it held goes back now, not at the next command.
            self._read_inflight()
            self.steps.flush_releases()
            self._hand_out_held()
            return False
        # ``running`` holds live requests only (``_finish`` takes a request out the moment it
        # ends), so no phase below can retract, prefill or decode one that has ended.
        if any(not r.prefill_done for r in self.running):
            self._read_inflight()  # a prefill runs on the synchronous schedule
            self._make_room(lambda: min(self.chunk, self._pending_prefill()))
            prefilling = [r for r in self.running if not r.prefill_done]
            if prefilling:
                self._prefill(prefilling)
        if any(self._decodable(r) for r in self.running):
            if self.steps.allocator.num_free < self._decode_count():
                self._read_inflight()  # preemption may come: on the synchronous schedule
            self._make_room(self._decode_count)
            decoding = [r for r in self.running if self._decodable(r)]
            if decoding:
                self._decode(decoding)
            else:
                self._read_inflight()
        else:
            self._read_inflight()
            if self.prompt_source is not None and self.prompt_source.pending:
                with self.stats.timed("receive"):
                    self._receive_arrived(wait=True)  # nothing to step: wait, do not spin
        if self._inflight is not None and all(r.finished for r in self._inflight.reqs):
            self._read_inflight()  # every request of the step in flight has ended
        self.steps.flush_releases()
        if not any(self._decodable(r) for r in self.running):
            self._hand_out_held()  # no decode launch comes next to hand them out after
        self.stats.recent.append((time.perf_counter(), self.stats.generation_tokens))
        return True

    def fail_all(self, message: str, status_code: int = 503) -> None:
        """Shutdown (503), or an error outside any step (500): end every live request."""
        self._inflight = None  # its tokens are not read: every request it holds ends here
        for req in [*self.waiting, *self.running]:
            self._finish(req, abort_reason(message, status_code))
        self.steps.flush_releases()

    # ---------------------------------------------------------- the phases
    def _prefill(self, prefilling: list[ServeRequest]) -> None:
        before = sum(r.cached_len for r in prefilling)
        try:
            with self.stats.timed("prefill"):
                done, logits = self.steps.prefill_chunk(prefilling, self.chunk)
        except Exception as exc:  # the phase's requests end, the rest go on
            self._fail(prefilling, "prefill", exc)
            return
        self._hand_out_held()
        self.stats.prompt_tokens += sum(r.cached_len for r in prefilling) - before
        self.stats.prefill_steps += 1
        if done:
            with self.stats.timed("accept"):
                self._accept_batch(done, logits)

    def _decode(self, decoding: list[ServeRequest]) -> None:
        if self.overlap:
            self._decode_ahead(decoding)
            return
        try:
            with self.stats.timed("decode"):
                logits = self.steps.decode(decoding)
        except Exception as exc:  # the phase's requests end, the rest go on
            self._fail(decoding, "decode", exc)
            return
        self.stats.decode_steps += 1
        self.stats.decode_batch_requests += len(decoding)
        self._while_the_step_runs()
        with self.stats.timed("accept"):
            self._holding = True
            try:
                self._accept_batch(decoding, logits)
            finally:
                self._holding = False

    def _decode_ahead(self, decoding: list[ServeRequest]) -> None:
        """Overlap: launch this step (the step in flight's requests take their next ids from
        its choices on the device) and its sampling, then read the step in flight."""
        prev = self._inflight
        pending = {id(r): i for i, r in enumerate(prev.reqs)} if prev is not None else {}
        carried = None
        if prev is not None:
            rows = [j for j, r in enumerate(decoding) if id(r) in pending]
            if rows:
                carried = CarriedTokens(
                    prev.sample.tokens, rows, [pending[id(decoding[j])] for j in rows]
                )
        try:
            with self.stats.timed("decode"):
                logits = self.steps.decode(decoding, carried)
                sample = sample_on_device(
                    logits,
                    [r.params for r in decoding],
                    [r.sample_key for r in decoding],
                    [len(r.output) + (id(r) in pending) for r in decoding],
                )
        except Exception as exc:  # the phase's requests end, the rest go on
            self._inflight = None  # its tokens are lost with the step that failed after it
            launched = {id(r) for r in decoding}
            extra = [r for r in (prev.reqs if prev else ()) if id(r) not in launched]
            self._fail([*decoding, *extra], "decode", exc)
            return
        self.stats.decode_steps += 1
        self.stats.decode_batch_requests += len(decoding)
        self._inflight = _InFlight(decoding, logits, sample, {id(r) for r in decoding})
        if prev is not None:
            with self.stats.timed("accept"):
                self._accept_read(prev)
        self._while_the_step_runs()

    def _read_inflight(self) -> None:
        """Take the step in flight's tokens now (its requests then have no pending token)."""
        prev, self._inflight = self._inflight, None
        if prev is not None:
            with self.stats.timed("accept"):
                self._accept_read(prev)

    def _accept_read(self, step: _InFlight) -> None:
        """The tokens of a step read from the host copy; a request that ended since it was
        launched (a stop at the step before, an abort) has its token discarded."""
        live = [i for i, r in enumerate(step.reqs) if not r.finished]
        if not live:
            step.sample.read()  # nothing to keep, but its copy is done before its memory goes
            return
        reqs = [step.reqs[i] for i in live]
        if self.on_logits is not None:
            rows = torch.tensor(live, dtype=torch.int64).to(step.logits.device)
            self.on_logits(reqs, step.logits.index_select(0, rows))
        out = step.sample.read()
        self._accept_sampled(
            reqs,
            SampledBatch(
                [out.tokens[i] for i in live],
                [out.finite[i] for i in live],
                [out.logprobs[i] for i in live],
            ),
        )

    def _while_the_step_runs(self) -> None:
        """Admission and arrivals, on the host while the decode step just launched runs on
        the device (sampling below waits for it). Their kernels queue behind the step, so
        what they change on the device takes effect from the next step, as it would have
        between the steps; the step's own requests (``decoding``) are not touched: a
        request admitted or arrived here is not in it, and an arrival that ends at once
        holds nothing the step reads. It keeps the GPU fed instead of idle through them.
        The previous step's events go out first."""
        self._hand_out_held()
        with self.stats.timed("admit"):
            self._admit()
        with self.stats.timed("receive"):
            self._receive_arrived()

    def _fail(self, reqs: list[ServeRequest], phase: str, exc: Exception) -> None:
        log.error("%s step failed for %d request(s)", phase, len(reqs), exc_info=exc)
        message = f"engine error in the {phase} step: {type(exc).__name__}: {exc}"
        for req in reqs:
            if not req.finished:
                self.stats.failed_requests += 1
                self._finish(req, abort_reason(message, 500))

    # ------------------------------------------------------------ capacity
    def _decodable(self, req: ServeRequest) -> bool:
        """Has a token to extend. With a step in flight, a request whose token there is
        its last one (its length) is not decoded again."""
        if not (req.prefill_done and req.output and not req.finished):
            return False
        step = self._inflight
        if step is not None and id(req) in step.ids:
            return len(req.output) + 1 < req.params.max_new_tokens
        return True

    def _decode_count(self) -> int:
        return sum(1 for r in self.running if self._decodable(r))

    def _pending_prefill(self) -> int:
        return sum(len(r.prefill_ids) - r.cached_len for r in self.running if not r.prefill_done)

    def _growth(self, req: ServeRequest) -> int:
        """Token locations set aside for a request's next few decode steps (a decode node
        and the offline engine: all of them; runtime/admission.py)."""
        return min(future_tokens(req, req.params.max_new_tokens), self.reserve_steps)

    def _admit(self) -> None:
        self.steps.flush_releases()
        alloc = self.steps.allocator
        while (
            self.waiting
            and len(self.running) < self.max_running
            and self.steps.table.num_free_rows > 0
        ):
            req = self.waiting[0]
            held_back = self._pending_prefill() + sum(self._growth(r) for r in self.running)
            need = len(req.prefill_ids) + self._growth(req)
            if not fits(alloc.num_free, held_back, need):
                break
            t0 = time.perf_counter()
            self.waiting.popleft()
            self.steps.admit(req)
            req.status = ReqStatus.RUNNING
            self.running.append(req)
            if self.prompt_source is not None:
                self.prompt_source.start(req)
                self.stats.prompt_tokens += len(req.prompt)
            took = time.perf_counter() - t0
            self.stats.admission_s += took
            self.stats.admissions += 1
            self.stats.recent_admission_s.append(took)

    def _receive_arrived(self, wait: bool = False) -> None:
        """A decode node's requests whose prompt KV is in place: their first token (the
        prefill node's) is emitted, and they decode from the next step on."""
        if self.prompt_source is None:
            return
        for req, first, logprob in self.prompt_source.arrived(wait=wait):
            if not req.finished:
                self._accept(req, first, logprob)
        failed, self.prompt_source.failed = self.prompt_source.failed, []
        for req, exc in failed:  # its KV never arrived: that request ends, the rest go on
            if not req.finished:
                self._fail([req], "transfer", exc)

    def _make_room(self, tokens_needed: Callable[[], int]) -> None:
        """Preempt the newest running requests until the next phase's tokens fit.

        A decode node never preempts: admission reserved every request's whole budget, so
        running short is a bookkeeping bug, and retracting would lose a prompt that no
        prefill here can recompute. It raises instead (the phase's requests fail)."""
        self.steps.flush_releases()
        while self.steps.allocator.num_free < tokens_needed() and len(self.running) > 1:
            if self.prompt_source is not None:
                raise RuntimeError(
                    f"decode node out of token locations ({self.steps.allocator.num_free} free, "
                    f"{tokens_needed()} needed) although admission reserved every running "
                    "request's budget: a bookkeeping bug"
                )
            self._retract(self.running[-1])

    def _release(self, req: ServeRequest) -> None:
        """Give back what a running request holds: its pending transfer is cancelled first
        (so nothing writes into locations another request may get next), then its row and
        token locations (the KV backend's release is batched until the next flush)."""
        if self.prompt_source is not None:
            self.prompt_source.forget(req)
        self.steps.release_later(req)

    def _retract(self, req: ServeRequest) -> None:
        self._release(req)
        self.steps.flush_releases()
        self.running.remove(req)
        req.recompute_ids = req.prompt + req.output
        req.cached_len = 0
        req.status = ReqStatus.WAITING
        req.preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(req)
        log.info(
            "preempted request %s (%d tokens cached); it is recomputed when room comes back",
            req.rid,
            len(req.recompute_ids),
        )

    # -------------------------------------------------------------- tokens
    def _accept_batch(self, reqs: list[ServeRequest], logits: torch.Tensor) -> None:
        if self.on_logits is not None:
            self.on_logits(reqs, logits)
        out = sample_batch(
            logits,
            [r.params for r in reqs],
            [r.sample_key for r in reqs],
            [len(r.output) for r in reqs],
        )
        self._accept_sampled(reqs, out)

    def _accept_sampled(self, reqs: list[ServeRequest], out: SampledBatch) -> None:
        for req, token, ok, lp in zip(reqs, out.tokens, out.finite, out.logprobs, strict=True):
            if not ok:
                self.stats.failed_requests += 1
                message = "the model produced non-finite logits for this request"
                self._finish(req, abort_reason(message, 500))
                continue
            try:
                self._accept(req, token, lp)
            except Exception as exc:  # one request's stop check, not the batch
                log.exception("request %s failed while accepting a token", req.rid)
                self.stats.failed_requests += 1
                self._finish(req, abort_reason(f"{type(exc).__name__}: {exc}", 500))

    def _accept(self, req: ServeRequest, token: int, lp: TokenLogprob | None) -> None:
        req.output.append(token)
        self.stats.generation_tokens += 1
        p = req.params
        matched = req.text.push(token) if req.text is not None else None
        reason = None
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_ids):
            reason = {"type": "stop", "matched": token}
        elif matched is not None:
            reason = {"type": "stop", "matched": matched}
        elif len(req.output) >= p.max_new_tokens:
            reason = {"type": "length", "length": p.max_new_tokens}
        lps = (lp,) if lp is not None else ()
        if reason is not None:
            self._finish(req, reason, new_tokens=(token,), logprobs=lps)
        else:
            self._emit(req, (token,), None, lps)

    def _finish(
        self,
        req: ServeRequest,
        reason: dict,
        new_tokens: tuple[int, ...] = (),
        logprobs: tuple[TokenLogprob, ...] = (),
    ) -> None:
        """The one place a request ends: it leaves the queues, gives back what it holds and
        gets its terminal event. A request that has already ended is never ended again."""
        if req.finished:
            log.error(
                "request %s ended twice (%s, then %s); ignored", req.rid, req.finish_reason, reason
            )
            return
        if req.status is ReqStatus.RUNNING:
            self.running.remove(req)
            self._release(req)
        elif req.status is ReqStatus.WAITING and req in self.waiting:
            self.waiting.remove(req)
        req.status = ReqStatus.FINISHED
        req.finish_reason = reason
        self.live.pop(req.rid, None)
        if reason["type"] == "abort":
            self.stats.aborted_requests += 1
        else:
            self.stats.finished_requests += 1
        if req.text is not None:
            req.text.finish()
        self._emit(req, new_tokens, reason, logprobs)

    def _emit(
        self,
        req: ServeRequest,
        new_tokens: tuple[int, ...],
        reason: dict | None,
        logprobs: tuple[TokenLogprob, ...] = (),
    ) -> None:
        if req.on_output is None:
            return
        delta = ""
        if req.text is not None and self.text_in_engine:
            delta = req.text.take_stream_delta(final=reason is not None)
        event = OutputEvent(
            req.rid, new_tokens, len(req.prompt), len(req.output), reason, delta, logprobs
        )
        if self._holding:
            self._held_events.append((req, event))
            return
        self._hand_out_held()
        req.on_output(event)

    def _hand_out_held(self) -> None:
        """Deliver the held events, in the order they were made."""
        held, self._held_events = self._held_events, []
        for req, event in held:
            try:
                req.on_output(event)
            except Exception as exc:  # one consumer's failure ends its request, not the step
                log.exception("request %s failed while its output was handed out", req.rid)
                if not req.finished:
                    self.stats.failed_requests += 1
                    self._finish(req, abort_reason(f"{type(exc).__name__}: {exc}", 500))

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
