"""OpenAI's ``/v1/completions``: a ``text_completion`` whose choice holds ``text`` and
log-probabilities in the legacy shape (tokens, token_logprobs, top_logprobs, text_offset)."""

from __future__ import annotations

from fastapi import FastAPI, Request

from sglang_echo.runtime import protocol
from sglang_echo.runtime.api.core import StreamingCore
from sglang_echo.runtime.api.openai_common import OpenAIShape, TokenLabels, openai_responder
from sglang_echo.runtime.request import TokenLogprob


def completion_logprobs(labels: TokenLabels, lps: list[TokenLogprob], offset: int) -> dict:
    tokens = [labels.text(lp.token_id) for lp in lps]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{labels.text(t): v for t, v in lp.top} for lp in lps]
        if any(lp.top for lp in lps)
        else None,
        "text_offset": offsets,
    }


def completion_shape(labels: TokenLabels) -> OpenAIShape:
    return OpenAIShape(
        obj="text_completion",
        chunk_obj="text_completion",
        content=lambda text, _streaming, _first: {"text": text},
        logprobs=lambda lps, offset: completion_logprobs(labels, lps, offset),
    )


def register(app: FastAPI, core: StreamingCore) -> None:
    respond = openai_responder(core, completion_shape(TokenLabels(core.tokenizer)))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await core.handle(
            request, lambda d: protocol.parse_completion(d, core.encoder), respond, "cmpl"
        )
