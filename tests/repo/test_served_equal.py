"""``benchmark/served_equal.py`` (device stage ``served_equal``): under
SGLANG_ECHO_BATCH_INVARIANT=1 both servers give every request the same tokens at rate inf,
where they decode different batches. On the CPU: the whole pipeline at smoke sizes (the
servers inherit the setting, the record says so; the decode node's admission time comes
by part), and the equality count from runs that differ in one request."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmark.served_equal import combine
from server_utils import free_port

ROOT = Path(__file__).resolve().parents[2]


def _run(rate_ids: list[list[int]], batch: float) -> dict:
    return {"output_ids": rate_ids, "mean_decode_batch": batch, "output_throughput": 10.0}


def test_one_request_apart_makes_outputs_unequal() -> None:
    same = [[1, 2, 3], [4, 5]]
    runs = {"no-offload": {"inf": _run(same, 3.0)}, "offload": {"inf": _run(same, 14.0)}}
    metrics = combine(runs, batch_invariant=True)
    assert metrics["outputs_equal"] is True and metrics["outputs_equal_by_rate"] == {"inf": [2, 2]}
    assert metrics["mean_decode_batch"] == {"no-offload": {"inf": 3.0}, "offload": {"inf": 14.0}}
    runs["offload"]["inf"] = _run([[1, 2, 3], [4, 6]], 14.0)
    metrics = combine(runs, batch_invariant=True)
    assert metrics["outputs_equal"] is False and metrics["outputs_equal_by_rate"] == {"inf": [1, 2]}
    runs["offload"]["inf"] = {"output_ids": None}
    assert combine(runs, batch_invariant=False)["outputs_equal"] is None  # nothing to compare


def test_served_equal_smoke(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "SMOKE": "1",
        "RATES": "inf",
        "NUM_PROMPTS": "8",
        "PYTHON": sys.executable,
        "E2E_WORK": str(tmp_path / "w"),
        "SGLANG_ECHO_BATCH_INVARIANT": "1",
        # its own port and pid files: another sweep test may run beside it (pytest -n 2)
        "PORT": str(free_port()),
        "E2E_PID_DIR": str(tmp_path / "pids"),
    }
    sweep, out = tmp_path / "sweep", tmp_path / "served_equal.json"
    for cmd in (
        ["bash", "benchmark/e2e_sweep.sh", str(sweep)],
        [sys.executable, "-m", "benchmark.served_equal", "--sweep", str(sweep), "--out", str(out),
         "--commit", "abc", "--command", "the stage"],
    ):  # fmt: skip
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    record = json.loads(out.read_text())
    assert record["command"] == "the stage" and record["commit"] == "abc"
    assert record["device"] and record["date"]
    metrics = record["metrics"]
    assert metrics["batch_invariant"] is True
    assert metrics["outputs_equal"] is True and metrics["outputs_equal_by_rate"] == {"inf": [8, 8]}
    batches = metrics["mean_decode_batch"]
    assert batches["offload"]["inf"] > batches["no-offload"]["inf"]  # the batches differed
    log = (sweep / "infini" / "offload" / "server.log").read_text()
    assert "Traceback" not in log
    # The admissions' engine-thread time by part (/metrics -> the record): every part
    # timed, and together no more than the admissions' total.
    run = json.loads(
        (sweep / "infini" / "offload" / "req_rate_inf.jsonl").read_text().splitlines()[-1]
    )
    engine = run["server_engine"]

    def by_part(clock: str) -> dict[str, float]:
        prefix = f"admission_part_{clock}."
        return {k[len(prefix) :]: v for k, v in engine.items() if k.startswith(prefix)}

    parts, cpu = by_part("seconds"), by_part("cpu_seconds")
    assert set(parts) == {"row", "alloc", "place", "seed", "reserve", "submit"}
    assert all(v >= 0 for v in parts.values()) and parts["submit"] > 0
    assert sum(parts.values()) <= engine["admission_seconds"] + 1e-3
    assert set(metrics["admission_ms_parts_inf"]) == set(parts)
    # The same parts on the thread's CPU clock: never above their wall time.
    assert set(cpu) == set(parts) and sum(cpu.values()) > 0
    assert all(0 <= cpu[k] <= parts[k] + 1e-3 for k in parts)
    assert set(metrics["admission_cpu_ms_parts_inf"]) == set(parts)
    # What the decode steps held beside them: every step decoded requests that were running
    # (admitted), and a decode node's arrivals are counted (none can be negative).
    held = run["mean_step_requests"]
    assert set(held) == {"running", "arriving", "waiting"} and min(held.values()) >= 0
    assert held["running"] >= run["mean_decode_batch"] > 0
    assert run["mean_free_tokens"] > 0
