"""Run the HTTP server in-process for a test: 127.0.0.1, a free port, always shut down."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from sglang_echo.config import EchoConfig
from sglang_echo.runtime.server_args import ServerArgs
from sglang_echo.runtime.serving import Serving, build_serving


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_serving(model_path, echo: EchoConfig, **flags) -> Serving:
    args = ServerArgs(model_path=str(model_path), device="cpu", dtype="float32", **flags)
    return build_serving(args, echo=echo)


def legal_min_cache(model_path, max_running: int, chunk: int) -> int:
    """ECHO's smallest legal NSA_DEV_CACHE_SIZE for the checkpoint (one step's selections)."""
    topk = json.loads((Path(model_path) / "config.json").read_text())["index_topk"]
    return EchoConfig(offload=True).min_dev_cache_size(max_running, topk, chunk)


def min_cache_echo_serving(
    model_path, max_running: int, chunk: int, pool: int, context: int, **flags
) -> Serving:
    """A server with ECHO at its smallest legal device cache: every layer evicts."""
    n_g = legal_min_cache(model_path, max_running, chunk)
    return make_serving(
        model_path,
        EchoConfig(offload=True, dev_cache_size=n_g),
        max_total_tokens=pool,
        max_running_requests=max_running,
        chunked_prefill_size=chunk,
        context_length=context,
        **flags,
    )


@contextlib.contextmanager
def running_server(serving: Serving, engine=None) -> Iterator[tuple[str, object]]:
    """Yields (base URL, app); the server and its engine (thread, or ``engine``: an engine
    process client) stop on exit."""
    import uvicorn

    from sglang_echo.runtime.server import create_app

    app = create_app(serving, engine)
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("test server did not start")
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(30)
