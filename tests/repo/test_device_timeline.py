"""benchmark/device_timeline.py folds a profiler trace into busy time, idle gaps and the
kernels per stream (CPU tests on hand-made traces: the numbers are worked by hand)."""

from __future__ import annotations

import gzip
import json

import pytest

from benchmark.device_timeline import (
    DeviceOp,
    HostCall,
    graph_gaps,
    load_chrome_trace,
    merged_spans,
    summarize,
)


def _op(name: str, stream: int, start: float, dur: float) -> DeviceOp:
    return DeviceOp(name, "kernel", stream, start, dur)


def test_merged_spans_joins_overlaps_and_keeps_gaps():
    ops = [_op("a", 7, 0, 10), _op("b", 7, 5, 10), _op("c", 7, 20, 5), _op("d", 7, 25, 5)]
    assert merged_spans(ops) == [(0, 15), (20, 30)]


def test_summary_counts_the_decode_streams_gaps_and_their_borders():
    # Decode stream 7: graph 0-1000, a 300 us gap, sample 1300-1350, a 50 us gap, graph
    # 1400-2400, a 300 us gap, sample 2700-2750. Side stream 9: keys 1000-1600 (overlaps).
    ops = [
        _op("graph", 7, 0, 1000),
        _op("sample", 7, 1300, 50),
        _op("graph", 7, 1400, 1000),
        _op("sample", 7, 2700, 50),
        _op("keys", 9, 1000, 600),
    ]
    calls = [HostCall("cudaStreamSynchronize", 40), HostCall("cudaLaunchKernel", 5)]
    s = summarize(ops, calls)
    assert s["main_stream"] == 7 and s["window_us"] == 2750
    assert s["main_idle_us"] == 650  # 300 + 50 + 300
    assert s["main_gaps"]["0.1-1ms"] == {"count": 2, "us": 600.0}
    assert s["main_gaps"]["10-100us"] == {"count": 1, "us": 50.0}
    assert s["main_gap_borders"][0] == {
        "after": "graph",
        "before": "sample",
        "count": 2,
        "us": 600.0,
    }
    # Across streams, 0-1000, 1000-1600 and 1400-2400 join: only 2400-2700 is idle.
    assert s["device_busy_share"] == pytest.approx((2400 + 50) / 2750, abs=1e-4)
    assert s["streams"]["9"]["busy_us"] == 600
    assert s["streams"]["7"]["top"][0] == {"name": "graph", "us": 2000.0, "count": 2}
    assert s["host_blocking_us"] == {"cudaStreamSynchronize": 40.0}
    assert [r["name"] for r in s["ops_by_name"]] == ["graph", "keys", "sample"]
    assert s["ops_by_name"][2] == {"name": "sample", "us": 100.0, "count": 2}


def test_load_chrome_trace_reads_device_ops_and_runtime_calls(tmp_path):
    trace = {
        "traceEvents": [
            {"ph": "X", "cat": "kernel", "name": "k", "ts": 5, "dur": 2, "args": {"stream": 7}},
            {
                "ph": "X",
                "cat": "gpu_memcpy",
                "name": "Memcpy HtoD",
                "ts": 1,
                "dur": 1,
                "args": {"stream": 9},
            },
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 0, "dur": 3},
            {"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 0, "dur": 3},
            {"ph": "i", "cat": "kernel", "name": "instant", "ts": 0},
        ]
    }
    path = tmp_path / "t.json"
    path.write_text(json.dumps(trace))
    packed = tmp_path / "t.json.gz"  # as the probe leaves it
    packed.write_bytes(gzip.compress(path.read_bytes()))
    for file in (path, packed):
        ops, calls = load_chrome_trace(file)
        assert [(o.name, o.stream) for o in ops] == [("Memcpy HtoD", 9), ("k", 7)]
        assert calls == [HostCall("cudaLaunchKernel", 3.0)]


def test_an_empty_trace_is_a_clear_error():
    with pytest.raises(ValueError, match="no device operations"):
        summarize([])


def _launch(name: str, corr: int, at: float, thread: int = 1) -> HostCall:
    return HostCall(name, 5.0, corr, thread, at)


def test_graph_gaps_tell_a_late_host_from_a_step_held_behind_a_copy():
    # Three decode steps as graph launches (correlations 1, 2, 3) whose kernels land on
    # branch streams 20 and 21; the engine thread (1) also launches a readback (4) and a
    # sampling kernel (5); a writer thread (2) launches a bulk copy (6).
    calls = [
        _launch("cudaGraphLaunch", 1, 0),
        _launch("cudaGraphLaunch", 2, 500),  # before step 1 ends at 1000: launched early
        _launch("cudaMemcpyAsync", 4, 900),
        _launch("cudaLaunchKernel", 5, 950),
        _launch("cudaMemcpyAsync", 6, 100, thread=2),
        _launch("cudaGraphLaunch", 3, 4000),  # after step 2 ends at 3000: the host was late
    ]
    ops = [
        DeviceOp("g1a", "kernel", 20, 0, 600, 1),
        DeviceOp("g1b", "kernel", 21, 500, 500, 1),  # step 1: 0-1000
        DeviceOp("bulk", "gpu_memcpy", 9, 100, 1300, 6),  # the copy engine until 1400
        DeviceOp("Memcpy DtoH", "gpu_memcpy", 7, 1400, 10, 4),  # waited 400 us after 1000
        DeviceOp("sample", "kernel", 7, 1410, 40, 5),
        DeviceOp("g2", "kernel", 20, 1500, 1500, 2),  # step 2: 1500-3000
        DeviceOp("g3", "kernel", 20, 4100, 1000, 3),  # step 3: 4100-5100
    ]
    g = graph_gaps(ops, calls)
    assert g["steps"] == 3 and g["gap_us"]["total"] == 500 + 1100
    assert g["host_late"] == {"count": 1, "us": 1100.0}
    assert g["launched_early"] == {"count": 1, "us": 500.0}
    assert g["engine_direct_us_per_step"] == round(50 / 3, 1)  # the readback and the sampling
    assert g["waited_before"] == [{"op": "Memcpy DtoH", "count": 1, "us": 400.0}]


def test_graph_gaps_need_two_graph_launches():
    calls = [_launch("cudaGraphLaunch", 1, 0)]
    assert graph_gaps([DeviceOp("g", "kernel", 20, 0, 10, 1)], calls) is None
