"""What OpenAI's ``/v1/completions`` and ``/v1/chat/completions`` share: one responder
(SSE chunks or one JSON body, usage, aborts as errors) over the core's events, told by an
``OpenAIShape`` what differs: object names, the choice's content and the log-probabilities.
"""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from sglang_echo.runtime.api.core import EventStream, OutputSoFar, Responder, StreamingCore
from sglang_echo.runtime.api.wire import error_response, sse
from sglang_echo.runtime.protocol import ParsedRequest
from sglang_echo.runtime.request import OutputEvent, SamplingParams, TokenLogprob
from sglang_echo.tokenizer import token_bytes, token_label


def openai_finish(reason: dict | None) -> str | None:
    """OpenAI's finish_reason values; an aborted request is answered with an error."""
    if reason is None:
        return None
    return "length" if reason["type"] == "length" else "stop"


def abort_status(reason: dict) -> int:
    """The HTTP status the scheduler gave an aborted request (scheduler.abort_reason)."""
    return int(reason.get("status_code", 500))


def abort_error(reason: dict) -> JSONResponse:
    return error_response(
        f"the request was aborted: {reason.get('message', '')}", abort_status(reason)
    )


def usage(ev: OutputEvent) -> dict:
    return {
        "prompt_tokens": ev.prompt_tokens,
        "completion_tokens": ev.completion_tokens,
        "total_tokens": ev.prompt_tokens + ev.completion_tokens,
    }


class TokenLabels:
    """A token's text and bytes as OpenAI's log-probabilities show them (ids without a
    tokenizer); texts are cached, as the same tokens come back in every response."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.text = functools.lru_cache(maxsize=1 << 16)(self._text)

    def _text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return str(token_id)
        return token_label(self.tokenizer, token_id)

    def raw(self, token_id: int) -> list[int]:
        return list(token_bytes(self.tokenizer, token_id)) if self.tokenizer is not None else []


@dataclass(frozen=True)
class OpenAIShape:
    """What one OpenAI endpoint names and writes differently from the other."""

    obj: str  # the object of a whole response
    chunk_obj: str  # the object of a streamed chunk
    # (text, streaming, first chunk) -> the choice's text, message or delta
    content: Callable[[str, bool, bool], dict]
    # (new log-probabilities, their text's offset in the output) -> the choice's logprobs
    logprobs: Callable[[list[TokenLogprob], int], dict]

    def choice(
        self, text: str, reason: dict | None, streaming: bool, lps: dict | None, first: bool
    ) -> dict:
        return {
            "index": 0,
            "finish_reason": openai_finish(reason),
            "logprobs": lps,
            **self.content(text, streaming, first),
        }

    def logprobs_of(
        self, params: SamplingParams, lps: list[TokenLogprob], offset: int
    ) -> dict | None:
        return self.logprobs(lps, offset) if params.logprobs else None


async def respond_openai(
    core: StreamingCore,
    shape: OpenAIShape,
    parsed: ParsedRequest,
    stream: EventStream,
    rid: str,
    request: Request,
) -> Response | dict:
    created = int(time.time())
    head = {"id": rid, "created": created, "model": core.model_name}
    out = OutputSoFar()
    if parsed.stream:

        async def body() -> AsyncIterator[bytes]:
            first = True
            last = None
            async for batch in core.events_of(stream, rid, request):
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
                    "object": shape.chunk_obj,
                    "choices": [
                        shape.choice(
                            delta,
                            reason,
                            True,
                            shape.logprobs_of(parsed.params, lps, offset),
                            first,
                        )
                    ],
                }
                first = False
                yield sse(chunk)
            if parsed.include_usage and last is not None:
                tail = {**head, "object": shape.chunk_obj}
                yield sse({**tail, "choices": [], "usage": usage(last)})
            yield sse("[DONE]")

        return core.streaming(body(), rid, stream)
    last = await core.collect(stream, rid, request, out)
    if last is None:
        return Response(status_code=499)
    if last.finish_reason["type"] == "abort":
        return abort_error(last.finish_reason)
    return {
        **head,
        "object": shape.obj,
        "choices": [
            shape.choice(
                out.text,
                last.finish_reason,
                False,
                shape.logprobs_of(parsed.params, out.logprobs, 0),
                False,
            )
        ],
        "usage": usage(last),
    }


def openai_responder(core: StreamingCore, shape: OpenAIShape) -> Responder:
    return functools.partial(respond_openai, core, shape)
