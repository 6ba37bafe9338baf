"""``python -m sglang_echo.launch_server --model-path DIR [--port 30000] ...``

Serves one DeepSeek-V3.2 checkpoint on one device with continuous batching; flags as in
SGLang where they overlap (``--help``). ``NSA_KV_OFFLOAD=1`` turns ECHO on. Prints SGLang's
"The server is fired up and ready to roll!" once it accepts requests, so scripts written
for SGLang can wait for it the same way.

fastapi and uvicorn are imported only here and in ``runtime/server.py``: on a machine
without them installed, unpack their wheels into a folder and put it on PYTHONPATH.
"""

from __future__ import annotations

import logging
import sys
import threading
import time

READY_LINE = "The server is fired up and ready to roll!"
SHUTDOWN_GRACE_S = 10


def _draining_server_class(uvicorn):
    class DrainingServer(uvicorn.Server):
        """On SIGTERM/SIGINT, end the running requests first (their clients get an abort
        with the reason), so uvicorn's graceful shutdown does not wait for every open
        stream to generate its last token."""

        def __init__(self, config, engine) -> None:
            super().__init__(config)
            self.engine = engine

        def handle_exit(self, sig, frame) -> None:
            self.engine.drain("server shutting down")
            super().handle_exit(sig, frame)

    return DrainingServer


def _import_web():
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError as exc:
        raise SystemExit(
            f"error: the HTTP server needs fastapi and uvicorn ({exc}); pip install fastapi "
            "uvicorn, or unpack their wheels into a folder on PYTHONPATH (docs/USAGE.md)"
        ) from exc
    return uvicorn


def warmup_bodies(info: dict) -> list[dict]:
    """The start-up warm-up's ``/generate`` bodies: one short request through the whole
    stack (as SGLang sends), and on an ECHO server that prefills, one prompt long enough
    that its prefill's append takes the multi-launch allocation (more new tokens than one
    program serves, kernels/alloc_common.py). Why: a single short prompt never reaches
    that path, so its kernels compiled at the first batched prefill of a run, stalling
    every request for seconds (a benchmark of short chats at rate inf showed it)."""
    from sglang_echo.kernels.alloc_common import ONE_PROGRAM_LANES

    bodies = [{"input_ids": [3, 4, 5, 6, 7, 8, 9, 10], "sampling_params": {"max_new_tokens": 4}}]
    prefills = info.get("disaggregation_mode") in (None, "null")
    if info.get("kv_backend") == "echo" and prefills:
        room = min(
            info.get("chunked_prefill_size") or 0,
            (info.get("context_length") or 0) - 2,
            (info.get("max_total_tokens") or 0) - 2,
        )
        if room > ONE_PROGRAM_LANES:
            ids = [3 + i % 200 for i in range(ONE_PROGRAM_LANES + 1)]
            bodies.append({"input_ids": ids, "sampling_params": {"max_new_tokens": 1}})
    return bodies


def _warmup(host: str, port: int, info: dict) -> None:
    """The warm-up requests (``warmup_bodies``) before announcing readiness, so first-use
    costs such as kernel compilation do not land on the first clients."""
    import json
    import urllib.request

    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    for body in warmup_bodies(info):
        req = urllib.request.Request(
            f"http://{host}:{port}/generate",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            urllib.request.urlopen(req, timeout=600).read()
        except OSError as exc:
            print(f"warning: warmup request failed: {exc}", file=sys.stderr, flush=True)
            return


def main(argv: list[str] | None = None) -> int:
    from sglang_echo.config import ConfigError, settings
    from sglang_echo.model.config import ModelConfigError
    from sglang_echo.runtime.server_args import ServerArgError, parse_server_args

    try:
        args = parse_server_args(argv)
    except ServerArgError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    uvicorn = _import_web()
    server_class = _draining_server_class(uvicorn)
    logging.basicConfig(
        level=args.log_level.upper(), format="[%(asctime)s] %(name)s %(levelname)s %(message)s"
    )
    from sglang_echo.runtime.host_threads import limit_host_threads
    from sglang_echo.runtime.server import create_app
    from sglang_echo.runtime.serving import build_serving

    engine = None
    if args.engine_process:
        # The model, caches and scheduler in a process of their own (engine_process.py);
        # this process keeps HTTP, validation, tokenization and the streams.
        from sglang_echo.runtime.engine_process import EngineProcessClient, FrontServing
        from sglang_echo.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(args.model_path)
        detok = (lambda ids: tokenizer.decode(ids)) if tokenizer is not None else None
        engine = EngineProcessClient(args, args.log_level, detok)
        try:
            info = engine.launch()
        except RuntimeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        serving = FrontServing(args, info, tokenizer)
    else:
        try:
            serving = build_serving(args)
        except (ServerArgError, ConfigError, ModelConfigError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        limit_host_threads(serving.scheduler.steps.device)  # runtime/host_threads.py
    i = serving.info
    print(
        f"sglang-echo: {i['kv_backend']} on {i['device']} ({i['dtype']}, KV "
        f"{i['kv_cache_dtype']}), KV pool "
        f"{i['max_total_tokens']} tokens, max running {i['max_running_requests']}, chunk "
        f"{i['chunked_prefill_size']}, context {i['context_length']}, "
        + ("overlap schedule" if i.get("overlap_schedule") else "synchronous schedule")
        + (f", NSA_DEV_CACHE_SIZE {i['nsa_dev_cache_size']}" if i["nsa_dev_cache_size"] else "")
        + (f", device_buffer_size {i['device_buffer_size']}" if i["device_buffer_size"] else "")
        + (f", model from --model-loader {i['model_loader']}" if i["model_loader"] else "")
        + (
            f"; PD decode node, fake transfer (locality {i['locality_source']})"
            if i["disaggregation_mode"] == "decode"
            else ""
        ),
        file=sys.stderr,
        flush=True,
    )
    # Every environment variable's value as build_serving parsed it (config.py's registry).
    print(f"sglang-echo: {settings().summary()}", file=sys.stderr, flush=True)
    if engine is not None:
        print(f"sglang-echo: engine process pid {engine.pid}", file=sys.stderr, flush=True)
    app = create_app(serving, engine)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
    )
    server = server_class(config, app.state.engine)

    def announce() -> None:
        while not server.started and not server.should_exit:
            time.sleep(0.05)
        if not server.started:
            return
        if not args.skip_server_warmup:
            _warmup(args.host, args.port, serving.info)
        print(READY_LINE, file=sys.stderr, flush=True)

    threading.Thread(target=announce, daemon=True).start()
    server.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
