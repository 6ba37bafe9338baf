"""The engine's diagnostics: ECHO_ENGINE_PROFILE writes a profile of the engine thread when
it stops, and benchmark/decode_node_probe.py runs a decode node's engine without HTTP and
reports its clock (CPU tests at tiny sizes)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from server_utils import make_serving
from sglang_echo.config import EchoConfig
from sglang_echo.runtime.engine_loop import PROFILE_ENV, EngineLoop
from sglang_echo.runtime.request import SamplingParams, ServeRequest

ROOT = Path(__file__).resolve().parents[1]


def test_engine_profile_is_written_at_stop(small_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv(PROFILE_ENV, str(tmp_path / "engine-{pid}.prof"))
    serving = make_serving(small_checkpoint, EchoConfig(), max_total_tokens=400)
    loop = EngineLoop(serving.scheduler)
    done = []
    req = ServeRequest([5, 6, 7], rid="p", params=SamplingParams(max_new_tokens=3))
    req.on_output = lambda event: done.append(event)
    loop.start()
    loop.submit(req)
    deadline = time.monotonic() + 60
    while not req.finished and time.monotonic() < deadline:
        time.sleep(0.02)
    loop.stop()
    assert req.finished and len(req.output) == 3
    (prof,) = tmp_path.glob("engine-*.prof")
    assert prof.name != "engine-{pid}.prof"  # the process id went in
    text = Path(str(prof) + ".txt").read_text()
    assert "_serve" in text and "cumulative" in text  # the engine loop's own frames


def test_decode_node_probe_reports_the_engine_clock(tmp_path):
    model = tmp_path / "worker"
    env = {"PYTHONPATH": str(ROOT / "python")}
    spec = [sys.executable, "-m", "benchmark.study.worker_spec", "--out", str(model)]
    spec += ["--layers", "2", "--smoke", "--vocab", "300", "--max-position", "4096"]
    subprocess.run(spec, check=True, capture_output=True, env=env, cwd=ROOT)
    out = tmp_path / "clock.json"
    probe = [sys.executable, "benchmark/decode_node_probe.py", "--model", str(model)]
    probe += ["--backend", "echo", "--num-prompts", "3", "--min-len", "500", "--max-len", "800"]
    probe += ["--output-len", "4", "--context", "1024", "--pool", "5000", "--dev-cache", "600"]
    probe += ["--device", "cpu", "--out", str(out)]
    done = subprocess.run(probe, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    clock = json.loads(out.read_text())
    assert clock["output_tokens"] == 3 * 4 and clock["decode_steps"] >= 3
    assert clock["phase_s"]["admit"] > 0 and clock["phase_s"]["prefill"] == 0  # a decode node
    assert all(clock["phase_cpu_s"][k] <= clock["phase_s"][k] + 1e-3 for k in clock["phase_s"])
