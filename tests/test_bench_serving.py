"""bench_serving against the in-process server, its datasets and metrics, and the plots."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import pytest

from server_utils import make_serving, running_server
from sglang_echo.bench import datasets as ds
from sglang_echo.bench.client import RequestResult
from sglang_echo.bench.metrics import summarize
from sglang_echo.bench.plot import main as plot_main
from sglang_echo.bench.serving import main as bench_main
from sglang_echo.config import EchoConfig
from sglang_echo.tokenizer import load_tokenizer

SGLANG_FIELDS = [
    "backend",
    "dataset_name",
    "request_rate",
    "duration",
    "completed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "input_throughput",
    "output_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_itl_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "mean_e2e_latency_ms",
    "median_e2e_latency_ms",
    "p99_e2e_latency_ms",
    "concurrency",
]


def test_summary_numbers():
    results = [
        RequestResult(True, 10, 3, ttft=0.1, latency=0.5, itl=[0.2, 0.2]),
        RequestResult(True, 20, 5, ttft=0.3, latency=1.1, itl=[0.2] * 4),
        RequestResult(False, 7, 0, error="boom"),
    ]
    rec = summarize(results, duration=2.0)
    assert rec["completed"] == 2 and rec["failed"] == 1
    assert rec["total_input_tokens"] == 30 and rec["total_output_tokens"] == 8
    assert rec["request_throughput"] == pytest.approx(1.0)
    assert rec["output_throughput"] == pytest.approx(4.0)
    assert rec["mean_ttft_ms"] == pytest.approx(200.0)
    assert rec["mean_tpot_ms"] == pytest.approx(statistics.fmean([200.0, 200.0]))
    assert rec["median_e2e_latency_ms"] == pytest.approx(800.0)
    assert rec["p99_e2e_latency_ms"] == pytest.approx(500 + 600 * 0.99)
    assert rec["concurrency"] == pytest.approx(0.8)


def test_synthetic_infinitebench_scaled_to_context():
    w = ds.synthetic_infinitebench(50, context_length=4096, max_output_len=256, vocab=259, seed=0)
    assert w.synthetic and "SYNTHETIC" in w.description
    scale = (4096 - 256) / 110_000
    for r in w.requests:
        assert 100_000 * scale - 1 <= r.prompt_len <= 110_000 * scale + 1
        assert r.prompt_len == len(r.prompt) and r.prompt_len + r.output_len <= 4096
        assert 1 <= r.output_len <= 256 and all(3 <= t < 259 for t in r.prompt)
    full = ds.synthetic_infinitebench(5, 163_840, 256, 129_280, 0)
    assert all(100_000 <= r.prompt_len <= 110_000 for r in full.requests)


def test_real_dataset_files(tmp_path, small_checkpoint):
    counter = ds.TokenCounter(load_tokenizer(small_checkpoint))  # byte level: 1 char = 1 token
    share = tmp_path / "sharegpt.json"
    convs = [
        {"conversations": [{"from": "human", "value": "x" * n}, {"from": "gpt", "value": "y" * m}]}
        for n, m in [(50, 40), (2, 40), (60, 3000), (100, 80)]
    ]
    share.write_text(json.dumps(convs))
    w = ds.load_sharegpt(share, counter, 10, context_length=4096, seed=0)
    assert not w.synthetic
    assert sorted((r.prompt_len, r.output_len) for r in w.requests) == [(50, 40), (100, 80)]
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    rec = {"context": "a" * 5000, "input": "question?", "answer": ["z"]}
    (tasks / "kv_retrieval.jsonl").write_text(json.dumps(rec) + "\n")
    w = ds.load_infinitebench(tasks, "kv_retrieval", counter, 5, 1024, 256)
    (r,) = w.requests
    assert r.output_len == 50  # InfiniteBench's kv_retrieval length, under the 256 cap
    assert r.prompt_len <= 1024 - 50 and r.prompt.endswith("question?")  # middle cut
    with pytest.raises(ds.DatasetError, match="tasks there"):
        ds.load_infinitebench(tasks, "passkey", counter, 5, 1024, 256)


@pytest.fixture(scope="module")
def plain_server(small_checkpoint):
    serving = make_serving(
        small_checkpoint,
        EchoConfig(),
        max_total_tokens=3000,
        max_running_requests=8,
        context_length=512,
    )
    with running_server(serving) as (url, _app):
        yield url


def test_bench_against_server_writes_sglang_record(plain_server, tmp_path):
    out = tmp_path / "res" / "req_rate_inf.jsonl"
    argv = ["--base-url", plain_server, "--dataset-name", "random", "--num-prompts", "6"]
    argv += ["--random-input-len", "40", "--random-output-len", "7", "--random-range-ratio", "1"]
    argv += ["--warmup-requests", "1", "--output-file", str(out), "--disable-tqdm"]
    assert bench_main(argv) == 0
    assert bench_main([*argv[:-3], "--request-rate", "20", "--output-file", str(out)]) == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == 2
    for rec in lines:
        assert all(k in rec for k in SGLANG_FIELDS)
        assert rec["completed"] == 6 and rec["failed"] == 0
        assert rec["total_output_tokens"] == 6 * 7  # ignore_eos: every request runs to length
        assert rec["total_input_tokens"] == 6 * 40
        assert rec["kv_backend"] == "no-offload" and rec["synthetic"]
        assert rec["mean_ttft_ms"] > 0 and rec["mean_e2e_latency_ms"] >= rec["mean_ttft_ms"]
    assert lines[1]["request_rate"] == 20


def test_bench_reports_unreachable_server(tmp_path):
    with pytest.raises(SystemExit, match="cannot reach"):
        bench_main(["--base-url", "http://127.0.0.1:9", "--num-prompts", "1"])


def _write_run(folder: Path, rates: dict[str, float]) -> None:
    folder.mkdir(parents=True)
    for rate, tput in rates.items():
        rec = {
            "output_throughput": tput,
            "request_throughput": tput / 100,
            "median_ttft_ms": 1000 / tput,
            "median_itl_ms": 5.0,
            "median_e2e_latency_ms": 2000.0,
            "completed": 10,
        }
        (folder / f"req_rate_{rate}.jsonl").write_text(json.dumps(rec) + "\n")


def test_plot_figures_and_ratios(tmp_path):
    root = tmp_path / "infini-318"
    _write_run(root / "no-offload-1129", {"0.5": 100.0, "inf": 200.0})
    _write_run(root / "offload-1129", {"0.5": 150.0, "inf": 420.0})
    task_root = tmp_path / "infini-task"
    for mode, scale in (("no-offload-1129", 1.0), ("offload-1129", 2.0)):
        for task in ("passkey", "kv_retrieval"):
            _write_run(task_root / mode / task, {"inf": 50.0 * scale})
    out = tmp_path / "plots"
    assert plot_main([str(root), str(task_root), "--out-dir", str(out)]) == 0
    for name in ("throughput_vs_rate.png", "latency_vs_rate.png", "per_task_throughput.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((out / "summary.json").read_text())
    ratios = summary["offload_over_no_offload_output_throughput"]["infini-318"]
    assert ratios == {"0.5": pytest.approx(1.5), "inf": pytest.approx(2.1)}
    assert summary["tasks"]["passkey"]["infini-task offload"]["tok_s"] == 100.0
    assert plot_main([str(tmp_path / "plots"), "--out-dir", str(out)]) == 2  # no results


SGLANG_PY = Path.home() / ".cache/sglang-echo/sglang-0.5.23/bin/python"  # make sglang-env


@pytest.mark.slow
@pytest.mark.skipif(not SGLANG_PY.is_file(), reason="no sglang env (make sglang-env)")
def test_sglang_own_bench_serving_against_our_echo_server(small_checkpoint, tmp_path):
    """A client nobody here wrote: SGLang 0.5.23's bench_serving, ECHO on, at the smallest
    legal device cache for 8 running requests."""
    import subprocess

    serving = make_serving(
        small_checkpoint,
        EchoConfig(offload=True, dev_cache_size=8 * 16),
        max_total_tokens=2000,
        max_running_requests=8,
        chunked_prefill_size=64,
        context_length=512,
    )
    out = tmp_path / "sglang.jsonl"
    with running_server(serving) as (url, _app):
        port = url.rsplit(":", 1)[1]
        argv = [str(SGLANG_PY), "-m", "sglang.bench_serving", "--backend", "sglang"]
        argv += ["--host", "127.0.0.1", "--port", port, "--dataset-name", "random-ids"]
        argv += ["--random-input-len", "64", "--random-output-len", "16"]
        argv += ["--random-range-ratio", "1.0", "--num-prompts", "8", "--request-rate", "inf"]
        argv += ["--model", str(small_checkpoint), "--tokenizer", str(small_checkpoint)]
        argv += ["--output-file", str(out), "--disable-tqdm"]
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rec = json.loads(out.read_text().splitlines()[-1])
    assert rec["completed"] == 8 and rec["total_output_tokens"] == 8 * 16


def test_client_drops_idle_connections_before_uvicorn_does(plain_server):
    """A pooled connection is reused while fresh, never after the client's keep-alive: the
    server (uvicorn, 5 s) must not be the one to close it under a request."""
    import asyncio

    import aiohttp
    import uvicorn

    from sglang_echo.bench import serving as bs

    assert bs.CLIENT_KEEP_ALIVE_S < bs.UVICORN_KEEP_ALIVE_S
    assert uvicorn.Config(app=None).timeout_keep_alive == bs.UVICORN_KEEP_ALIVE_S

    async def connection_events() -> list[str]:
        events: list[str] = []
        trace = aiohttp.TraceConfig()

        async def created(*_):
            events.append("new")

        async def reused(*_):
            events.append("reused")

        trace.on_connection_create_end.append(created)
        trace.on_connection_reuseconn.append(reused)
        async with aiohttp.ClientSession(
            connector=bs.bench_connector(), trace_configs=[trace]
        ) as session:

            async def get() -> None:
                async with session.get(plain_server + "/health") as resp:
                    await resp.read()

            await get()
            await get()
            await asyncio.sleep(bs.CLIENT_KEEP_ALIVE_S + 0.5)
            await get()
        return events

    # reused while fresh, a new connection after the idle time
    assert asyncio.run(connection_events()) == ["new", "reused", "new"]
