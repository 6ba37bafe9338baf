"""benchmark/decode_node_probe.py runs a decode node's engine without HTTP and reports its
clock (a CPU test at tiny sizes; moved from tests/test_engine_diagnostics.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _probe(tmp_path: Path, *args: str) -> dict:
    """The probe over a tiny worker on the CPU, two layers; returns its clock."""
    model = tmp_path / "worker"
    env = {"PYTHONPATH": str(ROOT / "python")}
    spec = [sys.executable, "-m", "benchmark.study.worker_spec", "--out", str(model)]
    spec += ["--layers", "2", "--smoke", "--vocab", "300", "--max-position", "4096"]
    subprocess.run(spec, check=True, capture_output=True, env=env, cwd=ROOT)
    out = tmp_path / "clock.json"
    probe = [sys.executable, "benchmark/decode_node_probe.py", "--model", str(model)]
    probe += ["--backend", "echo", "--context", "1024", "--pool", "5000", "--dev-cache", "600"]
    probe += ["--device", "cpu", "--out", str(out), *args]
    done = subprocess.run(probe, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def test_decode_node_probe_reports_the_engine_clock(tmp_path):
    clock = _probe(
        tmp_path, "--num-prompts", "3", "--min-len", "500", "--max-len", "800", "--output-len", "4"
    )
    assert clock["output_tokens"] == 3 * 4 and clock["decode_steps"] >= 3
    assert clock["temperature"] == 0.0  # greedy, as the serving benchmark's client asks
    assert clock["device"] == "cpu" and clock["resolve_overlap"] > 1  # the default batch
    assert clock["phase_s"]["admit"] > 0 and clock["phase_s"]["prefill"] == 0  # a decode node
    assert all(clock["phase_cpu_s"][k] <= clock["phase_s"][k] + 1e-3 for k in clock["phase_s"])


def test_decode_node_probe_traces_a_window_of_decode_steps(tmp_path):
    """--trace profiles the decode steps it names (CPU activity here: no device summary)."""
    args = ["--num-prompts", "2", "--min-len", "300", "--max-len", "400", "--output-len", "6"]
    args += ["--trace", str(tmp_path / "trace"), "--trace-after", "2", "--trace-steps", "2"]
    window = _probe(tmp_path, *args)["traced_window"]
    assert window["decode_steps"] >= 2 and window["seconds"] > 0
    assert (tmp_path / "trace" / "trace.json").stat().st_size > 0


def test_decode_node_probe_runs_the_copy_engine_readback_arm(tmp_path):
    """--readback torch: the A/B's other arm decodes the same tokens' count (sampled
    requests here: --temperature runs the sampler's race too)."""
    args = ["--num-prompts", "2", "--min-len", "300", "--max-len", "400", "--output-len", "3"]
    clock = _probe(tmp_path, *args, "--readback", "torch", "--temperature", "0.8")
    assert clock["readback"] == "torch" and clock["output_tokens"] == 2 * 3
    assert clock["temperature"] == 0.8


def test_decode_node_probe_reads_the_switches_from_the_environment():
    """An A/B of an ECHO switch (SGLANG_ECHO_PDL=0, SGLANG_ECHO_RESOLVE_OVERLAP=0) through the
    probe gets the switch; the backend and device cache stay the flags'."""
    from benchmark.decode_node_probe import probe_echo_config
    from sglang_echo.config import DEFAULT_RESOLVE_OVERLAP_FROM

    env = {"SGLANG_ECHO_PDL": "0", "SGLANG_ECHO_RESOLVE_OVERLAP": "0", "NSA_KV_OFFLOAD": "0"}
    env["NSA_DEV_CACHE_SIZE"] = "1000"
    cfg = probe_echo_config(True, 600, env)
    assert (cfg.pdl, cfg.resolve_overlap) == (False, 0)
    assert (cfg.offload, cfg.dev_cache_size) == (True, 600)
    default = probe_echo_config(False, 260000, {})
    assert (default.pdl, default.offload) == (True, False)
    assert default.resolve_overlap == DEFAULT_RESOLVE_OVERLAP_FROM
    small = probe_echo_config(True, 600, {})  # the reserve follows the flags' cache size
    assert small.eviction_reserve < default.eviction_reserve
