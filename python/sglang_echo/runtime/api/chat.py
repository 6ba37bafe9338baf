"""OpenAI's ``/v1/chat/completions``: a ``chat.completion`` whose choice holds the assistant
``message`` (a ``delta`` per streamed chunk, the first naming the role) and
log-probabilities in the chat shape (token, logprob, bytes, top_logprobs)."""

from __future__ import annotations

from fastapi import FastAPI, Request

from sglang_echo.runtime import protocol
from sglang_echo.runtime.api.core import StreamingCore
from sglang_echo.runtime.api.openai_common import OpenAIShape, TokenLabels, openai_responder
from sglang_echo.runtime.request import TokenLogprob


def chat_logprobs(labels: TokenLabels, lps: list[TokenLogprob]) -> dict:
    def entry(token_id: int, value: float) -> dict:
        return {"token": labels.text(token_id), "logprob": value, "bytes": labels.raw(token_id)}

    return {
        "content": [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
            for lp in lps
        ]
    }


def chat_content(text: str, streaming: bool, first: bool) -> dict:
    if not streaming:
        return {"message": {"role": "assistant", "content": text}}
    return {"delta": {"role": "assistant", "content": text} if first else {"content": text}}


def chat_shape(labels: TokenLabels) -> OpenAIShape:
    return OpenAIShape(
        obj="chat.completion",
        chunk_obj="chat.completion.chunk",
        content=chat_content,
        logprobs=lambda lps, _offset: chat_logprobs(labels, lps),
    )


def register(app: FastAPI, core: StreamingCore) -> None:
    respond = openai_responder(core, chat_shape(TokenLabels(core.tokenizer)))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await core.handle(
            request, lambda d: protocol.parse_chat(d, core.encoder), respond, "chatcmpl"
        )
