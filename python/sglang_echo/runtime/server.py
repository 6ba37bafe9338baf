"""HTTP front end: SGLang's native ``/generate``, OpenAI's ``/v1/completions`` and
``/v1/chat/completions`` (streaming too), ``/health``, ``/get_model_info``,
``/get_server_info``, ``/v1/models`` and Prometheus ``/metrics``.

Handlers never touch the model: they validate the body, hand a ``ServeRequest`` to the
engine thread (``EngineLoop``) and read its ``OutputEvent``s from an asyncio queue the
engine thread fills through ``call_soon_threadsafe``. A client that goes away mid-request
(streaming or not) gets its own request aborted, which returns every token slot and ECHO
slot at once; a request id that is still live is refused, so one client can never end
another's request. Bodies are bounded (``--max-request-bytes``) and parsed and tokenised
off the event loop, so one huge prompt does not stall every other stream.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from sglang_echo.runtime import metrics, protocol
from sglang_echo.runtime.engine_loop import EngineLoop
from sglang_echo.runtime.protocol import BadRequest, ParsedRequest
from sglang_echo.runtime.request import OutputEvent, ServeRequest, TokenLogprob
from sglang_echo.runtime.serving import Serving
from sglang_echo.tokenizer import token_bytes, token_label

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DISCONNECT_POLL_S = 0.5
DEFAULT_MAX_REQUEST_BYTES = 32 << 20
log = logging.getLogger("sglang_echo.server")


def error_response(message: str, status: int = 400) -> JSONResponse:
    """OpenAI's error shape (the openai client reads it); SGLang clients print it."""
    kind = "invalid_request_error" if status == 400 else "server_error"
    return JSONResponse(
        {"object": "error", "error": {"message": message, "type": kind, "code": status}},
        status_code=status,
    )


def sse(data: dict | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n".encode()


class EventMailbox:
    """Output events from the engine thread to the event loop, one wake-up per burst.

    Why: the engine thread emits an event per running request per decode step. One
    ``call_soon_threadsafe`` per event writes the loop's self-pipe and wakes its thread each
    time, which then contends for the GIL with the engine thread in the middle of its step
    (through the server, ECHO's decode phase waited ~5 ms a step beyond its CPU time at a
    batch of ~15). Here events queue under a lock, only the first of a burst wakes the
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


def openai_finish(reason: dict | None) -> str | None:
    """OpenAI's finish_reason values; an aborted request is answered with an error."""
    if reason is None:
        return None
    return "length" if reason["type"] == "length" else "stop"


def abort_status(reason: dict) -> int:
    """The HTTP status the scheduler gave an aborted request (scheduler.abort_reason)."""
    return int(reason.get("status_code", 500))


def create_app(serving: Serving, engine: EngineLoop | None = None) -> FastAPI:
    engine = engine or EngineLoop(serving.scheduler)
    info = serving.info
    tokenizer = serving.tokenizer
    model_name = info["served_model_name"]
    max_body = getattr(serving.args, "max_request_bytes", DEFAULT_MAX_REQUEST_BYTES)
    prompt_limit = min(info["context_length"], info["max_total_tokens"] + 1) - 1
    encoder = protocol.BoundedTokenizer(tokenizer, prompt_limit) if tokenizer else None
    # Request id -> the stream of the request that holds it (event loop only). Keyed to the
    # stream so that a late cleanup of a finished request can never touch a newer request
    # that reuses its id.
    live: dict[str, EventStream] = {}

    mailbox: list[EventMailbox] = []  # the running loop's, made when the app starts

    def loop_mailbox() -> EventMailbox:
        loop = asyncio.get_running_loop()
        if not mailbox or mailbox[0].loop is not loop:
            mailbox[:] = [EventMailbox(loop)]
        return mailbox[0]

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(title="sglang-echo", lifespan=lifespan)
    app.state.engine = engine
    app.state.serving = serving
    app.state.live_rids = live

    @app.exception_handler(Exception)
    async def internal_error(_request: Request, exc: Exception) -> JSONResponse:
        # Never a plain-text 500: clients (the openai SDK) parse the error body.
        log.exception("unhandled error in a request handler")
        return error_response(f"internal error: {type(exc).__name__}: {exc}", 500)

    # ------------------------------------------------------------ plumbing
    async def read_body(request: Request) -> bytes:
        """The body, refused with 413 as soon as it passes ``--max-request-bytes``."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_body:
            raise protocol.PayloadTooLarge(int(declared), max_body)
        size, chunks = 0, []
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body:
                raise protocol.PayloadTooLarge(size, max_body)
            chunks.append(chunk)
        return b"".join(chunks)

    def parse_and_check(parse: Callable[[dict], ParsedRequest], body: bytes) -> ParsedRequest:
        parsed = parse(protocol.parse_json(body))
        protocol.check_prompt(
            parsed, info["vocab_size"], info["context_length"], info["max_total_tokens"]
        )
        return parsed

    def submit(parsed: ParsedRequest, rid: str, stream: EventStream) -> None:
        if not engine.alive:
            raise RuntimeError("the server is shutting down or its engine thread stopped")
        req = ServeRequest(
            list(parsed.prompt_ids),
            rid=rid,
            params=parsed.params,
            on_output=stream.push,
            arrival_s=time.perf_counter(),
        )
        engine.submit(req)

    def release(rid: str, stream: EventStream, finished: bool) -> None:
        if live.get(rid) is stream:
            del live[rid]
            if not finished:
                engine.abort(rid)  # client gone (or the stream was cancelled)

    async def events_of(
        stream: EventStream, rid: str, request: Request
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
            release(rid, stream, done)

    async def handle(
        request: Request,
        parse: Callable[[dict], ParsedRequest],
        respond: Callable[[ParsedRequest, EventStream, str, Request], object],
        prefix: str,
    ):
        try:
            body = await read_body(request)
            # JSON parsing and tokenisation of a large prompt run off the event loop, so
            # other clients' streams keep flowing meanwhile.
            parsed = await asyncio.to_thread(parse_and_check, parse, body)
        except BadRequest as exc:
            return error_response(str(exc), exc.status)
        rid = parsed.rid or f"{prefix}-{uuid.uuid4().hex}"
        if rid in live:
            return error_response(
                f"request id {rid!r} belongs to a request that is still running; give each "
                "request its own rid"
            )
        stream = live[rid] = EventStream(loop_mailbox())
        try:
            submit(parsed, rid, stream)
        except RuntimeError as exc:
            del live[rid]
            return error_response(str(exc), 503)
        return await respond(parsed, stream, rid, request)

    def streaming(body: AsyncIterator[bytes], rid: str, stream: EventStream) -> StreamingResponse:
        # The background task runs after the response ends, also when the client left
        # before the body started (then the generator's own cleanup never ran).
        return StreamingResponse(
            body,
            media_type="text/event-stream",
            headers=SSE_HEADERS,
            background=BackgroundTask(release, rid, stream, False),
        )

    @functools.lru_cache(maxsize=1 << 16)
    def token_text(token_id: int) -> str:
        return token_label(tokenizer, token_id) if tokenizer is not None else str(token_id)

    def token_raw(token_id: int) -> list[int]:
        return list(token_bytes(tokenizer, token_id)) if tokenizer is not None else []

    # ------------------------------------------------------- SGLang native
    def meta(rid: str, ev: OutputEvent, started: float, out: OutputSoFar, params) -> dict:
        m = {
            "id": rid,
            "prompt_tokens": ev.prompt_tokens,
            "completion_tokens": ev.completion_tokens,
            "cached_tokens": 0,
            "finish_reason": ev.finish_reason,
            "e2e_latency": time.perf_counter() - started,
        }
        if params.logprobs:
            m["output_token_logprobs"] = [[lp.logprob, lp.token_id, None] for lp in out.logprobs]
            if params.top_logprobs:
                m["output_top_logprobs"] = [
                    [[v, t, None] for t, v in lp.top] for lp in out.logprobs
                ]
        return m

    async def respond_generate(parsed, stream, rid, request):
        started = time.perf_counter()
        out = OutputSoFar()
        if parsed.stream:

            async def body() -> AsyncIterator[bytes]:
                async for batch in events_of(stream, rid, request):
                    out.add(batch)
                    info_ = meta(rid, batch[-1], started, out, parsed.params)
                    yield sse({"text": out.text, "output_ids": list(out.ids), "meta_info": info_})
                yield sse("[DONE]")

            return streaming(body(), rid, stream)
        last = None
        async for batch in events_of(stream, rid, request):
            out.add(batch)
            last = batch[-1]
        if last is None:
            return Response(status_code=499)
        return {
            "text": out.text,
            "output_ids": out.ids,
            "meta_info": meta(rid, last, started, out, parsed.params),
        }

    @app.post("/generate")
    async def generate(request: Request):
        return await handle(
            request, lambda d: protocol.parse_generate(d, encoder), respond_generate, "gen"
        )

    # ------------------------------------------------------------ OpenAI
    def usage(ev: OutputEvent) -> dict:
        return {
            "prompt_tokens": ev.prompt_tokens,
            "completion_tokens": ev.completion_tokens,
            "total_tokens": ev.prompt_tokens + ev.completion_tokens,
        }

    def completion_logprobs(lps: list[TokenLogprob], offset: int) -> dict:
        tokens = [token_text(lp.token_id) for lp in lps]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{token_text(t): v for t, v in lp.top} for lp in lps]
            if any(lp.top for lp in lps)
            else None,
            "text_offset": offsets,
        }

    def chat_logprobs(lps: list[TokenLogprob]) -> dict:
        def entry(token_id: int, value: float) -> dict:
            return {"token": token_text(token_id), "logprob": value, "bytes": token_raw(token_id)}

        return {
            "content": [
                {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                for lp in lps
            ]
        }

    def abort_error(reason: dict) -> JSONResponse:
        return error_response(
            f"the request was aborted: {reason.get('message', '')}", abort_status(reason)
        )

    def make_openai_responder(chat: bool):
        obj = "chat.completion" if chat else "text_completion"

        def choice(
            text: str,
            reason: dict | None,
            streaming_: bool,
            lps: dict | None,
            first: bool = False,
        ) -> dict:
            c: dict = {"index": 0, "finish_reason": openai_finish(reason), "logprobs": lps}
            if chat and streaming_:
                c["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
            elif chat:
                c["message"] = {"role": "assistant", "content": text}
            else:
                c["text"] = text
            return c

        def logprobs_of(params, lps: list[TokenLogprob], offset: int) -> dict | None:
            if not params.logprobs:
                return None
            return chat_logprobs(lps) if chat else completion_logprobs(lps, offset)

        async def respond(parsed, stream, rid, request):
            created = int(time.time())
            head = {"id": rid, "created": created, "model": model_name}
            out = OutputSoFar()
            if parsed.stream:

                async def body() -> AsyncIterator[bytes]:
                    first = True
                    last = None
                    async for batch in events_of(stream, rid, request):
                        offset = len(out.text)
                        delta, lps = out.add(batch)
                        last = batch[-1]
                        reason = last.finish_reason
                        if reason is not None and reason["type"] == "abort":
                            err = {"message": f"the request was aborted: {reason['message']}"}
                            yield sse({"error": {**err, "code": abort_status(reason)}})
                            break
                        chunk = {
                            **head,
                            "object": obj + ".chunk" if chat else obj,
                            "choices": [
                                choice(
                                    delta,
                                    reason,
                                    True,
                                    logprobs_of(parsed.params, lps, offset),
                                    first,
                                )
                            ],
                        }
                        first = False
                        yield sse(chunk)
                    if parsed.include_usage and last is not None:
                        tail = {**head, "object": obj + ".chunk" if chat else obj}
                        yield sse({**tail, "choices": [], "usage": usage(last)})
                    yield sse("[DONE]")

                return streaming(body(), rid, stream)
            last = None
            async for batch in events_of(stream, rid, request):
                out.add(batch)
                last = batch[-1]
            if last is None:
                return Response(status_code=499)
            if last.finish_reason["type"] == "abort":
                return abort_error(last.finish_reason)
            return {
                **head,
                "object": obj,
                "choices": [
                    choice(
                        out.text,
                        last.finish_reason,
                        False,
                        logprobs_of(parsed.params, out.logprobs, 0),
                    )
                ],
                "usage": usage(last),
            }

        return respond

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(
            request,
            lambda d: protocol.parse_completion(d, encoder),
            make_openai_responder(chat=False),
            "cmpl",
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(
            request,
            lambda d: protocol.parse_chat(d, encoder),
            make_openai_responder(chat=True),
            "chatcmpl",
        )

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "sglang-echo",
                    "root": info["model_path"],
                    "max_model_len": info["context_length"],
                }
            ],
        }

    # ------------------------------------------------------------ control
    @app.get("/health")
    @app.get("/health_generate")
    async def health():
        if not engine.alive:
            return PlainTextResponse("engine thread stopped", status_code=503)
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def get_model_info():
        return info

    @app.get("/get_server_info")
    async def get_server_info():
        snap = await asyncio.wrap_future(
            engine.call(lambda s: metrics.snapshot(s, serving.kv_cache))
        )
        state = {k: v for k, v in snap.items() if k != "echo"}
        return {**vars(serving.args), **info, "internal_states": [state]}

    @app.post("/flush_cache")
    @app.get("/flush_cache")
    async def flush_cache():
        return PlainTextResponse("Cache flushed (this runtime keeps no prefix cache).")

    @app.post("/abort_request")
    async def abort_request(request: Request):
        try:
            body = protocol.parse_json(await read_body(request))
        except BadRequest as exc:
            return error_response(str(exc), exc.status)
        rid = body.get("rid")
        if not isinstance(rid, str):
            return error_response("rid (a string) is required")
        engine.abort(rid)
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus():
        snap = await asyncio.wrap_future(
            engine.call(lambda s: metrics.snapshot(s, serving.kv_cache))
        )
        return PlainTextResponse(
            metrics.render(snap, model_name), media_type="text/plain; version=0.0.4"
        )

    return app
