"""One streamed request against SGLang's native ``/generate`` and the per-request timings.

The protocol is SGLang's: SSE ``data: {...}`` lines whose ``meta_info.completion_tokens``
counts the tokens so far (several may arrive in one line), ending with ``data: [DONE]``.
So it works against this project's server and a real SGLang server alike.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import aiohttp

from sglang_echo.bench.datasets import BenchRequest


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0  # seconds to the first token
    latency: float = 0.0  # seconds to the last
    itl: list[float] = field(default_factory=list)  # per token after the first
    error: str = ""
    # The token ids of the last frame (cumulative on this project's server), if it sent any.
    output_ids: list[int] | None = None


def generate_payload(req: BenchRequest, ignore_eos: bool) -> dict:
    key = "input_ids" if isinstance(req.prompt, list) else "text"
    return {
        key: req.prompt,
        "sampling_params": {
            "temperature": 0.0,
            "max_new_tokens": req.output_len,
            "ignore_eos": ignore_eos,
        },
        "stream": True,
    }


def encode_payload(req: BenchRequest, ignore_eos: bool) -> bytes:
    """The request's JSON body. Why bytes made ahead: a long prompt's ``input_ids`` body
    takes milliseconds to encode, and one client encoding hundreds of them on its event loop
    during the run slowed the prompts' way to the engine (the ``received`` counts in the
    counter series of benchmark/results/served_vs_study_318/); real clients encode their
    own bodies."""
    return json.dumps(generate_payload(req, ignore_eos)).encode()


JSON_HEADERS = {"Content-Type": "application/json"}


async def send_generate(
    session: aiohttp.ClientSession,
    url: str,
    req: BenchRequest,
    ignore_eos: bool = True,
    body: bytes | None = None,
) -> RequestResult:
    """One streamed request; ``body``: its payload already encoded (``encode_payload``)."""
    out = RequestResult(prompt_len=req.prompt_len)
    if body is None:
        body = encode_payload(req, ignore_eos)
    start = time.perf_counter()
    last_t = start
    seen = 0
    try:
        async with session.post(url, data=body, headers=JSON_HEADERS) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:500]}"
                return out
            async for raw in resp.content:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                payload = line[len("data:") :].strip()
                if payload == "[DONE]":
                    continue
                data = json.loads(payload)
                if isinstance(data.get("output_ids"), list):
                    out.output_ids = data["output_ids"]
                meta = data.get("meta_info", {})
                count = int(meta.get("completion_tokens", seen))
                now = time.perf_counter()
                if count > seen:
                    if seen == 0:
                        out.ttft = now - start
                    else:
                        out.itl.extend([(now - last_t) / (count - seen)] * (count - seen))
                    last_t = now
                    seen = count
                if meta.get("prompt_tokens"):
                    out.prompt_len = int(meta["prompt_tokens"])
                reason = meta.get("finish_reason")
                if isinstance(reason, dict) and reason.get("type") == "abort":
                    out.error = f"aborted: {reason.get('message', '')}"
                    return out
        out.latency = time.perf_counter() - start
        out.output_len = seen
        out.success = seen > 0
        if not out.success:
            out.error = "no tokens received"
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    return out
