"""benchmark/task_spread.py: Figure 14's task ratios folded over runs (synthetic runs, so
every ratio and first token is known)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmark.task_spread import run_tasks, spread

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp: Path, name: str, tok_s: dict[str, tuple[float, float]], ttft: float) -> Path:
    """A tasks sweep folder: per task (no-offload, offload) tok/s; every request's first
    token at ``ttft`` s or later."""
    d = tmp / name
    tasks = {}
    for task, (base, echo) in tok_s.items():
        tasks[task] = {
            "no-offload": {"rate": "inf", "tok_s": base},
            "offload": {"rate": "inf", "tok_s": echo},
        }
        for backend in ("no-offload", "offload"):
            bench = d / "tasks" / backend / task / "req_rate_inf.jsonl"
            bench.parent.mkdir(parents=True)
            bench.write_text(json.dumps({"ttfts": [ttft + 0.5, ttft, ttft + 1.0]}) + "\n")
    record = {"device": "GPU X", "date": "2026-12-06", "metrics": {"tasks": tasks}}
    d.mkdir(parents=True, exist_ok=True)
    (d / "e2e_sweep.json").write_text(json.dumps(record))
    return d


def test_spread_of_ratios_and_first_tokens(tmp_path):
    runs = [
        run_tasks(_run(tmp_path, "a", {"qa": (100.0, 160.0), "debug": (50.0, 35.0)}, 1.7)),
        run_tasks(_run(tmp_path, "b", {"qa": (100.0, 224.0), "debug": (50.0, 46.5)}, 0.4)),
        run_tasks(_run(tmp_path, "c", {"qa": (100.0, 200.0)}, 0.5)),
    ]
    out = spread(runs)
    assert set(out) == {"qa"}  # only the tasks every run has
    assert out["qa"]["ratio_per_run"] == [1.6, 2.24, 2.0]
    assert (out["qa"]["median"], out["qa"]["min"], out["qa"]["max"]) == (2.0, 1.6, 2.24)
    assert out["qa"]["first_token_s_per_run"]["offload"] == [1.7, 0.4, 0.5]


def test_cli_writes_a_record_and_refuses_a_folder_without_tasks(tmp_path):
    a = _run(tmp_path, "a", {"qa": (100.0, 150.0)}, 0.3)
    b = _run(tmp_path, "b", {"qa": (100.0, 250.0)}, 0.3)
    out = tmp_path / "spread.json"
    cmd = [sys.executable, "benchmark/task_spread.py", "--runs", str(a), str(b)]
    subprocess.run([*cmd, "--out", str(out), "--commit", "abc"], cwd=ROOT, check=True)
    record = json.loads(out.read_text())
    assert record["device"] == "GPU X" and record["commit"] == "abc"
    assert record["metrics"]["repeats"] == 2
    assert record["metrics"]["tasks"]["qa"]["median"] == pytest.approx(2.0)
    assert "benchmark/task_spread.py --runs" in record["command"]
    bad = subprocess.run(
        [*cmd[:3], str(tmp_path), "--out", str(out)], cwd=ROOT, capture_output=True, text=True
    )
    assert bad.returncode == 2 and "e2e_sweep.json does not exist" in bad.stderr


def test_a_task_without_one_backend_is_refused(tmp_path):
    d = _run(tmp_path, "a", {"qa": (100.0, 150.0)}, 0.3)
    record = json.loads((d / "e2e_sweep.json").read_text())
    record["metrics"]["tasks"]["qa"]["offload"]["tok_s"] = 0.0
    (d / "e2e_sweep.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match="no throughput for \\['offload'\\]"):
        run_tasks(d)
