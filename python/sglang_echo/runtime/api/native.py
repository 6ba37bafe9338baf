"""SGLang's native ``/generate``: the core's events as ``text`` / ``output_ids`` /
``meta_info``, one cumulative SSE frame per event batch or one JSON body at the end."""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import Response

from sglang_echo.runtime import protocol
from sglang_echo.runtime.api.core import EventStream, OutputSoFar, StreamingCore
from sglang_echo.runtime.api.wire import sse
from sglang_echo.runtime.protocol import ParsedRequest
from sglang_echo.runtime.request import OutputEvent, SamplingParams


def meta(
    rid: str, ev: OutputEvent, started: float, out: OutputSoFar, params: SamplingParams
) -> dict:
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
            m["output_top_logprobs"] = [[[v, t, None] for t, v in lp.top] for lp in out.logprobs]
    return m


async def respond_generate(
    core: StreamingCore, parsed: ParsedRequest, stream: EventStream, rid: str, request: Request
) -> Response | dict:
    started = time.perf_counter()
    out = OutputSoFar()
    if parsed.stream:

        async def body() -> AsyncIterator[bytes]:
            async for batch in core.events_of(stream, rid, request):
                out.add(batch)
                info_ = meta(rid, batch[-1], started, out, parsed.params)
                yield sse({"text": out.text, "output_ids": list(out.ids), "meta_info": info_})
            yield sse("[DONE]")

        return core.streaming(body(), rid, stream)
    last = await core.collect(stream, rid, request, out)
    if last is None:
        return Response(status_code=499)
    return {
        "text": out.text,
        "output_ids": out.ids,
        "meta_info": meta(rid, last, started, out, parsed.params),
    }


def register(app: FastAPI, core: StreamingCore) -> None:
    respond = functools.partial(respond_generate, core)

    @app.post("/generate")
    async def generate(request: Request):
        return await core.handle(
            request, lambda d: protocol.parse_generate(d, core.encoder), respond, "gen"
        )
