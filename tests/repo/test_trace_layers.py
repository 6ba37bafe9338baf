"""benchmark/trace_layers.py: two engines' traces cut into layers and aligned (synthetic
traces, so the answer is known)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmark.device_timeline import DeviceOp
from benchmark.trace_layers import ANCHOR, compare, cut_layers

ROOT = Path(__file__).resolve().parents[2]
LAYERS = 3


def _ops(extra: bool, late_gemm_us: float, steps: int = 4) -> list[DeviceOp]:
    """``steps`` decode steps of LAYERS layers: anchor, norm, gemm, write; ``extra`` adds
    a side-stream kernel after the write, ``late_gemm_us`` delays the gemm in every layer but
    the step's last."""
    ops, t = [], 0.0
    for _ in range(steps):
        for layer in range(LAYERS):
            ops.append(DeviceOp(ANCHOR, "kernel", 7, t, 40.0))
            ops.append(DeviceOp("norm", "kernel", 7, t + 42.0, 2.0))
            late = late_gemm_us if layer < LAYERS - 1 else 0.0
            ops.append(DeviceOp("gemm", "kernel", 7, t + 46.0 + late, 50.0))
            ops.append(DeviceOp("write", "kernel", 7, t + 98.0 + late, 2.0))
            if extra:
                ops.append(DeviceOp("resolve", "kernel", 9, t + 101.0 + late, 5.0))
            t += 110.0 + late
        t += 500.0  # between steps
    return ops


def test_compare_finds_the_added_kernel_and_the_late_gemm_by_layer():
    base = cut_layers(_ops(False, 0.0), LAYERS)
    other = cut_layers(_ops(True, 10.0), LAYERS)
    report = compare(base, other, LAYERS)
    assert report["kernels_per_layer"] == {"base": 4, "other": 5}
    inserted = [d for d in report["differs"] if d["op"] == "insert"]
    assert [r["name"] for d in inserted for r in d["other"]] == ["resolve"]
    assert inserted[0]["other_streams"] == {"resolve": [9, 9, 9]}
    (jump,) = report["drift_jumps"]
    assert jump["before"] == "gemm" and jump["jump_us"] == pytest.approx(10.0)
    assert jump["gap_by_layer_base"] == [2.0, 2.0, 2.0]
    assert jump["gap_by_layer_other"] == [12.0, 12.0, 2.0]  # the step's last layer on time
    assert jump["stream_by_layer_other"] == [7, 7, 7]
    assert report["typical_span_us"]["diff"] == pytest.approx(10.0)


def test_identical_traces_show_no_drift():
    cut = cut_layers(_ops(False, 0.0), LAYERS)
    report = compare(cut, cut, LAYERS)
    assert report["differs"] == [] and report["drift_jumps"] == []


def test_the_command_reads_chrome_traces(tmp_path):
    paths = []
    for name, ops in (("base", _ops(False, 0.0)), ("other", _ops(True, 10.0))):
        events = [
            {"ph": "X", "cat": o.category, "name": o.name, "ts": o.start_us, "dur": o.dur_us,
             "args": {"stream": o.stream}}
            for o in ops
        ]  # fmt: skip
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps({"traceEvents": events}))
    out = tmp_path / "layers.json"
    cmd = [sys.executable, "-m", "benchmark.trace_layers", *map(str, paths), "--layers", "3"]
    done = subprocess.run(
        [*cmd, "--out", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text())["drift_jumps"][0]["before"] == "gemm"
    bad = subprocess.run([*cmd[:-1], "0"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert bad.returncode == 2 and "--layers must be >= 1" in bad.stderr
    paths[0].write_text(json.dumps({"traceEvents": []}))  # no anchor launch in it
    empty = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert empty.returncode == 2 and "fewer than two" in empty.stderr
