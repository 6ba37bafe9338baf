"""``SMOKE=1 bash benchmark/e2e_sweep.sh OUT`` on the CPU: the study's worker served as a
decode node with the fake transfer backend, no-offload then ECHO, one benchmark rate,
and a record with command, device and date naming both runs (the GPU sweep's pipeline,
end to end, at tiny sizes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_e2e_sweep_smoke(tmp_path):
    env = {**os.environ, "SMOKE": "1", "PYTHON": sys.executable, "E2E_WORK": str(tmp_path / "w")}
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", "benchmark/e2e_sweep.sh", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    record = json.loads((out / "e2e_sweep.json").read_text())
    assert record["device"] == "cpu" and record["command"].startswith("python -m sglang_echo")
    assert record["sweeps"] == [f"bash benchmark/e2e_sweep.sh {out}"]
    for mode in ("no-offload", "offload"):
        line = (out / "infini" / mode / "req_rate_inf.jsonl").read_text().splitlines()[-1]
        assert json.loads(line)["completed"] == 4
    for mode, backend in (("no-offload", "no-offload"), ("offload", "echo")):
        first = (out / "infini" / mode / "server.log").read_text().splitlines()[0]
        assert first.startswith(f"sglang-echo: {backend} on cpu")
        assert first.endswith("PD decode node, fake transfer (locality synthetic-keys:0.9)")
