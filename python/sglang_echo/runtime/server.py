"""HTTP front end: SGLang's native ``/generate``, OpenAI's ``/v1/completions`` and
``/v1/chat/completions`` (streaming too), ``/health``, ``/get_model_info``,
``/get_server_info``, ``/v1/models`` and Prometheus ``/metrics``.

``create_app`` only wires the parts under ``runtime/api/`` together: one streaming core
(``api.core``: submission to the engine thread, event streams, live request ids,
disconnects, release) and one adapter per protocol over it (``api.native``,
``api.completions``, ``api.chat``), plus the info, health and metrics endpoints
(``api.info``). The names below stay importable from here for older callers.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from sglang_echo.runtime.api import chat, completions, info, native
from sglang_echo.runtime.api.core import (
    DEFAULT_MAX_REQUEST_BYTES,
    DISCONNECT_POLL_S,
    EventMailbox,
    EventStream,
    OutputSoFar,
    StreamingCore,
)
from sglang_echo.runtime.api.openai_common import abort_status, openai_finish
from sglang_echo.runtime.api.wire import SSE_HEADERS, error_response, internal_error, sse
from sglang_echo.runtime.engine_loop import EngineLoop
from sglang_echo.runtime.serving import Serving

__all__ = [
    "DEFAULT_MAX_REQUEST_BYTES",
    "DISCONNECT_POLL_S",
    "SSE_HEADERS",
    "EventMailbox",
    "EventStream",
    "OutputSoFar",
    "abort_status",
    "create_app",
    "error_response",
    "openai_finish",
    "sse",
]


def create_app(serving: Serving, engine: EngineLoop | None = None) -> FastAPI:
    """The server's app: the engine thread runs while the app does (its lifespan)."""
    engine = engine or EngineLoop(serving.scheduler)
    core = StreamingCore(serving, engine)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.stop()
            core.close()

    app = FastAPI(title="sglang-echo", lifespan=lifespan)
    app.state.engine = engine
    app.state.serving = serving
    app.state.live_rids = core.live
    app.add_exception_handler(Exception, internal_error)
    for adapter in (native, completions, chat, info):  # the order the routes were added in
        adapter.register(app, core)
    return app
