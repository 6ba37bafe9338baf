"""The overlap schedule's step in flight: a launched decode step whose tokens the host has
not read yet.

Why apart from the scheduler: with ``overlap=True`` decode step N+1 is launched before
step N's tokens are read, its inputs taken from N's choices on the device; which step is
in flight, which of its requests carry a token not yet read, and reading it (discarding
the token of a request that ended since) is bookkeeping of its own, apart from admission
and from how a request's tokens are accepted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sglang_echo.runtime.request import ServeRequest
from sglang_echo.runtime.sampling import DeviceSample, SampledBatch, sample_on_device
from sglang_echo.runtime.step_runner import CarriedTokens


@dataclass(eq=False)
class _InFlight:
    """A launched decode step whose tokens the host has not read yet (overlap)."""

    reqs: list[ServeRequest]
    logits: torch.Tensor
    sample: DeviceSample
    ids: set[int]  # id() of each request, for membership without comparing requests


class StepInFlight:
    """The scheduler's decode step in flight (``step``: None when there is none)."""

    def __init__(self, scheduler: Any) -> None:
        """``scheduler``: the Scheduler (its steps, stats, ``on_logits`` and acceptance)."""
        self.s = scheduler
        self.step: _InFlight | None = None

    def carries(self, req: ServeRequest) -> bool:
        """Whether the step in flight holds a token of ``req`` not yet read."""
        return self.step is not None and id(req) in self.step.ids

    def launch(self, decoding: list[ServeRequest]) -> None:
        """Launch this step (the step in flight's requests take their next ids from its
        choices on the device) and its sampling, then read the step in flight."""
        s = self.s
        prev = self.step
        pending = {id(r): i for i, r in enumerate(prev.reqs)} if prev is not None else {}
        carried = None
        if prev is not None:
            rows = [j for j, r in enumerate(decoding) if id(r) in pending]
            if rows:
                carried = CarriedTokens(
                    prev.sample.tokens, rows, [pending[id(decoding[j])] for j in rows]
                )
        try:
            with s.stats.timed("decode"):
                logits = s.steps.decode(decoding, carried)
                sample = sample_on_device(
                    logits,
                    [r.params for r in decoding],
                    [r.sample_key for r in decoding],
                    [len(r.output) + (id(r) in pending) for r in decoding],
                    readback=s.steps.readback,
                )
        except Exception as exc:  # the phase's requests end, the rest go on
            self.step = None  # its tokens are lost with the step that failed after it
            launched = {id(r) for r in decoding}
            extra = [r for r in (prev.reqs if prev else ()) if id(r) not in launched]
            s._fail([*decoding, *extra], "decode", exc)
            return
        s.admission.count_decode_step(len(decoding))
        self.step = _InFlight(decoding, logits, sample, {id(r) for r in decoding})
        if prev is not None:
            with s.stats.timed("accept"):
                self._accept(prev)
        s._while_the_step_runs()

    def read(self) -> None:
        """Take the step in flight's tokens now (its requests then have no pending token)."""
        prev, self.step = self.step, None
        if prev is not None:
            with self.s.stats.timed("accept"):
                self._accept(prev)

    def _accept(self, step: _InFlight) -> None:
        """The tokens of a step read from the host copy; a request that ended since it was
        launched (a stop at the step before, an abort) has its token discarded."""
        s = self.s
        live = [i for i, r in enumerate(step.reqs) if not r.finished]
        if not live:
            step.sample.read()  # nothing to keep, but its copy is done before its memory goes
            return
        reqs = [step.reqs[i] for i in live]
        if s.on_logits is not None:
            rows = torch.tensor(live, dtype=torch.int64).to(step.logits.device)
            s.on_logits(reqs, step.logits.index_select(0, rows))
        out = step.sample.read()
        s._accept_sampled(
            reqs,
            SampledBatch(
                [out.tokens[i] for i in live],
                [out.finite[i] for i in live],
                [out.logprobs[i] for i in live],
            ),
        )
