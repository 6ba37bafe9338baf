"""The HTTP server on a tiny checkpoint, on the CPU: ECHO at its smallest legal device
cache under 32 concurrent streamed requests gives exactly offline generate's tokens;
aborts return every slot; bad requests get a 400 that says why; /metrics parses; the
official openai client works against /v1."""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path

import aiohttp
import pytest

from server_utils import make_serving, running_server
from sglang_echo.config import EchoConfig
from sglang_echo.generate import main as generate_main
from sglang_echo.runtime.scheduler_stats import ENGINE_PHASES

N_REQUESTS = 32
NEW_TOKENS = 24  # long enough that the running requests overflow the device cache: ECHO evicts
MAX_RUNNING = 32
CHUNK = 32
POOL = 1200  # smaller than the 32 requests' total: some of them queue
CONTEXT = 1024


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 259) for _ in range(rng.randint(5, 60))] for _ in range(N_REQUESTS)]


@pytest.fixture(scope="module")
def echo_server(small_checkpoint):
    topk = json.loads((Path(small_checkpoint) / "config.json").read_text())["index_topk"]
    echo = EchoConfig(offload=True, dev_cache_size=1)
    legal_min = echo.min_dev_cache_size(MAX_RUNNING, topk, CHUNK)
    serving = make_serving(
        small_checkpoint,
        EchoConfig(offload=True, dev_cache_size=legal_min),
        max_total_tokens=POOL,
        max_running_requests=MAX_RUNNING,
        chunked_prefill_size=CHUNK,
        context_length=CONTEXT,
    )
    with running_server(serving) as (url, app):
        yield url, app, serving, legal_min


def _engine_state(app, serving) -> dict:
    """Read the scheduler and ECHO's free lists on the engine thread, between steps."""

    def read(sched):
        cache = serving.kv_cache.cache
        return {
            "running": len(sched.running),
            "waiting": len(sched.waiting),
            "free_tokens": sched.steps.allocator.num_free,
            "free_rows": sched.steps.table.num_free_rows,
            "free_slots": cache.free_count.tolist(),
            "live": len(sched.live),
        }

    return app.state.engine.call(read).result(timeout=30)


def _wait_idle(app, serving, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        state = _engine_state(app, serving)
        if (state["running"] == 0 and state["waiting"] == 0) or time.monotonic() > deadline:
            return state
        time.sleep(0.05)


def _assert_all_free(state: dict, serving, legal_min: int) -> None:
    layers = serving.info["num_layers"]
    assert state["free_tokens"] == POOL  # every host row back
    assert state["free_rows"] == MAX_RUNNING
    assert state["live"] == 0
    assert state["free_slots"] == [legal_min] * layers  # every device slot back


async def _stream_generate(session, url: str, ids: list[int], max_new: int) -> dict:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True},
        "stream": True,
    }
    chunks: list[dict] = []
    done = False
    async with session.post(url + "/generate", json=body) as resp:
        assert resp.status == 200
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line:
                continue
            assert line.startswith("data: ")
            payload = line[len("data: ") :]
            if payload == "[DONE]":
                done = True
                continue
            chunks.append(json.loads(payload))
    assert done, "stream did not end with data: [DONE]"
    return {"chunks": chunks, "output_ids": chunks[-1]["output_ids"]}


def test_32_concurrent_streams_match_offline_generate(echo_server, tmp_path, small_checkpoint):
    from prometheus_client.parser import text_string_to_metric_families

    url, app, serving, legal_min = echo_server
    prompts = _prompts()

    async def echo_evictions() -> float:
        """ECHO's resolve evictions so far, summed over layers, from /metrics."""
        async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as resp:
            assert resp.status == 200
            text = await resp.text()
        families = {f.name: f for f in text_string_to_metric_families(text)}
        samples = families["sglang:echo_evictions"].samples
        assert len(samples) == serving.info["num_layers"]
        return sum(s.value for s in samples)

    evictions_before = asyncio.run(echo_evictions())
    # Offline reference: the generate CLI with the plain (no-offload) pool, batches of 8.
    pfile = tmp_path / "p.jsonl"
    pfile.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in prompts))
    out = tmp_path / "offline.jsonl"
    rc = generate_main(
        [
            "--quiet",
            "--device",
            "cpu",
            "--model-path",
            str(small_checkpoint),
            "--prompts-file",
            str(pfile),
            "--max-new-tokens",
            str(NEW_TOKENS),
            "--batch-size",
            "8",
            "--ignore-eos",
            "--output",
            str(out),
        ]
    )
    assert rc == 0
    expected = [json.loads(line)["output_ids"] for line in out.read_text().splitlines()]

    async def run_all():
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(
                *(_stream_generate(session, url, p, NEW_TOKENS) for p in prompts)
            )

    results = asyncio.run(run_all())
    got = [r["output_ids"] for r in results]
    assert got == expected
    for r in results:
        counts = [c["meta_info"]["completion_tokens"] for c in r["chunks"]]
        assert counts == sorted(counts) and counts[-1] == NEW_TOKENS
        assert r["chunks"][-1]["meta_info"]["finish_reason"]["type"] == "length"
    _assert_all_free(_wait_idle(app, serving), serving, legal_min)
    # Lossless under real cache pressure: the streams made ECHO evict.
    assert asyncio.run(echo_evictions()) > evictions_before


def test_abort_mid_stream_frees_every_slot_and_host_row(echo_server):
    url, app, serving, legal_min = echo_server

    async def start_and_leave() -> int:
        body = {
            "input_ids": list(range(10, 40)),
            "sampling_params": {"max_new_tokens": 900, "temperature": 0.0, "ignore_eos": True},
            "stream": True,
        }
        seen = 0
        async with aiohttp.ClientSession() as session:
            resp = await session.post(url + "/generate", json=body)
            async for raw in resp.content:
                if raw.strip():
                    seen += 1
                if seen >= 2:
                    break
            resp.close()  # drop the connection mid-stream
        return seen

    assert asyncio.run(start_and_leave()) == 2
    state = _wait_idle(app, serving)
    assert state["running"] == 0
    _assert_all_free(state, serving, legal_min)
    aborted = serving.scheduler.stats.aborted_requests
    assert aborted >= 1


@pytest.mark.parametrize(
    ("path", "body", "needle"),
    [
        ("/generate", b'{"text": "hi", ', "not valid JSON"),
        ("/v1/completions", b"[1, 2]", "JSON object"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, "max_tokens"),
        ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": -5}}, "max_new_tokens"),
        ("/generate", {"input_ids": [5] * 1100}, "at most"),
        ("/v1/completions", {"prompt": [5] * 1000, "max_tokens": 100}, "exceeds the limit"),
        ("/generate", {"input_ids": [5, 999999]}, "outside the vocabulary"),
        ("/generate", {"sampling_params": {}}, "'text'"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ],
)
def test_bad_requests_get_400_with_message(echo_server, path, body, needle):
    url = echo_server[0]

    async def post():
        async with aiohttp.ClientSession() as session:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            async with session.post(url + path, data=data) as resp:
                return resp.status, await resp.json()

    status, payload = asyncio.run(post())
    assert status == 400
    assert needle in payload["error"]["message"]


def test_metrics_parse_with_prometheus_client(echo_server):
    from prometheus_client.parser import text_string_to_metric_families

    url, _app, serving, _ = echo_server

    async def get():
        async with aiohttp.ClientSession() as session:
            await session.post(
                url + "/generate",
                json={"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 3}},
            )
            async with session.get(url + "/metrics") as resp:
                return resp.status, await resp.text()

    status, text = asyncio.run(get())
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(text)}
    layers = serving.info["num_layers"]
    hit = families["sglang:echo_hit_rate"].samples
    assert sorted(int(s.labels["layer"]) for s in hit) == list(range(layers))
    assert all(0.0 <= s.value <= 1.0 for s in hit)
    assert families["sglang:generation_tokens"].samples[0].value >= 3
    recalled = families["sglang:echo_recalled_bytes"].samples
    assert len(recalled) == layers and all(s.value >= 0 for s in recalled)
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:gen_throughput"):
        assert families[name].samples
    # Where the engine thread's time went: every phase, the model steps took some of it.
    phases = {s.labels["phase"]: s.value for s in families["sglang:engine_seconds"].samples}
    assert set(phases) == set(ENGINE_PHASES) and min(phases.values()) >= 0
    assert phases["decode"] > 0 and phases["prefill"] > 0
    cpu = {s.labels["phase"]: s.value for s in families["sglang:engine_cpu_seconds"].samples}
    assert set(cpu) == set(ENGINE_PHASES) and cpu["decode"] > 0  # the steps' host work
    assert all(0 <= cpu[k] <= phases[k] + 1e-3 for k in ENGINE_PHASES)  # CPU never above wall
    # Admissions by part, on both clocks: the table row was timed, its CPU never above wall.
    part = {s.labels["part"]: s.value for s in families["sglang:admission_part_seconds"].samples}
    part_cpu = families["sglang:admission_part_cpu_seconds"].samples
    part_cpu = {s.labels["part"]: s.value for s in part_cpu}
    assert set(part_cpu) == set(part) and part["row"] > 0
    assert all(0 <= part_cpu[k] <= part[k] + 1e-3 for k in part)
    assert families["sglang:decode_steps"].samples[0].value >= 2
    # What each decode step held beside it: at least the requests it decoded were running,
    # none arriving (no decode node here); free tokens counted.
    held = families["sglang:decode_step_requests"].samples
    held = {s.labels["state"]: s.value for s in held}
    assert set(held) == {"running", "arriving", "waiting"} and held["arriving"] == 0
    batch = families["sglang:decode_batch_requests"].samples[0].value
    assert held["running"] >= batch > 0
    assert families["sglang:decode_step_free_tokens"].samples[0].value > 0
    # Triton's compiles are watched from start-up on (none under the interpreter, which
    # compiles nothing; the hooks' arithmetic is tests/test_jit_watch.py's).
    assert families["sglang:triton_compiles"].samples[0].value >= 0
    assert families["sglang:triton_compile_seconds"].samples[0].value >= 0


def test_official_openai_client(echo_server):
    import openai

    url = echo_server[0]
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    native = asyncio.run(_generate_text(url, "Hello", 6))
    done = client.completions.create(model=model, prompt="Hello", max_tokens=6, temperature=0)
    assert done.choices[0].text == native
    assert done.usage.completion_tokens == 6 and done.choices[0].finish_reason == "length"
    pieces = client.completions.create(
        model=model, prompt="Hello", max_tokens=6, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in pieces) == native
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0
    )
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens == 5
    streamed = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        temperature=0,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == chat.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt="x", max_tokens=-2)
    assert "max_tokens" in str(info.value)


async def _generate_text(url: str, text: str, n: int) -> str:
    async with aiohttp.ClientSession() as session:
        body = {"text": text, "sampling_params": {"max_new_tokens": n, "temperature": 0}}
        async with session.post(url + "/generate", json=body) as resp:
            return (await resp.json())["text"]
