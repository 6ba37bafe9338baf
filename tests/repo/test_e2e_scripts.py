"""The three e2e sweep scripts run end to end on a tiny workload (ENGINE=echo, CPU):
no-offload then offload, request rates 4 and inf, every result file written, every
server they started stopped. The stop scripts touch only pid-file processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmark.make_tasks import write_tasks
from scripts.make_tiny_checkpoint import TinySpec, make_tiny_checkpoint
from server_utils import free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ["e2e_test_pd_infini.sh", "e2e_test_pd_infini_task.sh", "e2e_test_mix_sharegpt.sh"]
TINY = [
    "--request-rates", "4,inf", "--num-prompts", "3", "--context-length", "192",
    "--max-output-len", "6", "--offload-nsa-dev-cache-size", "128",
    "--max-running-requests", "8", "--chunked-prefill-size", "64",
    "--no-offload-max-total-tokens", "1500", "--offload-max-total-tokens", "1500",
]  # fmt: skip


def _env(tmp_path: Path, model: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NSA_", "SGLANG_NSA"))}
    env.update(
        ENGINE="echo",
        DSV32W4=str(model),
        PYTHON=sys.executable,
        E2E_WORK=str(tmp_path / "work"),
        E2E_PID_DIR=str(tmp_path / "pids"),
        PORT=str(free_port()),
        SERVER_START_TIMEOUT="120",
        **extra,
    )
    return env


def _run(script: str, args: list[str], env: dict, timeout: int = 300):
    return subprocess.run(
        ["bash", str(ROOT / script), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _check_run(res: Path, backend: str, prompts: int, task: str | None = None) -> None:
    folder = res / task if task else res
    for rate in ("4", "inf"):
        assert (folder / f"req_rate_{rate}.log").is_file()
        rec = json.loads((folder / f"req_rate_{rate}.jsonl").read_text().splitlines()[-1])
        assert rec["completed"] == prompts and rec["failed"] == 0
        assert rec["kv_backend"] == backend
        assert rec["request_rate"] == float(rate)
    assert "ready to roll" in (res / "server.log").read_text()


@pytest.mark.parametrize("script", SCRIPTS)
def test_help(script):
    proc = subprocess.run(["bash", str(ROOT / script), "--help"], capture_output=True, text=True)
    assert proc.returncode == 0
    for flag in ("--request-rates", "--offload-nsa-dev-cache-size", "--no-offload-res-dir"):
        assert flag in proc.stdout


def test_infini_sweep(tmp_path, small_checkpoint):
    res = {m: tmp_path / "infini-318" / f"{m}-0101" for m in ("no-offload", "offload")}
    args = [*TINY, "--no-offload-res-dir", str(res["no-offload"])]
    args += ["--offload-res-dir", str(res["offload"])]
    proc = _run(SCRIPTS[0], args, _env(tmp_path, small_checkpoint, INFINI_DATASET=""))
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check_run(res["no-offload"], "no-offload", 3)
    _check_run(res["offload"], "echo", 3)
    assert not list((tmp_path / "pids").glob("*.pid"))  # every server stopped


def test_infini_sweep_with_mtp(tmp_path):
    """``--speculative-num-steps 1``: both decode nodes run MTP rounds (their arrivals bring
    the NextN layer's KV and first draft), each run records its accept length, and the
    offload node gives the no-offload node's tokens."""
    model = make_tiny_checkpoint(
        tmp_path / "mtp", TinySpec(num_nextn_predict_layers=1, index_topk=32)
    )
    res = {m: tmp_path / f"{m}-mtp" for m in ("no-offload", "offload")}
    args = [*TINY, "--speculative-num-steps", "1", "--offload-nsa-dev-cache-size", "512"]
    args += [
        "--no-offload-res-dir",
        str(res["no-offload"]),
        "--offload-res-dir",
        str(res["offload"]),
    ]
    proc = _run(SCRIPTS[0], args, _env(tmp_path, model, INFINI_DATASET=""))
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check_run(res["no-offload"], "no-offload", 3)
    _check_run(res["offload"], "echo", 3)
    recs = {
        m: json.loads((res[m] / "req_rate_inf.jsonl").read_text().splitlines()[-1]) for m in res
    }
    for rec in recs.values():
        assert 1.0 <= rec["spec_accept_length"] <= 2.0
    assert recs["offload"]["output_ids"] == recs["no-offload"]["output_ids"]


def test_mtp_flag_is_refused_for_the_plugin(tmp_path):
    env = _env(tmp_path, tmp_path) | {"ENGINE": "sglang"}
    proc = _run(SCRIPTS[0], [*TINY, "--speculative-num-steps", "1"], env)
    assert proc.returncode == 2
    assert "does not run speculative decoding" in proc.stderr


def test_task_sweep(tmp_path, small_checkpoint):
    tasks = tmp_path / "tasks"
    write_tasks(tasks, num=3, context_tokens=400, tasks=("passkey", "kv_retrieval"))
    res = {m: tmp_path / "infini-task" / f"{m}-0101" for m in ("no-offload", "offload")}
    args = [*TINY, "--no-offload-res-dir", str(res["no-offload"])]
    args += ["--offload-res-dir", str(res["offload"])]
    env = _env(tmp_path, small_checkpoint, TASK_DATASET_DIR=str(tasks))
    proc = _run(SCRIPTS[1], args, env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for task in ("passkey", "kv_retrieval"):
        _check_run(res["no-offload"], "no-offload", 3, task)
        _check_run(res["offload"], "echo", 3, task)


def test_sharegpt_sweep(tmp_path, small_checkpoint):
    res = {m: tmp_path / "sharegpt-100" / f"{m}-0101" for m in ("no-offload", "offload")}
    args = [*TINY, "--warmup-requests", "1", "--no-offload-res-dir", str(res["no-offload"])]
    args += ["--offload-res-dir", str(res["offload"])]
    proc = _run(SCRIPTS[2], args, _env(tmp_path, small_checkpoint))
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check_run(res["no-offload"], "no-offload", 3)
    _check_run(res["offload"], "echo", 3)


def test_stop_scripts_touch_only_recorded_processes(tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    recorded = subprocess.Popen(["setsid", "sleep", "60"])
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        (pids / "server.pid").write_text(f"{recorded.pid}\n")
        env = {**os.environ, "E2E_PID_DIR": str(pids), "KILL_GRACE_S": "5", "VRAM_WAIT_S": "10"}
        for script in ("killall_sglang.sh", "ensure_vram_clear.sh"):
            proc = subprocess.run(
                ["bash", str(ROOT / "scripts" / script)], env=env, capture_output=True, text=True
            )
            assert proc.returncode == 0, proc.stderr
        assert recorded.wait(timeout=10) is not None
        time.sleep(0.2)
        assert bystander.poll() is None  # not recorded: left alone
        assert not list(pids.glob("*.pid"))
    finally:
        for p in (recorded, bystander):
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
                p.wait()
