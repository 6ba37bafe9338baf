"""The scheduler's output events: made in order, held through a decode step's acceptance,
handed out once the next step is launched.

Why apart from the scheduler: whoever consumes a request's events (an HTTP thread, the
engine process's sender) should run while the device works, not between two steps where
it takes the GIL from the engine thread preparing the next launch; holding and handing
out, in the order the events were made and never after a request's terminal event, is
one job of its own.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sglang_echo.runtime.request import OutputEvent, ServeRequest, TokenLogprob

log = logging.getLogger("sglang_echo.scheduler")


def abort_reason(message: str, status_code: int) -> dict:
    """How an aborted request ends, as SGLang reports it: with the HTTP status a client
    should see (499 aborted by a client, 400 refused, 500 engine error, 503 shutting down)."""
    return {"type": "abort", "message": message, "status_code": status_code}


class EventOutbox:
    """Makes each request's events and hands them to its ``on_output``."""

    def __init__(self, scheduler: Any) -> None:
        """``scheduler``: the Scheduler (its ``text_in_engine``, ``stats`` and ``_finish``)."""
        self.s = scheduler
        # Events of a decode step's tokens, held while its tokens are accepted and handed
        # out once the next step is launched (``hand_out``): whoever consumes them (an
        # HTTP thread, the engine process's sender) then runs while the device works
        # instead of between two steps, where it took the GIL from the engine thread
        # preparing the next launch. The order of events is kept: any event made outside
        # that window hands out the held ones first, so nothing follows a request's
        # terminal event.
        self.held: list[tuple[ServeRequest, OutputEvent]] = []
        self.holding = False

    @contextmanager
    def holding_events(self) -> Iterator[None]:
        """A decode step's acceptance: the events it makes are held, handed out later."""
        self.holding = True
        try:
            yield
        finally:
            self.holding = False

    def emit(
        self,
        req: ServeRequest,
        new_tokens: tuple[int, ...],
        reason: dict | None,
        logprobs: tuple[TokenLogprob, ...] = (),
    ) -> None:
        if req.on_output is None:
            return
        delta = ""
        if req.text is not None and self.s.text_in_engine:
            delta = req.text.take_stream_delta(final=reason is not None)
        event = OutputEvent(
            req.rid, new_tokens, len(req.prompt), len(req.output), reason, delta, logprobs
        )
        if self.holding:
            self.held.append((req, event))
            return
        self.hand_out()
        req.on_output(event)

    def hand_out(self) -> None:
        """Deliver the held events, in the order they were made."""
        held, self.held = self.held, []
        for req, event in held:
            try:
                req.on_output(event)
            except Exception as exc:  # one consumer's failure ends its request, not the step
                log.exception("request %s failed while its output was handed out", req.rid)
                if not req.finished:
                    self.s.stats.failed_requests += 1
                    self.s._finish(req, abort_reason(f"{type(exc).__name__}: {exc}", 500))
