"""The small endpoints around generation: ``/v1/models``, ``/health``,
``/get_model_info``, ``/get_server_info``, ``/flush_cache``, ``/abort_request`` and
Prometheus ``/metrics``. Engine state is read on the engine thread (``EngineLoop.call``)."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from sglang_echo.runtime import metrics, protocol
from sglang_echo.runtime.api.core import StreamingCore
from sglang_echo.runtime.api.wire import error_response
from sglang_echo.runtime.protocol import BadRequest


def register(app: FastAPI, core: StreamingCore) -> None:
    engine, serving, info = core.engine, core.serving, core.info

    async def snapshot() -> dict:
        return await asyncio.wrap_future(engine.snapshot())

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": core.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "sglang-echo",
                    "root": info["model_path"],
                    "max_model_len": info["context_length"],
                }
            ],
        }

    @app.get("/health")
    @app.get("/health_generate")
    async def health():
        if not engine.alive:
            why = f": {engine.fatal_error}" if engine.fatal_error else ""
            return PlainTextResponse(f"engine thread stopped{why}", status_code=503)
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def get_model_info():
        return info

    @app.get("/get_server_info")
    async def get_server_info():
        snap = await snapshot()
        state = {k: v for k, v in snap.items() if k != "echo"}
        return {**vars(serving.args), **info, "internal_states": [state]}

    @app.post("/flush_cache")
    @app.get("/flush_cache")
    async def flush_cache():
        return PlainTextResponse("Cache flushed (this runtime keeps no prefix cache).")

    @app.post("/abort_request")
    async def abort_request(request: Request):
        try:
            body = protocol.parse_json(await core.read_body(request))
        except BadRequest as exc:
            return error_response(str(exc), exc.status)
        rid = body.get("rid")
        if not isinstance(rid, str):
            return error_response("rid (a string) is required")
        engine.abort(rid)
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(
            metrics.render(await snapshot(), core.model_name),
            media_type="text/plain; version=0.0.4",
        )
