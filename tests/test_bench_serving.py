"""bench_serving against the in-process server, its datasets and metrics, and the plots."""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import pytest

from server_utils import make_serving, min_cache_echo_serving, running_server
from sglang_echo.bench import datasets as ds
from sglang_echo.bench.client import RequestResult
from sglang_echo.bench.counter_poll import CounterPoll, counter_series, steady_fields
from sglang_echo.bench.metrics import steady_output_throughput, summarize
from sglang_echo.bench.plot import main as plot_main
from sglang_echo.bench.server_counters import parse_counters, served_fields
from sglang_echo.bench.serving import main as bench_main
from sglang_echo.bench.serving import print_summary
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
    assert rec["steady_output_throughput"] is None and rec["steady_window_s"] is None


def test_steady_output_throughput_by_hand():
    """20 successful requests completing at 1..20 s (sent at shuffled times), request i
    with i output tokens, and a failed one: lo = ceil(20/10) = 2, hi = ceil(180/10) = 18, so
    the window is the 2nd to the 18th completion, [2 s, 18 s], and it holds the requests
    completing at 3..18 s: (3 + ... + 18) = 168 tokens / 16 s = 10.5 tok/s."""
    results, starts = [], []
    for i in [7, 1, 20, 13, 2, 18, 3, 9, 17, 4, 19, 5, 11, 6, 16, 8, 10, 12, 14, 15]:
        start = (i * 0.37) % 1.0  # sent at any time; completes at i s
        results.append(RequestResult(True, 5, i, ttft=0.1, latency=i - start))
        starts.append(start)
    results.append(RequestResult(False, 5, 0, error="boom"))
    starts.append(0.5)
    tput, window = steady_output_throughput(results, starts)
    assert tput == pytest.approx(168 / 16) and window == pytest.approx([2.0, 18.0])
    rec = summarize(results, duration=20.0, starts=starts)
    assert rec["steady_output_throughput"] == pytest.approx(10.5)
    assert rec["output_throughput"] == pytest.approx(210 / 20)  # the whole run, beside it
    # n = 10: lo = 1, hi = 9: completions 2..9 s over [1, 9]: (2 + ... + 9) / 8 tokens/s.
    ten = [RequestResult(True, 5, i, latency=float(i)) for i in range(1, 11)]
    assert steady_output_throughput(ten, [0.0] * 10)[0] == pytest.approx(44 / 8)
    # fewer than 10 successful requests, no start times, or no window: None
    assert steady_output_throughput(ten[:9] + results[-1:], [0.0] * 10) == (None, None)
    assert steady_output_throughput(ten, None) == (None, None)
    same = [RequestResult(True, 5, 3, latency=1.0)] * 12
    assert steady_output_throughput(same, [0.0] * 12) == (None, None)


def _metrics_text(
    steps: float,
    phase_decode: float,
    echo: list[tuple[float, float, float, float]] | None = None,
    decode: tuple[float, float, dict[str, float]] | None = None,
    by_batch_name: str = "decode_device_seconds",
    steps_by_batch: dict[str, float] | None = None,
) -> str:
    """/metrics as runtime/metrics.py renders it: the engine counters, ECHO's per-layer
    (hits, misses, evictions, recalled bytes) and the decode device counters
    (device seconds, batch requests, device seconds by batch size as ``by_batch_name``,
    steps by batch size), each when given."""
    m = 'model_name="tiny"'
    lines = [
        "# HELP sglang:num_running_reqs Requests in the running batch.",
        "# TYPE sglang:num_running_reqs gauge",
        f"sglang:num_running_reqs{{{m}}} 3.0",
        f"sglang:generation_tokens_total{{{m}}} 999.0",
        "# TYPE sglang:decode_steps_total counter",
        f"sglang:decode_steps_total{{{m}}} {steps!r}",
        f'sglang:engine_seconds_total{{{m},phase="decode"}} {phase_decode!r}',
        f'sglang:engine_seconds_total{{{m},phase="idle"}} 1.0',
        f'sglang:engine_cpu_seconds_total{{{m},phase="decode"}} 0.5',
    ]
    if echo is not None:
        for i, (h, *_rest) in enumerate(echo):
            lines.append(f'sglang:echo_hit_rate{{{m},layer="{i}"}} {h / 1000!r}')
        for j, name in enumerate(("hits", "misses", "evictions", "recalled_bytes")):
            lines.append(f"# TYPE sglang:echo_{name}_total counter")
            lines += [
                f'sglang:echo_{name}_total{{{m},layer="{i}"}} {row[j]!r}'
                for i, row in enumerate(echo)
            ]
    if decode is not None:
        device, batch, by_batch = decode
        lines.append(f"sglang:decode_device_seconds_total{{{m}}} {device!r}")
        lines += [
            f'sglang:{by_batch_name}_total{{{m},batch_size="{bs}"}} {v!r}'
            for bs, v in by_batch.items()
        ]
        lines += [
            f'sglang:decode_device_steps_by_batch_total{{{m},batch_size="{bs}"}} {v!r}'
            for bs, v in (steps_by_batch or {}).items()
        ]
        lines.append(f"sglang:decode_batch_requests_total{{{m}}} {batch!r}")
    return "\n".join(lines) + "\n"


def test_served_fields_from_metrics_text():
    before = _metrics_text(
        10.0,
        2.0,
        echo=[(100.0, 50.0, 5.0, 4096.0), (80.0, 20.0, 0.0, 1024.0)],
        decode=(1.0, 40.0, {"4": 0.25, "16": 0.75}),
    )
    after = _metrics_text(
        110.0,
        7.5,
        echo=[(700.0, 150.0, 45.0, 12288.0), (480.0, 120.0, 8.0, 9216.0)],
        decode=(4.0, 840.0, {"4": 0.25, "8": 1.0, "16": 2.75}),
    )
    snap = parse_counters(after)
    assert snap["echo"] == {"hits": 1180, "misses": 270, "evictions": 53, "recalled_bytes": 21504}
    assert snap["engine"]["decode_device_seconds"] == 4.0  # not the labelled samples
    fields = served_fields(parse_counters(before), snap, duration=10.0)
    # over the run, summed over the two layers: hits 600 + 400, misses 100 + 100
    assert fields["server_echo"] == {
        "hits": 1000,
        "misses": 200,
        "evictions": 48,
        "recalled_bytes": 16384,
        "hit_rate": pytest.approx(1000 / 1200),
    }
    assert fields["mean_decode_batch"] == pytest.approx(800 / 100)
    assert fields["served_efficiency"] == pytest.approx(3.0 / 10.0)
    assert fields["decode_device_seconds_by_batch"] == {"8": 1.0, "16": 2.0}  # those that ran
    assert list(fields["decode_device_seconds_by_batch"]) == ["8", "16"]  # by batch size
    assert fields["decode_device_steps_by_batch"] is None  # not exposed
    engine = fields["server_engine"]
    assert engine["decode_steps"] == 100 and engine["engine_seconds.decode"] == 5.5
    assert engine["engine_seconds.idle"] == 0 and engine["decode_batch_requests"] == 800
    assert "generation_tokens" not in engine

    # the per-batch seconds under their own name, with step counts beside them
    by_name = {"by_batch_name": "decode_device_seconds_by_batch"}
    named = served_fields(
        parse_counters(
            _metrics_text(
                1.0, 0.0, decode=(0.0, 4.0, {"4": 0.0}), **by_name, steps_by_batch={"4": 0.0}
            )
        ),
        parse_counters(
            _metrics_text(
                5.0, 1.0, decode=(2.0, 16.0, {"4": 2.0}), **by_name, steps_by_batch={"4": 4.0}
            )
        ),
        duration=4.0,
    )
    assert named["decode_device_seconds_by_batch"] == {"4": 2.0}
    assert named["decode_device_steps_by_batch"] == {"4": 4.0}
    assert named["mean_decode_batch"] == 3.0 and named["served_efficiency"] == 0.5

    # ECHO on, but nothing selected over the run: no hit rate
    idle = served_fields(parse_counters(after), parse_counters(after), duration=10.0)
    assert idle["server_echo"]["hits"] == 0 and idle["server_echo"]["hit_rate"] is None
    assert idle["mean_decode_batch"] is None  # no decode step

    # no-offload on an older server (or on the CPU): no ECHO, no decode device counters
    plain = served_fields(
        parse_counters(_metrics_text(10.0, 2.0)),
        parse_counters(_metrics_text(30.0, 3.0)),
        duration=5.0,
    )
    assert plain["server_echo"] is None and plain["decode_device_seconds_by_batch"] is None
    assert plain["mean_decode_batch"] is None and plain["served_efficiency"] is None
    assert plain["server_engine"]["decode_steps"] == 20

    # a server without this project's /metrics (SGLang's, or none): all None
    empty = served_fields(parse_counters(""), parse_counters(""), duration=5.0)
    assert set(empty.values()) == {None}


def test_summary_table_prints_served_fields_when_present():
    import io

    base = summarize([RequestResult(True, 10, 3, ttft=0.1, latency=0.5, itl=[0.2] * 2)], 1.0)
    base.update(backend="sglang", dataset_name="random", synthetic=True, request_rate=1.0)
    out = io.StringIO()
    print_summary({**base, **served_fields(parse_counters(""), parse_counters(""), 1.0)}, out)
    assert "Steady" not in out.getvalue() and "ECHO" not in out.getvalue()
    assert "decode batch" not in out.getvalue() and "efficiency" not in out.getvalue()
    fields = {
        "server_echo": {
            "hits": 9,
            "misses": 1,
            "evictions": 0,
            "recalled_bytes": 64,
            "hit_rate": 0.9,
        },
        "mean_decode_batch": 7.5,
        "served_efficiency": 0.25,
        "steady_output_throughput": 123.0,
        "steady_window_s": [1.0, 9.0],
    }
    out = io.StringIO()
    print_summary({**base, **fields}, out)
    text = out.getvalue()
    assert "0.9000 (hits 9, misses 1" in text and "7.50" in text and "0.250" in text
    assert "123.00 (1.0-9.0 s)" in text


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
        assert rec["server_schedule"] == {"overlap": True, "engine_process": False}  # defaults
        assert rec["mean_ttft_ms"] > 0 and rec["mean_e2e_latency_ms"] >= rec["mean_ttft_ms"]
        # no ECHO on no-offload; fewer than 10 requests: no steady window
        assert rec["server_echo"] is None and rec["steady_output_throughput"] is None
        assert rec["server_engine"]["decode_steps"] > 0
        assert rec["mean_decode_batch"] is None or 1 <= rec["mean_decode_batch"] <= 8
        assert rec["served_efficiency"] is None or 0 <= rec["served_efficiency"] <= 1
        assert len(rec["start_times"]) == len(rec["latencies"]) == 6
        assert all(0 <= t <= rec["duration"] for t in rec["start_times"])
    assert lines[1]["request_rate"] == 20
    assert max(lines[1]["start_times"]) > 0  # Poisson arrivals: sent over time


def test_bench_records_echo_counters_and_steady_throughput(small_checkpoint, tmp_path):
    """ECHO at its smallest legal device cache (every layer evicts): the run's selections
    come back from /metrics, summed over layers, with the run's hit rate."""
    serving = min_cache_echo_serving(small_checkpoint, 4, 32, 600, 512)
    out = tmp_path / "req_rate_inf.jsonl"
    argv = ["--dataset-name", "random", "--num-prompts", "12", "--random-input-len", "40"]
    argv += ["--random-output-len", "6", "--random-range-ratio", "1", "--disable-tqdm"]
    argv += ["--max-concurrency", "4", "--output-file", str(out)]
    with running_server(serving) as (url, _app):
        assert bench_main(["--base-url", url, *argv]) == 0
    rec = json.loads(out.read_text())
    assert rec["completed"] == 12 and rec["kv_backend"] == "echo"
    echo = rec["server_echo"]
    assert echo["hits"] + echo["misses"] > 0 and echo["misses"] > 0 and echo["evictions"] > 0
    assert echo["hit_rate"] == pytest.approx(echo["hits"] / (echo["hits"] + echo["misses"]))
    assert echo["recalled_bytes"] > 0
    # 12 requests: the window runs from the 2nd completion to the 11th
    lo, hi = rec["steady_window_s"]
    assert 0 < lo < hi <= rec["duration"] and rec["steady_output_throughput"] > 0
    assert rec["mean_decode_batch"] is None or 1 <= rec["mean_decode_batch"] <= 4


def test_steady_counters_from_samples_inside_the_run(small_checkpoint, tmp_path):
    """--poll-counters-s: the counters sampled during the run bound its steady window, and
    the steady hit rate, mean batch and counts come from those two samples only."""
    serving = min_cache_echo_serving(small_checkpoint, 4, 32, 600, 512)
    out = tmp_path / "req_rate_inf.jsonl"
    argv = ["--dataset-name", "random", "--num-prompts", "12", "--random-input-len", "40"]
    argv += ["--random-output-len", "8", "--random-range-ratio", "1", "--disable-tqdm"]
    argv += ["--max-concurrency", "4", "--output-file", str(out), "--poll-counters-s", "0.02"]
    with running_server(serving) as (url, _app):
        assert bench_main(["--base-url", url, *argv]) == 0
    rec = json.loads(out.read_text())
    lo, hi = rec["steady_window_s"]
    a, b = rec["steady_counters_window_s"]
    assert a <= lo < hi <= b <= rec["duration"] + 1.0
    assert 0.0 <= rec["steady_hit_rate"] <= 1.0
    assert 1 <= rec["steady_mean_decode_batch"] <= 4
    # The same samples as a series. The first sample races the first requests to the
    # engine, so the intervals hold at most the run's 12 requests and its decode steps.
    series = rec["counter_series"]
    cols = series["columns"]
    rows = [dict(zip(cols, row, strict=True)) for row in series["rows"]]
    assert 0 < sum(r["admitted"] for r in rows) <= sum(r["received"] for r in rows) + 4 <= 16
    assert 0 < sum(r["decode_steps"] for r in rows) <= rec["server_engine"]["decode_steps"]
    assert [r["t_s"] for r in rows] == sorted(r["t_s"] for r in rows)


def test_counter_poll_bounds_and_steady_fields():
    def counters(hits: float, misses: float, steps: float, batch: float) -> dict:
        echo = {"hits": hits, "misses": misses, "evictions": 0.0, "recalled_bytes": 0.0}
        engine = {"decode_steps": steps, "decode_batch_requests": batch}
        return {"engine": engine, "echo": echo, "device_seconds": {}, "device_steps": {}}

    poll = CounterPoll(read=None, interval=0.5)
    poll.samples = [
        (0.0, counters(0, 0, 0, 0)),
        (1.0, counters(10, 10, 5, 5)),  # ramp: half the selections missed
        (2.0, counters(100, 20, 15, 45)),
        (3.0, counters(190, 30, 25, 85)),  # steady: 90 of 100 hit, batch 4
        (4.0, counters(200, 40, 30, 90)),
    ]
    (t_a, _), (t_b, _) = poll.bounds([1.5, 2.5])
    assert (t_a, t_b) == (1.0, 3.0)  # the samples just outside the window
    steady = steady_fields(poll, [2.0, 3.0], served_fields)
    assert steady["steady_counters_window_s"] == [2.0, 3.0]
    assert steady["steady_hit_rate"] == pytest.approx(0.9)
    assert steady["steady_mean_decode_batch"] == pytest.approx(4.0)
    assert steady_fields(poll, [2.0, 4.5], served_fields) == {}  # no sample after the end
    assert steady_fields(None, [2.0, 3.0], served_fields) == {}
    # Samples a fraction of a millisecond outside the window stay outside once rounded
    # (to the nearest, 1.99986 read 2.0, after a window starting at 1.9999).
    poll.samples[2] = (1.99986, poll.samples[2][1])
    poll.samples[3] = (3.00014, poll.samples[3][1])
    lo, hi = steady_fields(poll, [1.9999, 3.0001], served_fields)["steady_counters_window_s"]
    assert lo <= 1.9999 and hi >= 3.0001 and (lo, hi) == (1.999, 3.001)


def test_counter_series_tells_memory_from_demand():
    """One row per sampling interval: the steps' mean batch and what they held beside it,
    and the requests the engine queued, admitted and saw arrive there."""

    def counters(steps, batch, running, arriving, waiting, free, received, admitted, arrived):
        engine = {
            "decode_steps": steps,
            "decode_batch_requests": batch,
            "decode_step_requests.running": running,
            "decode_step_requests.arriving": arriving,
            "decode_step_requests.waiting": waiting,
            "decode_step_free_tokens": free,
            "requests_received": received,
            "admissions": admitted,
            "transfers": arrived,
        }
        return {"engine": engine, "echo": {}, "device_seconds": {}, "device_steps": {}}

    poll = CounterPoll(read=None, interval=0.5)
    poll.samples = [
        (0.0, counters(0, 0, 0, 0, 0, 0, 0, 0, 0)),
        # 10 steps of 4 with 6 waiting and 100 tokens free: short of memory
        (0.5, counters(10, 40, 50, 10, 60, 1000, 10, 4, 4)),
        # 10 steps of 8 with none waiting and 5000 free: short of requests
        (1.0, counters(20, 120, 130, 10, 60, 51000, 12, 12, 12)),
    ]
    series = counter_series(poll, served_fields)
    cols = series["columns"]
    first, second = (dict(zip(cols, row, strict=True)) for row in series["rows"])
    assert (first["t_s"], first["decode_steps"], first["mean_decode_batch"]) == (0.5, 10, 4.0)
    assert (first["running"], first["arriving"], first["waiting"]) == (5.0, 1.0, 6.0)
    assert first["free_tokens"] == 100 and (first["received"], first["admitted"]) == (10, 4)
    assert (second["mean_decode_batch"], second["waiting"], second["free_tokens"]) == (8.0, 0, 5000)
    assert (second["received"], second["admitted"], second["arrived"]) == (2, 8, 8)
    assert first["triton_compiles"] is None  # a server without the counter
    assert counter_series(None, served_fields) is None
    poll.samples = poll.samples[:1]
    assert counter_series(poll, served_fields) is None


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
    # records without the served fields (older ones, SGLang's): None, no steady ratio
    inf = summary["runs"]["infini-318 offload"]["inf"]
    assert inf["output_throughput"] == 420.0 and inf["steady_output_throughput"] is None
    assert inf["echo_hit_rate"] is None and inf["served_efficiency"] is None
    assert summary["steady_ratio"] == {"infini-318": {}}
    assert plot_main([str(tmp_path / "plots"), "--out-dir", str(out)]) == 2  # no results


def test_plot_carries_served_fields_and_steady_ratio(tmp_path):
    root = tmp_path / "infini"
    _write_run(root / "no-offload", {"1": 100.0, "inf": 200.0})
    _write_run(root / "offload", {"1": 150.0, "inf": 420.0})
    served = {
        ("no-offload", "1"): (120.0, None),
        ("no-offload", "inf"): (250.0, None),
        ("offload", "1"): (180.0, 0.75),
        ("offload", "inf"): (None, 0.5),  # fewer than 10 requests: no steady figure
    }
    for (mode, rate), (steady, hit_rate) in served.items():
        f = root / mode / f"req_rate_{rate}.jsonl"
        rec = json.loads(f.read_text())
        rec.update(
            steady_output_throughput=steady,
            served_efficiency=0.4,
            mean_decode_batch=6.0,
            server_echo=None
            if hit_rate is None
            else {
                "hits": 30,
                "misses": 10,
                "evictions": 4,
                "recalled_bytes": 2048,
                "hit_rate": hit_rate,
            },
        )
        f.write_text(json.dumps(rec) + "\n")
    out = tmp_path / "plots"
    assert plot_main([str(root), "--out-dir", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    off, base = summary["runs"]["offload"], summary["runs"]["no-offload"]
    assert off["1"]["steady_output_throughput"] == 180.0 and off["1"]["echo_hit_rate"] == 0.75
    assert off["1"]["echo_misses"] == 10 and off["1"]["echo_evictions"] == 4
    assert off["1"]["echo_recalled_bytes"] == 2048 and off["inf"]["echo_hit_rate"] == 0.5
    assert off["1"]["served_efficiency"] == 0.4 and off["1"]["mean_decode_batch"] == 6.0
    assert base["1"]["echo_hit_rate"] is None and base["inf"]["steady_output_throughput"] == 250
    ratios = summary["offload_over_no_offload_output_throughput"]["all"]
    assert ratios == {"1": pytest.approx(1.5), "inf": pytest.approx(2.1)}
    assert summary["steady_ratio"] == {"all": {"1": pytest.approx(1.5)}}


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


def _held_text(steps: float, running: float, arriving: float, waiting: float, free: float) -> str:
    """/metrics with the decode steps and what each step held (runtime/metrics.py)."""
    m = 'model_name="tiny"'
    held = {"running": running, "arriving": arriving, "waiting": waiting}
    return _metrics_text(steps, 0.0) + "\n".join(
        [
            *(
                f'sglang:decode_step_requests_total{{{m},state="{k}"}} {v!r}'
                for k, v in held.items()
            ),
            f"sglang:decode_step_free_tokens_total{{{m}}} {free!r}",
        ]
    )


def test_served_fields_mean_requests_held_per_step():
    """What a decode step had beside it, on average over the run: 100 steps that held
    1,200 running (300 of them arriving) and 50 waiting requests, 4,000 free tokens each."""
    before = parse_counters(_held_text(10.0, 100.0, 20.0, 0.0, 1000.0))
    after = parse_counters(_held_text(110.0, 1300.0, 320.0, 50.0, 401000.0))
    assert after["engine"]["decode_step_requests.arriving"] == 320.0  # the state folded in
    fields = served_fields(before, after, duration=1.0)
    assert fields["mean_step_requests"] == {"running": 12.0, "arriving": 3.0, "waiting": 0.5}
    assert fields["mean_free_tokens"] == 4000
    # a server without them (or no decode step over the run): None, not zeros
    bare = served_fields(parse_counters(_metrics_text(1.0, 0.0)), parse_counters(_metrics_text(1.0, 0.0)), 1.0)  # fmt: skip
    assert bare["mean_step_requests"] is None and bare["mean_free_tokens"] is None


def test_bodies_are_encoded_before_the_first_request_is_sent(monkeypatch):
    """A 100K-token body takes ~10 ms to encode: encoding them while sending made the
    client the bottleneck of a served run. Every body is made before the clock starts,
    and each request sends exactly its own body."""
    import asyncio

    from sglang_echo.bench import client
    from sglang_echo.bench import serving as bs

    events: list[tuple[str, int]] = []
    real_encode = client.encode_payload

    def encode(req, ignore_eos):
        events.append(("encode", req.prompt_len))
        return real_encode(req, ignore_eos)

    async def send(session, url, req, ignore_eos=True, body=None):
        events.append(("send", req.prompt_len))
        assert json.loads(body) == client.generate_payload(req, ignore_eos)
        return RequestResult(success=True, prompt_len=req.prompt_len)

    monkeypatch.setattr(bs, "encode_payload", encode)
    monkeypatch.setattr(bs, "send_generate", send)
    reqs = [ds.BenchRequest(list(range(n)), n, 4) for n in (3, 5, 7)]
    results, _, _ = asyncio.run(
        bs.run_requests(None, "http://x/generate", reqs, float("inf"), None, True, 0, False)
    )
    assert [r.prompt_len for r in results] == [3, 5, 7]
    kinds = [k for k, _ in events]
    assert kinds == ["encode"] * 3 + ["send"] * 3, events


def test_synthetic_infinitebench_takes_an_input_range():
    w = ds.synthetic_infinitebench(40, 110_592, 128, 259, 0, input_range=(100_000, 108_000))
    lens = [r.prompt_len for r in w.requests]
    assert min(lens) >= 100_000 and max(lens) <= 108_000
    assert "inputs 100000-108000" in w.description


@pytest.mark.parametrize(
    ("text", "error"),
    [("100000", "LO,HI"), ("a,b", "LO,HI"), ("108000,100000", "0 < LO <= HI"), ("0,5", "0 < LO")],
)
def test_the_input_range_flag_refuses_bad_values(text, error):
    from sglang_echo.bench.serving import input_range

    with pytest.raises(argparse.ArgumentTypeError, match=error):
        input_range(text)


def test_the_input_range_flag_parses_and_refuses_a_dataset_file():
    from sglang_echo.bench.serving import build_parser, build_workload

    args = build_parser().parse_args(
        ["--dataset-name", "infinitebench", "--infinitebench-input-range", "100_000,108_000"]
    )
    assert args.infinitebench_input_range == (100_000, 108_000)
    facts = {"tokenizer": None, "context": 110_592, "vocab": 259}
    args.num_prompts = 3
    assert all(100_000 <= r.prompt_len <= 108_000 for r in build_workload(args, facts).requests)
    args.dataset_path = "/nonexistent.jsonl"
    with pytest.raises(ds.DatasetError, match="brings its own"):
        build_workload(args, facts)
