"""The HTTP server under odd and hostile input, on the CPU with ECHO at its smallest legal
cache: nothing a client sends can end another client's request or the server.

Sampling values that used to crash a step (temperature 1e-320, NaN) are normalised or
refused; a live request id is refused; a client that leaves (streaming or not) ends only
its own request; bodies are bounded; invalid Unicode and out-of-range seeds get a 400;
streamed text never shows part of a stop string; logprobs are returned; options that are
not implemented are refused by name; SIGTERM ends running requests and the process.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import aiohttp
import pytest

from server_utils import free_port, min_cache_echo_serving, running_server

MAX_RUNNING = 4
CHUNK = 32
POOL = 600
CONTEXT = 512
BODY_LIMIT = 64 << 10


@pytest.fixture(scope="module")
def server(small_checkpoint):
    serving = min_cache_echo_serving(
        small_checkpoint, MAX_RUNNING, CHUNK, POOL, CONTEXT, max_request_bytes=BODY_LIMIT
    )
    with running_server(serving) as (url, app):
        yield url, app, serving


def _post(url: str, path: str, body, timeout: float = 120) -> tuple[int, dict]:
    async def go():
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with (
            aiohttp.ClientSession() as s,
            s.post(url + path, data=data, timeout=aiohttp.ClientTimeout(total=timeout)) as r,
        ):
            return r.status, await r.json(content_type=None)

    return asyncio.run(go())


def _stream(url: str, path: str, body: dict) -> list[dict]:
    async def go():
        chunks = []
        async with aiohttp.ClientSession() as s, s.post(url + path, json=body) as r:
            assert r.status == 200
            async for raw in r.content:
                line = raw.decode().strip()
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
        return chunks

    return asyncio.run(go())


def _idle_state(app, timeout: float = 30.0) -> dict:
    def read(sched):
        return {
            "running": len(sched.running),
            "waiting": len(sched.waiting),
            "live": len(sched.live),
            "free_tokens": sched.steps.allocator.num_free,
            "aborted": sched.stats.aborted_requests,
        }

    deadline = time.monotonic() + timeout
    while True:
        state = app.state.engine.call(read).result(timeout=30)
        if state["running"] + state["waiting"] == 0 or time.monotonic() > deadline:
            return state
        time.sleep(0.05)


def _greedy_body(ids: list[int], n: int, **sp) -> dict:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "ignore_eos": True, **sp}}


def test_tiny_and_invalid_temperatures(server):
    url, app, _ = server
    ids = list(range(20, 50))
    status, greedy = _post(url, "/generate", _greedy_body(ids, 8, temperature=0.0))
    assert status == 200
    for t in (1e-320, 1e-308, 1e-6):
        status, out = _post(url, "/generate", _greedy_body(ids, 8, temperature=t))
        assert status == 200 and out["output_ids"] == greedy["output_ids"]
    for field, raw in (("temperature", "NaN"), ("top_p", "NaN"), ("temperature", "Infinity")):
        body = b'{"input_ids": [5, 6], "sampling_params": {"%s": %s}}' % (
            field.encode(),
            raw.encode(),
        )
        status, err = _post(url, "/generate", body)
        assert status == 400 and field in err["error"]["message"]
    assert _idle_state(app)["live"] == 0


def test_live_rid_is_refused_and_a_disconnect_ends_only_its_own_request(server):
    url, app, _ = server

    async def go():
        body = {**_greedy_body(list(range(30, 60)), 150), "rid": "shared-id", "stream": True}
        async with aiohttp.ClientSession() as s:
            first = await s.post(url + "/generate", json=body)
            await first.content.readline()  # it is running
            second = await s.post(url + "/generate", json=body)
            status2, err2 = second.status, await second.json()
            text = ""
            async for raw in first.content:
                text = raw.decode().strip() or text
            return status2, err2, text

    status2, err2, last = asyncio.run(go())
    assert status2 == 400 and "still running" in err2["error"]["message"]
    assert last == "data: [DONE]"  # the first request ran to its end
    state = _idle_state(app)
    assert state["live"] == 0 and state["free_tokens"] == POOL


def test_non_streaming_disconnect_aborts_the_request(server):
    url, app, _ = server
    before = _idle_state(app)["aborted"]
    # Hold the engine thread, so the request cannot finish before its client leaves.
    release = threading.Event()
    held = app.state.engine.call(lambda _s: release.wait(30))

    async def leave():
        body = _greedy_body(list(range(40, 70)), 400)
        async with aiohttp.ClientSession() as s:
            with pytest.raises(asyncio.TimeoutError):
                timeout = aiohttp.ClientTimeout(total=0.5)
                await s.post(url + "/generate", json=body, timeout=timeout)
        await asyncio.sleep(1.5)  # the server polls for the disconnect every 0.5 s

    asyncio.run(leave())
    release.set()
    held.result(timeout=30)
    state = _idle_state(app)
    assert state["running"] == 0 and state["live"] == 0
    assert state["aborted"] == before + 1
    assert state["free_tokens"] == POOL


def _send_raw(url: str, path: str, body: dict) -> socket.socket:
    """POST ``body`` on a plain socket, so that the test decides when the client leaves."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)), timeout=30)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
def test_a_client_that_leaves_while_tokens_flow_ends_its_request(server, monkeypatch, stream):
    """The disconnect is checked on a clock, not only after a silence: a non-streaming
    request whose tokens kept coming used to generate to its end after its client left."""
    url, app, _ = server
    engine = app.state.engine
    sched = engine.scheduler
    # At most ~100 steps a second on any machine: the request cannot reach max_new_tokens
    # (>= 4 s) in the time the server takes to notice (a poll every 0.5 s).
    step = sched.step

    def paced_step():
        time.sleep(0.01)
        return step()

    monkeypatch.setattr(sched, "step", paced_step)
    before = _idle_state(app)["aborted"]
    rid, n = f"leaves-{stream}", 400
    body = {**_greedy_body(list(range(40, 70)), n), "rid": rid, "stream": stream}
    sock = _send_raw(url, "/generate", body)
    req = None
    try:
        deadline = time.monotonic() + 60
        while req is None or len(req.output) < 3:  # tokens flow: the engine is not idle
            assert time.monotonic() < deadline, "the request never started generating"
            req = req or engine.call(lambda s: s.live.get(rid)).result(timeout=30)
            time.sleep(0.02)
        if stream:  # the client has seen tokens arrive
            received = b""
            while b"data: {" not in received:
                chunk = sock.recv(1 << 16)
                assert chunk, "the server closed the stream"
                received += chunk
        sock.close()
        left_at = len(req.output)
        deadline = time.monotonic() + 10  # a liveness bound; the server needs < 1 s
        while engine.call(lambda s: rid in s.live).result(timeout=30):
            assert time.monotonic() < deadline, (
                f"still generating 10 s after its client left: {len(req.output)} of {n} tokens"
                f" ({left_at} when it left)"
            )
            time.sleep(0.05)
        assert req.finish_reason["type"] == "abort", req.finish_reason  # not "length"
        assert req.finish_reason["status_code"] == 499
        assert len(req.output) < n // 2, (len(req.output), left_at)
    finally:
        sock.close()
        engine.abort(rid)  # a no-op unless the server failed to end it
        state = _idle_state(app)
    assert state["aborted"] == before + 1
    assert state["live"] == 0 and state["free_tokens"] == POOL


def test_bodies_and_text_are_bounded_and_checked(server):
    url, _, _ = server
    status, err = _post(url, "/generate", {"text": "x" * (BODY_LIMIT + 10)})
    assert status == 413 and "max-request-bytes" in err["error"]["message"]
    # Certainly more tokens than the context holds: refused before tokenising.
    status, err = _post(url, "/generate", {"text": "y" * (BODY_LIMIT // 2)})
    assert status == 400 and "characters" in err["error"]["message"]
    status, err = _post(url, "/generate", b'{"text": "ab\\ud800cd"}')
    assert status == 400 and "surrogate" in err["error"]["message"]
    status, err = _post(
        url, "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}'
    )
    assert status == 400 and "surrogate" in err["error"]["message"]


@pytest.mark.parametrize(("seed", "ok"), [(2**64, False), (-(2**63) - 1, False), (2**64 - 1, True)])
def test_seed_range(server, seed, ok):
    url = server[0]
    status, out = _post(url, "/generate", _greedy_body([5, 6, 7], 4, temperature=1.0, seed=seed))
    if ok:
        assert status == 200 and len(out["output_ids"]) == 4
        assert out["meta_info"]["finish_reason"]["type"] == "length"
    else:
        assert status == 400 and "seed" in out["error"]["message"]


def test_streamed_text_never_shows_part_of_a_stop_string(server):
    url = server[0]
    base = {
        "text": "def main():\n    ",
        "sampling_params": {"max_new_tokens": 40, "temperature": 0},
    }
    base["sampling_params"]["ignore_eos"] = True
    status, free = _post(url, "/generate", base)
    assert status == 200
    text = free["text"]
    assert len(text) >= 12
    stop = text[6:10]
    expected = text[: text.find(stop)]
    body = {**base, "sampling_params": {**base["sampling_params"], "stop": [stop]}}
    status, whole = _post(url, "/generate", body)
    assert status == 200 and whole["text"] == expected
    assert whole["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    chunks = _stream(url, "/generate", {**body, "stream": True})
    assert chunks[-1]["text"] == expected
    assert all(expected.startswith(c["text"]) for c in chunks)  # never more than the answer
    # OpenAI streaming: the deltas add up to the non-streamed text.
    comp = {"prompt": base["text"], "max_tokens": 40, "temperature": 0, "stop": stop}
    comp["ignore_eos"] = True
    pieces = _stream(url, "/v1/completions", {**comp, "stream": True})
    assert "".join(p["choices"][0]["text"] for p in pieces) == expected
    assert pieces[-1]["choices"][0]["finish_reason"] == "stop"


def test_logprobs_on_every_endpoint(server):
    url = server[0]
    status, out = _post(
        url,
        "/v1/completions",
        {"prompt": [5, 6, 7, 8], "max_tokens": 5, "temperature": 0, "logprobs": 3},
    )
    assert status == 200
    lp = out["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == 5
    for chosen, top in zip(lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert len(top) <= 3 and chosen <= 0.0
        assert chosen == pytest.approx(max(top.values()))  # greedy picks the likeliest
    status, chat = _post(
        url,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 2,
        },
    )
    assert status == 200
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == 4 and all(len(c["top_logprobs"]) == 2 for c in content)
    status, native = _post(
        url, "/generate", {**_greedy_body([9, 10, 11], 3, temperature=0), "return_logprob": True}
    )
    assert status == 200
    rows = native["meta_info"]["output_token_logprobs"]
    assert [r[1] for r in rows] == native["output_ids"]


@pytest.mark.parametrize(
    ("path", "extra", "needle"),
    [
        ("/v1/completions", {"echo": True}, "echo"),
        ("/v1/completions", {"frequency_penalty": 0.5}, "frequency_penalty"),
        ("/v1/completions", {"presence_penalty": -1}, "presence_penalty"),
        ("/v1/completions", {"logit_bias": {"5": 10}}, "logit_bias"),
        ("/v1/completions", {"best_of": 3}, "best_of"),
        ("/v1/completions", {"logprobs": 50}, "logprobs"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "logprobs: true"),
        ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_unsupported_options_are_refused_by_name(server, path, extra, needle):
    url = server[0]
    body = (
        {"prompt": "hi"}
        if path == "/v1/completions"
        else {"messages": [{"role": "user", "content": "hi"}]}
    )
    status, err = _post(url, path, {**body, "max_tokens": 2, **extra})
    assert status == 400 and needle in err["error"]["message"]


def test_finish_reasons_follow_openai(server):
    # ignore_eos: with the default sampling an EOS could end it first (seen once in CI).
    url = server[0]
    body = {"prompt": [5, 6], "max_tokens": 3, "ignore_eos": True}
    status, out = _post(url, "/v1/completions", body)
    assert status == 200 and out["choices"][0]["finish_reason"] == "length"


def test_sigterm_ends_running_requests_and_the_process(small_checkpoint, tmp_path):
    port = free_port()
    env = {
        **os.environ,
        "NSA_KV_OFFLOAD": "1",
        "NSA_DEV_CACHE_SIZE": "256",
        "PYTHONUNBUFFERED": "1",
    }
    cmd = [
        sys.executable, "-m", "sglang_echo.launch_server", "--model-path", str(small_checkpoint),
        "--port", str(port), "--device", "cpu", "--dtype", "float32", "--max-total-tokens", "4000",
        "--context-length", "2048", "--skip-server-warmup",
    ]  # fmt: skip
    log = open(tmp_path / "server.log", "w+")  # noqa: SIM115 - read after the process ends
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while "ready to roll" not in (tmp_path / "server.log").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
            time.sleep(0.2)
        # The start-up log: every environment variable's value in force (config.py).
        started = (tmp_path / "server.log").read_text()
        assert "settings in force" in started and "NSA_KV_OFFLOAD=1*" in started
        assert "NSA_DEV_CACHE_SIZE=256*" in started and "SGLANG_ECHO_PDL=1 " in started

        async def stream_then_term():
            body = {**_greedy_body(list(range(5, 25)), 1500), "stream": True}
            lines = []
            async with aiohttp.ClientSession() as s, s.post(url + "/generate", json=body) as r:
                async for raw in r.content:
                    line = raw.decode().strip()
                    if line:
                        lines.append(line)
                    if len(lines) == 2:
                        proc.send_signal(signal.SIGTERM)
            return lines

        lines = asyncio.run(stream_then_term())
        # uvicorn re-raises the signal once it has shut down: the exit says SIGTERM.
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
        assert "Finished server process" in (tmp_path / "server.log").read_text()
        assert lines[-1] == "data: [DONE]"
        last = json.loads(lines[-2][6:])
        assert last["meta_info"]["finish_reason"]["type"] == "abort"
        assert "shutting down" in last["meta_info"]["finish_reason"]["message"]
        assert last["meta_info"]["finish_reason"]["status_code"] == 503
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()


def test_reusing_a_finished_rid_at_once_is_safe(server):
    """A stream's late cleanup (Starlette's background task after the response) must not
    abort a newer request that took the same rid the moment the first one ended."""
    url, app, _ = server

    async def go():
        ends = []
        async with aiohttp.ClientSession() as s:
            for _ in range(6):
                body = {**_greedy_body([7, 8, 9], 6), "rid": "reused", "stream": True}
                last = None
                async with s.post(url + "/generate", json=body) as r:
                    assert r.status == 200, await r.text()
                    async for raw in r.content:
                        line = raw.decode().strip()
                        if line.startswith("data: {"):
                            last = json.loads(line[6:])
                ends.append(last["meta_info"]["finish_reason"]["type"])
        return ends

    assert asyncio.run(go()) == ["length"] * 6
    assert _idle_state(app)["live"] == 0


def _body_with(path: str, field: str, raw: bytes) -> bytes:
    """A valid request for ``path`` with ``field`` set to the raw JSON text ``raw``: the
    value goes where each route reads its sampling options."""
    if path == "/generate":
        return b'{"input_ids": [5, 6], "sampling_params": {"%s": %s}}' % (field.encode(), raw)
    chat = b'"messages": [{"role": "user", "content": "hi"}]'
    head = b'"prompt": [5, 6]' if path == "/v1/completions" else chat
    return b'{%s, "%s": %s}' % (head, field.encode(), raw)


ROUTES = ["/generate", "/v1/completions", "/v1/chat/completions"]


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (b"9" * 5000, "4300 digits"),  # int() refuses it: ValueError, was HTTP 500
        # RecursionError in the parser, was HTTP 500 (100K levels: test_protocol_json.py;
        # this server takes 64 KiB bodies).
        (b"[" * 30_000 + b"]" * 30_000, "nested too deeply"),
        # Parses, but near the recursion limit: a few frames deeper, repr() of it in an
        # error message raised RecursionError (HTTP 500).
        (b"[" * 900 + b"]" * 900, "nested too deeply"),
    ],
    ids=["5000-digit-int", "30000-levels", "900-levels"],
)
def test_unreadable_bodies_get_400_not_500(server, path, raw, needle):
    url = server[0]
    status, err = _post(url, path, _body_with(path, "top_k", raw))
    message = err["error"]["message"]
    assert status == 400, message
    assert needle in message and "Traceback" not in message


@pytest.mark.parametrize(
    ("path", "field"),
    [
        ("/generate", "max_new_tokens"),
        ("/v1/completions", "max_tokens"),
        ("/v1/chat/completions", "max_completion_tokens"),
    ],
)
def test_a_huge_but_valid_max_tokens_gets_400(server, path, field):
    """4300 nines parse; prompt + max tokens then has 4301 digits, which str() refused
    while the 'exceeds the limit' message was built (HTTP 500)."""
    url = server[0]
    status, err = _post(url, path, _body_with(path, field, b"9" * 4300))
    message = err["error"]["message"]
    assert status == 400, message
    assert field in message and len(message) < 300  # not the whole number echoed back


def test_bodies_are_parsed_one_at_a_time_on_one_thread(server, monkeypatch):
    """Many large bodies at once: parsed on one thread, never two at a time (on a pool,
    dozens parsed together under one GIL and none reached the engine early)."""
    from sglang_echo.runtime.api.core import StreamingCore

    url = server[0]
    seen: list[tuple[int, float, float]] = []
    real = StreamingCore.parse_and_check

    def parse_and_check(self, parse, body):
        start = time.perf_counter()
        try:
            return real(self, parse, body)
        finally:
            seen.append((threading.get_ident(), start, time.perf_counter()))

    monkeypatch.setattr(StreamingCore, "parse_and_check", parse_and_check)
    body = {"input_ids": list(range(1, 200)), "sampling_params": {"max_new_tokens": 1}}

    async def main() -> list[int]:
        async with aiohttp.ClientSession() as s:

            async def one() -> int:
                async with s.post(url + "/generate", json=body) as r:
                    await r.read()
                    return r.status

            return await asyncio.gather(*(one() for _ in range(8)))

    assert asyncio.run(main()) == [200] * 8
    assert len(seen) == 8 and len({t for t, _, _ in seen}) == 1
    spans = sorted((a, b) for _, a, b in seen)
    assert all(prev_end <= start for (_, prev_end), (start, _) in itertools.pairwise(spans))
