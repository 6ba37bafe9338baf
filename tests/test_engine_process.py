"""The engine in a process of its own behind the HTTP front (``--engine-process``,
runtime/engine_process.py), on the CPU: the same tokens as the in-process server; an abort
by request id ends its request; the engine's start-up failure is reported with its reason;
a ``kill -9`` of the engine process is seen: in-flight requests end with 503 and the
reason, /health answers 503, new requests are refused; stopping reaps the process."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import signal
import time

import aiohttp
import pytest

from server_utils import make_serving, running_server
from sglang_echo.config import EchoConfig
from sglang_echo.runtime.engine_process import EngineProcessClient, FrontServing
from sglang_echo.runtime.server_args import ServerArgs
from sglang_echo.tokenizer import load_tokenizer

pytest.importorskip("zmq")

FLAGS = dict(max_total_tokens=3000, max_running_requests=4, context_length=256)


def _args(path, **extra) -> ServerArgs:
    return ServerArgs(model_path=str(path), device="cpu", dtype="float32", **FLAGS, **extra)


def _prompts() -> list[list[int]]:
    rng = random.Random(4)
    return [[rng.randrange(3, 259) for _ in range(rng.randint(5, 60))] for _ in range(6)]


def _generate_all(url: str, prompts, new: int = 8) -> list[list[int]]:
    async def one(s, ids):
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": new, "temperature": 0,
                                                      "ignore_eos": True}}  # fmt: skip
        async with s.post(url + "/generate", json=body) as r:
            assert r.status == 200, await r.text()
            return (await r.json())["output_ids"]

    async def go():
        async with aiohttp.ClientSession() as s:
            return await asyncio.gather(*(one(s, p) for p in prompts))

    return asyncio.run(go())


@pytest.fixture
def engine_client(small_checkpoint):
    tokenizer = load_tokenizer(str(small_checkpoint))
    client = EngineProcessClient(_args(small_checkpoint), "warning", tokenizer.decode)
    info = client.launch(timeout_s=300)
    serving = FrontServing(_args(small_checkpoint), info, tokenizer)
    yield client, serving
    client.stop()


def _texts(url: str, bodies: list[dict]) -> list[tuple]:
    """(text, output ids, finish reason) of each body, non-streamed, and the streamed
    frames' texts."""

    async def one(s, body):
        async with s.post(url + "/generate", json=body) as r:
            whole = await r.json()
        frames = []
        async with s.post(url + "/generate", json={**body, "stream": True}) as r:
            async for raw in r.content:
                line = raw.decode().strip()
                if line.startswith("data:") and line != "data: [DONE]":
                    frames.append(json.loads(line[5:])["text"])
        return whole["text"], whole["output_ids"], whole["meta_info"]["finish_reason"], frames

    async def go():
        async with aiohttp.ClientSession() as s:
            return [await one(s, b) for b in bodies]

    return asyncio.run(go())


def test_text_and_stop_strings_decoded_in_the_front(small_checkpoint, engine_client):
    """The engine sends token ids; the front decodes the text (with the same stop strings,
    which the engine decides): the same texts, ids and finish reasons as the in-process
    server, and streamed frames that never show more than the answer."""
    client, serving = engine_client
    base = {"text": "def main():\n    ", "sampling_params": {"max_new_tokens": 40,
                                                            "temperature": 0, "ignore_eos": True}}  # fmt: skip
    in_process = make_serving(small_checkpoint, EchoConfig(offload=False), **FLAGS)
    with running_server(in_process) as (url, _app):
        ((free_text, *_),) = _texts(url, [base])
        assert len(free_text) >= 12
        stop = free_text[6:10]
        bodies = [base, {**base, "sampling_params": {**base["sampling_params"], "stop": [stop]}}]
        expected = _texts(url, bodies)
    with running_server(serving, client) as (url, _app):
        got = _texts(url, bodies)
    # Text, ids and finish reasons equal; the streamed frames may group tokens otherwise
    # (events travel in batches), but each is a prefix of the answer and the last is it.
    assert [g[:3] for g in got] == [e[:3] for e in expected]
    for text, _ids, _reason, frames in got:
        assert frames[-1] == text and all(text.startswith(f) for f in frames)
        assert all(a == b[: len(a)] for a, b in itertools.pairwise(frames))
    assert expected[1][2] == {"type": "stop", "matched": stop}
    assert expected[1][0] == free_text[: free_text.find(stop)]


def test_engine_process_serves_the_same_tokens(small_checkpoint, engine_client):
    client, serving = engine_client
    prompts = _prompts()
    in_process = make_serving(small_checkpoint, EchoConfig(offload=False), **FLAGS)
    with running_server(in_process) as (url, _app):
        expected = _generate_all(url, prompts)
    with running_server(serving, client) as (url, _app):
        got = _generate_all(url, prompts)

        async def metrics():
            async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
                return r.status, await r.text()

        status, text = asyncio.run(metrics())
    assert got == expected
    assert status == 200 and "sglang:generation_tokens_total" in text
    assert client.pid is not None


def test_abort_by_rid_reaches_the_engine(engine_client):
    client, serving = engine_client

    async def go(url):
        # The abort goes out once the first token is seen (not after a fixed sleep, which
        # a fast engine outran: 200 tokens of the tiny model take well under a second).
        async with aiohttp.ClientSession() as s:
            body = {"input_ids": [5] * 20, "rid": "long-one", "stream": True,
                    "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}  # fmt: skip
            chunks = []
            async with s.post(url + "/generate", json=body) as stream:
                async for raw in stream.content:
                    if not raw.startswith(b"data: {"):
                        continue
                    chunks.append(json.loads(raw[6:]))
                    if len(chunks) == 1:
                        async with s.post(url + "/abort_request", json={"rid": "long-one"}) as r:
                            assert r.status == 200
            return chunks[-1]

    with running_server(serving, client) as (url, _app):
        out = asyncio.run(go(url))
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and len(out["output_ids"]) < 200


def test_killed_engine_is_seen_and_reported(engine_client):
    client, serving = engine_client

    async def go(url):
        async with aiohttp.ClientSession() as s:
            body = {"input_ids": [7] * 30, "stream": True,
                    "sampling_params": {"max_new_tokens": 10_000 // 50, "ignore_eos": True}}  # fmt: skip
            frames = []
            async with s.post(url + "/generate", json=body) as r:
                async for raw in r.content:
                    line = raw.decode().strip()
                    if line.startswith("data:") and line != "data: [DONE]":
                        frames.append(json.loads(line[5:]))
                        if len(frames) == 2:
                            os.kill(client.pid, signal.SIGKILL)  # mid-stream
            for _ in range(50):
                async with s.get(url + "/health") as r:
                    health = (r.status, await r.text())
                if health[0] == 503:
                    break
                await asyncio.sleep(0.1)
            async with s.post(url + "/generate", json={"input_ids": [5, 6]}) as r:
                later = (r.status, await r.text())
        return frames, health, later

    with running_server(serving, client) as (url, _app):
        frames, health, later = asyncio.run(go(url))
    last = frames[-1]["meta_info"]["finish_reason"]
    assert last["type"] == "abort" and last["status_code"] == 503
    assert "engine process exited" in last["message"]
    assert health[0] == 503 and "engine process exited" in health[1]
    assert later[0] == 503 and "engine process exited" in later[1]
    client.stop()
    assert client._proc.exitcode is not None  # reaped: no zombie


def test_engine_start_up_failure_says_why(tmp_path):
    client = EngineProcessClient(_args(tmp_path / "no-such-model"), "warning")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        client.launch(timeout_s=120)
    assert "no-such-model" in str(err.value) or "config.json" in str(err.value)
    assert time.monotonic() - t0 < 120
    client.stop()


def _snapshot(client) -> dict:
    return client.snapshot().result(timeout=30)


def test_a_client_that_leaves_aborts_its_request_in_the_engine(engine_client):
    """A streaming client that disconnects mid-stream ends its request in the engine
    process (its abort crosses the socket), which is then idle with everything free."""
    client, serving = engine_client

    async def go(url):
        body = {"input_ids": [9] * 30, "stream": True, "rid": "leaves",
                "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}  # fmt: skip
        async with aiohttp.ClientSession() as s, s.post(url + "/generate", json=body) as r:
            seen = 0
            async for raw in r.content:
                if raw.startswith(b"data: {"):
                    seen += 1
                    if seen == 3:
                        break  # leave: the session closes the connection

    with running_server(serving, client) as (url, _app):
        before = _snapshot(client)["num_aborted_requests_total"]
        asyncio.run(go(url))
        deadline = time.monotonic() + 20
        while (snap := _snapshot(client))["num_running_reqs"] or snap["num_queue_reqs"]:
            assert time.monotonic() < deadline, "the request kept running after its client left"
            time.sleep(0.1)
    assert snap["num_aborted_requests_total"] == before + 1
    assert snap["generation_tokens_total"] < 200
    assert snap["token_usage"] == 0.0


def test_snapshots_while_tokens_stream_all_come_back(engine_client):
    """The engine process answers a snapshot from the engine thread while its sender
    thread streams output events: every answer and every event must arrive, whole (one
    thread writes the outbound socket; a ZeroMQ socket is not thread-safe, and two writers
    lost a snapshot's answer under load)."""
    client, serving = engine_client

    async def stream(url, rid):
        body = {"input_ids": [7] * 12, "stream": True, "rid": rid,
                "sampling_params": {"max_new_tokens": 120, "ignore_eos": True}}  # fmt: skip
        async with aiohttp.ClientSession() as s, s.post(url + "/generate", json=body) as r:
            return [json.loads(raw[6:]) async for raw in r.content if raw.startswith(b"data: {")]

    async def go(url):
        streams = [asyncio.create_task(stream(url, f"s{i}")) for i in range(3)]
        answers = 0
        while not all(t.done() for t in streams):
            futs = [client.snapshot() for _ in range(20)]
            for fut in futs:
                snap = await asyncio.wrap_future(fut)
                answers += "num_running_reqs" in snap
            await asyncio.sleep(0)
        return answers, [await t for t in streams]

    with running_server(serving, client) as (url, _app):
        answers, outs = asyncio.run(asyncio.wait_for(go(url), timeout=120))
    assert answers >= 20
    for chunks in outs:
        assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
        assert len(chunks[-1]["output_ids"]) == 120


def test_a_new_engine_starts_after_one_was_killed(small_checkpoint, engine_client):
    """After ``kill -9`` and a stop, nothing is left behind (process reaped, sockets gone)
    and a new engine process starts and serves."""
    client, _serving = engine_client
    os.kill(client.pid, signal.SIGKILL)
    client.stop()
    assert client._proc.exitcode == -signal.SIGKILL
    assert not os.path.exists(client._dir)  # its ipc sockets
    tokenizer = load_tokenizer(str(small_checkpoint))
    again = EngineProcessClient(_args(small_checkpoint), "warning", tokenizer.decode)
    try:
        info = again.launch(timeout_s=300)
        with running_server(FrontServing(_args(small_checkpoint), info, tokenizer), again) as (
            url,
            _app,
        ):
            assert _generate_all(url, _prompts()[:2], new=4) and again.alive
    finally:
        again.stop()
    assert again._proc.exitcode is not None


def test_the_engine_dies_with_its_front(small_checkpoint, tmp_path):
    """A front killed with SIGKILL leaves no engine process behind (holding the GPU)."""
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "front.py"
    script.write_text(
        textwrap.dedent(f"""
        import time
        from sglang_echo.runtime.engine_process import EngineProcessClient
        from sglang_echo.runtime.server_args import ServerArgs
        if __name__ == "__main__":  # the spawned engine imports this file too
            args = ServerArgs(model_path={str(small_checkpoint)!r}, device="cpu",
                              dtype="float32", max_total_tokens=3000,
                              max_running_requests=4, context_length=256)
            client = EngineProcessClient(args, "warning")
            client.launch(timeout_s=300)
            print(client.pid, flush=True)
            time.sleep(600)
    """)
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    front = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, env=env, text=True
    )
    try:
        engine_pid = int(front.stdout.readline())
        front.kill()
        front.wait(30)
        deadline = time.monotonic() + 20
        while _alive(engine_pid):
            assert time.monotonic() < deadline, "the engine outlived its front"
            time.sleep(0.1)
    finally:
        front.kill()


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by init, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
