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

MTP speculative decoding (``speculative``: runtime/speculative.py's ``SpecRounds``):
each decode step is one round over the decoding requests (``scheduler_speculative.py``):
S drafts, one verify step of Q = S + 1 lanes per request, its accepted tokens
through ``_accept`` one at a time. Admission reserves each request's draft tail (S more
locations), and the overlap schedule is off (a round's next inputs are read on the host).

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
from typing import TYPE_CHECKING, TypeVar

import torch

from sglang_echo.runtime.detokenizer import IncrementalText
from sglang_echo.runtime.request import ReqStatus, ServeRequest, TokenLogprob
from sglang_echo.runtime.sampling import SampledBatch, new_sample_key, sample_batch
from sglang_echo.runtime.scheduler_admission import AdmissionControl
from sglang_echo.runtime.scheduler_events import EventOutbox, abort_reason
from sglang_echo.runtime.scheduler_overlap import StepInFlight
from sglang_echo.runtime.scheduler_speculative import SpeculativeDecode
from sglang_echo.runtime.scheduler_stats import SchedulerStats
from sglang_echo.runtime.step_runner import StepRunner

if TYPE_CHECKING:
    from sglang_echo.runtime.fake_transfer import FakeTransfer
    from sglang_echo.runtime.speculative import SpecRounds

log = logging.getLogger("sglang_echo.scheduler")
T = TypeVar("T")

# Admission leaves every running request room for this many more tokens, so a preemption
# (a recompute) is rare and a retracted request is not re-admitted only to be retracted
# again at the next step.
DECODE_RESERVE_STEPS = 32


class RequestRejected(ValueError):
    """A request that can never run here (too long for the context or the pool, or a
    request id already in use)."""


class Scheduler:
    """Runs the steps over the running batch; its collaborators, one job each: ``admission``
    (admission, decode counts, preemption), ``in_flight`` (the overlap schedule's step not
    yet read), ``events`` (output events, held through a decode step's acceptance) and
    ``speculative`` (MTP rounds instead of decode steps; None without speculation)."""

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
        speculative: SpecRounds | None = None,
    ) -> None:
        self.steps = steps
        if speculative is not None and prompt_source is not None:
            # Arrivals bring the draft's KV and carry too, as from a prefill node.
            prompt_source.with_draft(speculative.draft_cache, speculative.draft_model.config)
        if speculative is not None and overlap:
            log.info(
                "overlap schedule off under speculative decoding: a round's next inputs are "
                "its accepted tokens, read on the host"
            )
            overlap = False
        self.overlap = overlap
        self.speculative = None if speculative is None else SpeculativeDecode(self, speculative)
        self.in_flight = StepInFlight(self)  # overlap: the decode step not yet read
        # Locations a request may hold past its committed positions: S under speculative
        # decoding (a round's draft tail, rewritten in place), 0 otherwise.
        self.draft_tail = 0 if speculative is None else speculative.num_draft
        self.admission = AdmissionControl(self)
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
        self.events = EventOutbox(self)

    # ------------------------------------------------------------ requests
    def check(self, req: ServeRequest) -> None:
        """Raise ``RequestRejected`` for a request that could never be admitted."""
        n = len(req.prompt)
        tail = self.draft_tail  # a speculative round's draft positions
        drafts = f" and {tail} draft positions" if tail else ""
        held = f" (its {tail} draft positions included)" if tail else ""
        total = n + req.params.max_new_tokens + tail
        if total > self.context_length:
            raise RequestRejected(
                f"the prompt has {n} tokens and max_new_tokens is {req.params.max_new_tokens}"
                f"{drafts}: {total} tokens exceed the context length of {self.context_length}; "
                "shorten the prompt or lower max_new_tokens"
            )
        if req.token_budget() + tail > self.capacity:
            raise RequestRejected(
                f"the request needs {req.token_budget() + tail} KV token slots{held} but "
                "the pool holds "
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
        self.stats.received_requests += 1

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
        self.events.emit(req, (), abort_reason(message, 400))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---------------------------------------------------------------- step
    def step(self) -> bool:
        """One scheduling round; returns False when there was nothing to do."""
        with self.stats.timed("admit"):
            self.admission.admit()
        with self.stats.timed("receive"):
            self._receive_arrived()
        if not self.running:
            # A decode node's arrival can end its request at once (its first token is a stop
            # token or its whole budget): what it held goes back now, not at the next command.
            self.in_flight.read()
            self.steps.flush_releases()
            self.events.hand_out()
            return False
        # ``running`` holds live requests only (``_finish`` takes a request out the moment it
        # ends), so no phase below can retract, prefill or decode one that has ended.
        if any(not r.prefill_done for r in self.running):
            self.in_flight.read()  # a prefill runs on the synchronous schedule
            self.admission.make_room(lambda: min(self.chunk, self.admission.pending_prefill()))
            prefilling = [r for r in self.running if not r.prefill_done]
            if prefilling:
                self._prefill(prefilling)
        if any(self.admission.decodable(r) for r in self.running):
            if self.steps.allocator.num_free < self.admission.decode_count():
                self.in_flight.read()  # preemption may come: on the synchronous schedule
            self.admission.make_room(self.admission.decode_count)
            decoding = [r for r in self.running if self.admission.decodable(r)]
            if decoding:
                self._decode(decoding)
            else:
                self.in_flight.read()
        else:
            self.in_flight.read()
            if self.prompt_source is not None and self.prompt_source.pending:
                with self.stats.timed("receive"):
                    self._receive_arrived(wait=True)  # nothing to step: wait, do not spin
        step = self.in_flight.step
        if step is not None and all(r.finished for r in step.reqs):
            self.in_flight.read()  # every request of the step in flight has ended
        self.steps.flush_releases()
        if not any(self.admission.decodable(r) for r in self.running):
            self.events.hand_out()  # no decode launch comes next to hand them out after
        self.stats.recent.append((time.perf_counter(), self.stats.generation_tokens))
        return True

    def fail_all(self, message: str, status_code: int = 503) -> None:
        """Shutdown (503), or an error outside any step (500): end every live request."""
        self.in_flight.step = None  # its tokens are not read: every request it holds ends here
        for req in [*self.waiting, *self.running]:
            self._finish(req, abort_reason(message, status_code))
        self.steps.flush_releases()

    # ---------------------------------------------------------- the phases
    def _prefill(self, prefilling: list[ServeRequest]) -> None:
        before = sum(r.cached_len for r in prefilling)
        spec = self.speculative
        forward = self.steps.prefill_chunk if spec is None else spec.prefill_chunk
        try:
            with self.stats.timed("prefill"):
                done, logits = forward(prefilling, self.chunk)
        except Exception as exc:  # the phase's requests end, the rest go on
            self._fail(prefilling, "prefill", exc)
            return
        self.events.hand_out()
        self.stats.prompt_tokens += sum(r.cached_len for r in prefilling) - before
        self.stats.prefill_steps += 1
        if done:
            with self.stats.timed("accept"):
                self._accept_batch(done, logits)
        if spec is not None:
            spec.draft_prompts()  # after the first tokens: a prompt's last draft takes one

    def _decode(self, decoding: list[ServeRequest]) -> None:
        if self.speculative is not None:
            self.speculative.decode(decoding)
            return
        if self.overlap:
            self.in_flight.launch(decoding)
            return
        logits = self.run_decode_step(decoding, lambda: self.steps.decode(decoding))
        if logits is not None:
            with self.stats.timed("accept"), self.events.holding_events():
                self._accept_batch(decoding, logits)

    def run_decode_step(self, decoding: list[ServeRequest], step: Callable[[], T]) -> T | None:
        """``step`` (the batch's decode step, or an MTP round's verify) as the decode phase:
        one that raises ends the batch's requests, the rest go on (None); else it is
        counted and admission and arrivals run while it does. Returns its result."""
        try:
            with self.stats.timed("decode"):
                out = step()
        except Exception as exc:
            self._fail(decoding, "decode", exc)
            return None
        self.admission.count_decode_step(len(decoding))
        self._while_the_step_runs()
        return out

    def _while_the_step_runs(self) -> None:
        """Admission and arrivals, on the host while the decode step just launched runs on
        the device (sampling below waits for it). Their kernels queue behind the step, so
        what they change on the device takes effect from the next step, as it would have
        between the steps; the step's own requests (``decoding``) are not touched: a
        request admitted or arrived here is not in it, and an arrival that ends at once
        holds nothing the step reads. It keeps the GPU fed instead of idle through them.
        The previous step's events go out first."""
        self.events.hand_out()
        with self.stats.timed("admit"):
            self.admission.admit()
        with self.stats.timed("receive"):
            self._receive_arrived()

    def _fail(self, reqs: list[ServeRequest], phase: str, exc: Exception) -> None:
        log.error("%s step failed for %d request(s)", phase, len(reqs), exc_info=exc)
        message = f"engine error in the {phase} step: {type(exc).__name__}: {exc}"
        for req in reqs:
            if not req.finished:
                self.stats.failed_requests += 1
                self._finish(req, abort_reason(message, 500))

    # ------------------------------------------------------------ arrivals
    def _receive_arrived(self, wait: bool = False) -> None:
        """A decode node's requests whose prompt KV is in place: their first token (the
        prefill node's) is emitted, and they decode from the next step on."""
        if self.prompt_source is None:
            return
        for req, first, logprob in self.prompt_source.arrived(wait=wait):
            carry = self.prompt_source.draft_of(req)
            if carry is not None and self.speculative is not None:
                self.speculative.arrived(req, *carry)
            if not req.finished:
                self._accept(req, first, logprob)
        failed, self.prompt_source.failed = self.prompt_source.failed, []
        for req, exc in failed:  # its KV never arrived: that request ends, the rest go on
            if not req.finished:
                self._fail([req], "transfer", exc)

    def _release(self, req: ServeRequest) -> None:
        """Give back what a running request holds: its pending transfer is cancelled first
        (so nothing writes into locations another request may get next), then its row and
        token locations (the KV backend's release is batched until the next flush)."""
        if self.prompt_source is not None:
            self.prompt_source.forget(req)
        if self.speculative is not None:
            self.speculative.forget(req)
        self.steps.release_later(req)

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
            self.events.emit(req, (token,), None, lps)

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
        self.events.emit(req, new_tokens, reason, logprobs)

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
