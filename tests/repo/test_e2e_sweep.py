"""``SMOKE=1 TASKS=1 SHAREGPT=1 bash benchmark/e2e_sweep.sh OUT`` on the CPU: the study's
worker served as a decode node with the fake transfer backend (InfiniteBench-like prompts,
then the four Figure-14 tasks) and as one prefill + decode server (ShareGPT-like),
no-offload then ECHO, one benchmark rate each, and a record with command, device and
date (the GPU sweeps' pipeline, end to end, at tiny sizes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmark.make_tasks import FIGURE_14_TASKS
from server_utils import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_e2e_sweep_smoke(tmp_path):
    env = {**os.environ, "SMOKE": "1", "TASKS": "1", "SHAREGPT": "1", "PYTHON": sys.executable}
    env["E2E_WORK"] = str(tmp_path / "w")
    env["INFINI_INPUT_RANGE"] = "100000,108000"  # the study's lengths (scaled to the context)
    # its own port and pid files: another sweep test may run beside it (pytest -n 2)
    env.update(PORT=str(free_port()), E2E_PID_DIR=str(tmp_path / "pids"))
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", "benchmark/e2e_sweep.sh", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    record = json.loads((out / "e2e_sweep.json").read_text())
    assert record["device"] == "cpu" and record["command"].startswith("python -m sglang_echo")
    (sweep,) = record["sweeps"]  # every knob's value, then the command
    assert sweep.startswith("SMOKE=1 LAYERS=2 RATES=inf ") and "TASKS=1" in sweep
    assert " INFINI_INPUT_RANGE=100000,108000 " in sweep
    assert sweep.endswith(f" bash benchmark/e2e_sweep.sh {out}")
    runs = [("infini", "")] + [("tasks", t) for t in FIGURE_14_TASKS] + [("sharegpt", "")]
    for root, task in runs:
        for mode in ("no-offload", "offload"):
            path = out / root / mode / task / "req_rate_inf.jsonl"
            run = json.loads(path.read_text().splitlines()[-1])
            assert run["completed"] == 4, path
            # the range reaches the InfiniteBench-like prompts only (the tasks bring files)
            lengths = [100000, 108000] if root == "infini" else None
            assert run.get("infinitebench_input_range") == lengths, path
            # The server's engine clock over the run: model steps took time; on the decode
            # node every request came by a transfer, and nothing was prefilled.
            engine = run["server_engine"]
            assert engine["engine_seconds.decode"] > 0 and engine["decode_steps"] > 0, path
            if root != "sharegpt":
                assert engine["transfers"] == 4 and engine["engine_seconds.prefill"] == 0, path
    assert set(record["metrics"]["tasks"]) == set(FIGURE_14_TASKS)
    assert (out / "plots" / "per_task_throughput.png").is_file()
    for mode, backend in (("no-offload", "no-offload"), ("offload", "echo")):
        first = (out / "infini" / mode / "server.log").read_text().splitlines()[0]
        assert first.startswith(f"sglang-echo: {backend} on cpu")
        # The study's worker and its locality knob come through the server's one extension
        # point, the benchmarks' loader (scripts/e2e_lib.sh passes it).
        assert "model from --model-loader benchmark.study.loader:load" in first
        assert first.endswith("PD decode node, fake transfer (locality synthetic-keys:0.9)")
