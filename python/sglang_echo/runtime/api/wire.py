"""What every endpoint writes on the wire: SSE frames and the JSON error shape."""

from __future__ import annotations

import json
import logging

from fastapi import Request
from fastapi.responses import JSONResponse

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
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


async def internal_error(_request: Request, exc: Exception) -> JSONResponse:
    """Never a plain-text 500: clients (the openai SDK) parse the error body."""
    log.exception("unhandled error in a request handler")
    return error_response(f"internal error: {type(exc).__name__}: {exc}", 500)
