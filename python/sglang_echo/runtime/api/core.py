"""The streaming core every protocol adapter shares: one request from body to last event.

Handlers never touch the model: the core validates the body, hands a ``ServeRequest`` to the
engine thread (``EngineLoop``) and yields its ``OutputEvent``s, which the engine thread
posts through an ``EventMailbox`` into the request's ``EventStream``. It keeps the live
request ids (a live id is refused, so one client can never end another's request) and
aborts a request whose client goes away, streaming or not, which returns every token slot
and ECHO slot at once. Bodies are bounded (``--max-request-bytes``) and parsed and
tokenised off the event loop, so one huge prompt does not stall every other stream.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from sglang_echo.runtime import protocol
from sglang_echo.runtime.api.wire import SSE_HEADERS, error_response
from sglang_echo.runtime.engine_loop import EngineLoop
from sglang_echo.runtime.fake_transfer import prompt_seed
from sglang_echo.runtime.protocol import BadRequest, ParsedRequest
from sglang_echo.runtime.request import OutputEvent, ServeRequest, TokenLogprob
from sglang_echo.runtime.serving import Serving

DISCONNECT_POLL_S = 0.5
DEFAULT_MAX_REQUEST_BYTES = 32 << 20


class EventMailbox:
    """Output events from the engine thread to the event loop, one wake-up per burst.

    Why: the engine thread emits an event per running request per decode step. One
    ``call_soon_threadsafe`` per event writes the loop's self-pipe and wakes its thread each
    time, which then contends for the GIL with the engine thread in the middle of its step
    (through the server, ECHO's decode phase waited milliseconds a step beyond its CPU
    time at a mid-size batch). Here events queue under a lock, only the first of a burst wakes the
    loop, and the loop hands the whole burst to the streams' queues, in order.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue, OutputEvent]] = []

    def post(self, queue: asyncio.Queue, event: OutputEvent) -> None:  # engine thread
        with self._lock:
            self._pending.append((queue, event))
            first = len(self._pending) == 1
        if first:
            self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:  # event loop
        with self._lock:
            burst, self._pending = self._pending, []
        for queue, event in burst:
            queue.put_nowait(event)


class EventStream:
    """Events of one request, moved from the engine thread into the event loop."""

    def __init__(self, mailbox: EventMailbox) -> None:
        self._mailbox = mailbox
        self._queue: asyncio.Queue[OutputEvent] = asyncio.Queue()

    def push(self, event: OutputEvent) -> None:  # engine thread
        self._mailbox.post(self._queue, event)

    async def next_batch(self) -> list[OutputEvent]:
        """At least one event, plus any that queued up meanwhile (coalesced)."""
        events = [await self._queue.get()]
        while not self._queue.empty():
            events.append(self._queue.get_nowait())
        return events


class OutputSoFar:
    """What a client has been sent of one request: ids, text, log-probabilities.

    The engine thread already turned tokens into text incrementally (stop strings cut,
    partial characters held back), so this only concatenates the events' deltas.
    """

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.text = ""
        self.logprobs: list[TokenLogprob] = []

    def add(self, events: list[OutputEvent]) -> tuple[str, list[TokenLogprob]]:
        """-> (new text, new log-probabilities) of these events."""
        delta = "".join(ev.text_delta for ev in events)
        new_lps = [lp for ev in events for lp in ev.logprobs]
        for ev in events:
            self.ids.extend(ev.new_token_ids)
        self.text += delta
        self.logprobs.extend(new_lps)
        return delta, new_lps


# What an adapter does with a submitted request: (parsed, stream, rid, request) -> response.
Responder = Callable[[ParsedRequest, EventStream, str, Request], Awaitable[Response | dict]]


class StreamingCore:
    """Submission, live requests, event streams and their end, for every protocol."""

    def __init__(self, serving: Serving, engine: EngineLoop) -> None:
        self.serving = serving
        self.engine = engine
        self.info = serving.info
        self.tokenizer = serving.tokenizer
        self.model_name = self.info["served_model_name"]
        self.decode_node = self.info.get("disaggregation_mode") == "decode"
        self.max_body = getattr(serving.args, "max_request_bytes", DEFAULT_MAX_REQUEST_BYTES)
        prompt_limit = min(self.info["context_length"], self.info["max_total_tokens"] + 1) - 1
        self.encoder = (
            protocol.BoundedTokenizer(self.tokenizer, prompt_limit) if self.tokenizer else None
        )
        # Request id -> the stream of the request that holds it (event loop only). Keyed to
        # the stream so that a late cleanup of a finished request can never touch a newer
        # request that reuses its id.
        self.live: dict[str, EventStream] = {}
        self._mailbox: EventMailbox | None = None  # the running loop's, made on first use
        # Bodies are parsed (and text tokenized) on one thread, in the order they came: on
        # asyncio's pool, dozens of 100K-token bodies parsed at once under one GIL, each
        # slower for the others, and none reached the engine before nearly all were done.
        self._parser = ThreadPoolExecutor(1, thread_name_prefix="echo-parse")

    def close(self) -> None:
        """Let the parser thread go once the app stops (a body being parsed finishes)."""
        self._parser.shutdown(wait=False)

    def loop_mailbox(self) -> EventMailbox:
        loop = asyncio.get_running_loop()
        if self._mailbox is None or self._mailbox.loop is not loop:
            self._mailbox = EventMailbox(loop)
        return self._mailbox

    async def read_body(self, request: Request) -> bytes:
        """The body, refused with 413 as soon as it passes ``--max-request-bytes``."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body:
            raise protocol.PayloadTooLarge(int(declared), self.max_body)
        size, chunks = 0, []
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body:
                raise protocol.PayloadTooLarge(size, self.max_body)
            chunks.append(chunk)
        return b"".join(chunks)

    def parse_and_check(self, parse: Callable[[dict], ParsedRequest], body: bytes) -> ParsedRequest:
        parsed = parse(protocol.parse_json(body))
        info = self.info
        protocol.check_prompt(
            parsed, info["vocab_size"], info["context_length"], info["max_total_tokens"]
        )
        if self.decode_node:  # the fake transfer's seed, here rather than on the engine thread
            parsed = dataclasses.replace(parsed, prompt_seed=prompt_seed(parsed.prompt_ids))
        return parsed

    def submit(self, parsed: ParsedRequest, rid: str, stream: EventStream) -> None:
        if not self.engine.alive:
            if self.engine.fatal_error:
                raise RuntimeError(f"the engine stopped: {self.engine.fatal_error}")
            raise RuntimeError("the server is shutting down or its engine thread stopped")
        ids = list(parsed.prompt_ids)
        req = ServeRequest(
            ids,
            rid=rid,
            params=parsed.params,
            on_output=stream.push,
            arrival_s=time.perf_counter(),
            prompt_seed=parsed.prompt_seed,
        )
        self.engine.submit(req)

    def release(self, rid: str, stream: EventStream, finished: bool) -> None:
        if self.live.get(rid) is stream:
            del self.live[rid]
            if not finished:
                self.engine.abort(rid)  # client gone (or the stream was cancelled)

    async def events_of(
        self, stream: EventStream, rid: str, request: Request
    ) -> AsyncIterator[list[OutputEvent]]:
        """Yield event batches until the request ends; abort it if the caller leaves.

        The disconnect is polled in both modes: a streaming request that waits in the queue
        sends nothing, so a failed write would not reveal that its client is gone. It is
        polled on a clock, once per ``DISCONNECT_POLL_S`` whether events arrive or not: a
        non-streaming request that is producing tokens never falls silent, and polling
        only on silence let it generate to its end after its client left.
        """
        clock = asyncio.get_running_loop().time
        check_at = clock() + DISCONNECT_POLL_S
        done = False
        try:
            while not done:
                if clock() >= check_at:
                    if await request.is_disconnected():
                        return
                    check_at = clock() + DISCONNECT_POLL_S
                try:
                    batch = await asyncio.wait_for(stream.next_batch(), check_at - clock())
                except TimeoutError:
                    continue
                done = batch[-1].finished
                yield batch
        finally:
            self.release(rid, stream, done)

    async def collect(
        self, stream: EventStream, rid: str, request: Request, out: OutputSoFar
    ) -> OutputEvent | None:
        """A non-streaming response's events gathered into ``out``: the request's last
        event, or None when its client left first."""
        last = None
        async for batch in self.events_of(stream, rid, request):
            out.add(batch)
            last = batch[-1]
        return last

    async def handle(
        self,
        request: Request,
        parse: Callable[[dict], ParsedRequest],
        respond: Responder,
        prefix: str,
    ) -> Response | dict:
        """Body -> parsed request -> live, submitted request -> the adapter's response."""
        try:
            body = await self.read_body(request)
            # JSON parsing and tokenisation of a large prompt run off the event loop, so
            # other clients' streams keep flowing meanwhile.
            parsed = await asyncio.get_running_loop().run_in_executor(
                self._parser, self.parse_and_check, parse, body
            )
        except BadRequest as exc:
            return error_response(str(exc), exc.status)
        rid = parsed.rid or f"{prefix}-{uuid.uuid4().hex}"
        if rid in self.live:
            return error_response(
                f"request id {rid!r} belongs to a request that is still running; give each "
                "request its own rid"
            )
        stream = self.live[rid] = EventStream(self.loop_mailbox())
        try:
            self.submit(parsed, rid, stream)
        except RuntimeError as exc:
            del self.live[rid]
            return error_response(str(exc), 503)
        return await respond(parsed, stream, rid, request)

    def streaming(
        self, body: AsyncIterator[bytes], rid: str, stream: EventStream
    ) -> StreamingResponse:
        # The background task runs after the response ends, also when the client left
        # before the body started (then the generator's own cleanup never ran).
        return StreamingResponse(
            body,
            media_type="text/event-stream",
            headers=SSE_HEADERS,
            background=BackgroundTask(self.release, rid, stream, False),
        )
