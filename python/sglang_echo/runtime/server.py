"""HTTP front end: SGLang's native ``/generate``, OpenAI's ``/v1/completions`` and
``/v1/chat/completions`` (streaming too), ``/health``, ``/get_model_info``,
``/get_server_info``, ``/v1/models`` and Prometheus ``/metrics``.

Handlers never touch the model: they validate the body, hand a ``ServeRequest`` to the
engine thread (``EngineLoop``) and read its ``OutputEvent``s from an asyncio queue the
engine thread fills through ``call_soon_threadsafe``. A client that goes away mid-request
gets its request aborted, which returns every token slot and ECHO slot at once.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from sglang_echo.runtime import metrics, protocol
from sglang_echo.runtime.engine_loop import EngineLoop
from sglang_echo.runtime.protocol import BadRequest, ParsedRequest
from sglang_echo.runtime.request import OutputEvent, ServeRequest
from sglang_echo.runtime.serving import Serving

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DISCONNECT_POLL_S = 0.5


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


class EventStream:
    """Events of one request, moved from the engine thread into the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: asyncio.Queue[OutputEvent] = asyncio.Queue()

    def push(self, event: OutputEvent) -> None:  # engine thread
        self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    async def next_batch(self) -> list[OutputEvent]:
        """At least one event, plus any that queued up meanwhile (coalesced)."""
        events = [await self._queue.get()]
        while not self._queue.empty():
            events.append(self._queue.get_nowait())
        return events


class TextTracker:
    """Cumulative output ids -> text, holding back an incomplete UTF-8 tail and cutting at a
    matched stop string (which, as in SGLang, is not part of the output)."""

    def __init__(self, detok: Callable[[list[int]], str] | None) -> None:
        self.detok = detok
        self.ids: list[int] = []
        self.sent = ""  # text already streamed

    def add(self, events: list[OutputEvent]) -> tuple[str, str]:
        """-> (full text so far, new text since the last call)."""
        for ev in events:
            self.ids.extend(ev.new_token_ids)
        text = self.detok(self.ids) if self.detok is not None else ""
        final = events[-1].finish_reason
        if final is not None and isinstance(final.get("matched"), str):
            cut = text.find(final["matched"])
            if cut >= 0:
                text = text[:cut]
        elif final is None and text.endswith("\ufffd"):
            text = text.rstrip("\ufffd")  # wait for the rest of the character
        if not text.startswith(self.sent):
            self.sent = text[: len(self.sent)]  # decoding changed an earlier char: resync
        delta = text[len(self.sent) :]
        self.sent = text
        return text, delta


def openai_finish(reason: dict | None) -> str | None:
    if reason is None:
        return None
    return {"length": "length", "stop": "stop"}.get(reason["type"], "abort")


def create_app(serving: Serving, engine: EngineLoop | None = None) -> FastAPI:
    engine = engine or EngineLoop(serving.scheduler)
    info = serving.info
    tokenizer = serving.tokenizer
    detok = (lambda ids: tokenizer.decode(ids)) if tokenizer is not None else None
    model_name = info["served_model_name"]

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

    # ------------------------------------------------------------ plumbing
    async def read_body(request: Request) -> dict:
        return protocol.parse_json(await request.body())

    def validated(parsed: ParsedRequest) -> ParsedRequest:
        protocol.check_prompt(
            parsed, info["vocab_size"], info["context_length"], info["max_total_tokens"]
        )
        return parsed

    def submit(parsed: ParsedRequest, rid: str) -> EventStream:
        if not engine.alive:
            raise RuntimeError("the engine thread is not running")
        stream = EventStream(asyncio.get_running_loop())
        req = ServeRequest(
            list(parsed.prompt_ids),
            rid=rid,
            params=parsed.params,
            on_output=stream.push,
            arrival_s=time.perf_counter(),
        )
        engine.submit(req)
        return stream

    async def events_of(
        stream: EventStream, rid: str, request: Request, watch_disconnect: bool
    ) -> AsyncIterator[list[OutputEvent]]:
        """Yield event batches until the request ends; abort it if the caller leaves."""
        done = False
        try:
            while not done:
                if watch_disconnect:
                    try:
                        batch = await asyncio.wait_for(stream.next_batch(), DISCONNECT_POLL_S)
                    except TimeoutError:
                        if await request.is_disconnected():
                            return
                        continue
                else:
                    batch = await stream.next_batch()
                done = batch[-1].finished
                yield batch
        finally:
            if not done:
                engine.abort(rid)  # client gone (or the stream was cancelled)

    async def handle(
        request: Request,
        parse: Callable[[dict], ParsedRequest],
        respond: Callable[[ParsedRequest, EventStream, str, Request], object],
        prefix: str,
    ):
        try:
            parsed = validated(parse(await read_body(request)))
        except BadRequest as exc:
            return error_response(str(exc))
        rid = parsed.rid or f"{prefix}-{uuid.uuid4().hex}"
        try:
            stream = submit(parsed, rid)
        except RuntimeError as exc:
            return error_response(str(exc), 503)
        return await respond(parsed, stream, rid, request)

    # ------------------------------------------------------- SGLang native
    def meta(rid: str, ev: OutputEvent, started: float) -> dict:
        return {
            "id": rid,
            "prompt_tokens": ev.prompt_tokens,
            "completion_tokens": ev.completion_tokens,
            "cached_tokens": 0,
            "finish_reason": ev.finish_reason,
            "e2e_latency": time.perf_counter() - started,
        }

    async def respond_generate(parsed, stream, rid, request):
        started = time.perf_counter()
        text = TextTracker(detok)
        if parsed.stream:

            async def body() -> AsyncIterator[bytes]:
                async for batch in events_of(stream, rid, request, watch_disconnect=False):
                    full, _ = text.add(batch)
                    out = {
                        "text": full,
                        "output_ids": list(text.ids),
                        "meta_info": meta(rid, batch[-1], started),
                    }
                    yield sse(out)
                yield sse("[DONE]")

            return StreamingResponse(body(), media_type="text/event-stream", headers=SSE_HEADERS)
        last = None
        async for batch in events_of(stream, rid, request, watch_disconnect=True):
            full, _ = text.add(batch)
            last = batch[-1]
        if last is None:
            return Response(status_code=499)
        return {"text": full, "output_ids": text.ids, "meta_info": meta(rid, last, started)}

    @app.post("/generate")
    async def generate(request: Request):
        return await handle(
            request, lambda d: protocol.parse_generate(d, tokenizer), respond_generate, "gen"
        )

    # ------------------------------------------------------------ OpenAI
    def usage(ev: OutputEvent) -> dict:
        return {
            "prompt_tokens": ev.prompt_tokens,
            "completion_tokens": ev.completion_tokens,
            "total_tokens": ev.prompt_tokens + ev.completion_tokens,
        }

    def make_openai_responder(chat: bool):
        obj = "chat.completion" if chat else "text_completion"

        def choice(text: str, reason: dict | None, streaming: bool, first: bool = False) -> dict:
            c: dict = {"index": 0, "finish_reason": openai_finish(reason), "logprobs": None}
            if chat and streaming:
                c["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
            elif chat:
                c["message"] = {"role": "assistant", "content": text}
            else:
                c["text"] = text
            return c

        async def respond(parsed, stream, rid, request):
            created = int(time.time())
            head = {"id": rid, "created": created, "model": model_name}
            text = TextTracker(detok)
            if parsed.stream:

                async def body() -> AsyncIterator[bytes]:
                    first = True
                    last = None
                    async for batch in events_of(stream, rid, request, watch_disconnect=False):
                        _, delta = text.add(batch)
                        last = batch[-1]
                        chunk = {
                            **head,
                            "object": obj + ".chunk" if chat else obj,
                            "choices": [choice(delta, last.finish_reason, True, first)],
                        }
                        first = False
                        yield sse(chunk)
                    if parsed.include_usage and last is not None:
                        tail = {**head, "object": obj + ".chunk" if chat else obj}
                        yield sse({**tail, "choices": [], "usage": usage(last)})
                    yield sse("[DONE]")

                return StreamingResponse(
                    body(), media_type="text/event-stream", headers=SSE_HEADERS
                )
            last = None
            full = ""
            async for batch in events_of(stream, rid, request, watch_disconnect=True):
                full, _ = text.add(batch)
                last = batch[-1]
            if last is None:
                return Response(status_code=499)
            return {
                **head,
                "object": obj,
                "choices": [choice(full, last.finish_reason, False)],
                "usage": usage(last),
            }

        return respond

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(
            request,
            lambda d: protocol.parse_completion(d, tokenizer),
            make_openai_responder(chat=False),
            "cmpl",
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(
            request,
            lambda d: protocol.parse_chat(d, tokenizer),
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
            body = await read_body(request)
        except BadRequest as exc:
            return error_response(str(exc))
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
