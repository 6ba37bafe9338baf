"""Every ``sglang.launch_server`` line that the three e2e scripts build with ENGINE=sglang
(no-offload and offload, i.e. without and with NSA_KV_OFFLOAD=1) resolves under sglang
0.5.23's real launcher with the plugin installed.

The lines are taken from the scripts themselves: each script runs to the end with a
``python3`` on PATH that records its command line instead of starting a server
(launch_recorder.py). Each recorded line is then parsed and resolved as
``python -m sglang.launch_server`` does (dry_parse.py), against a DeepSeek-V3.2-shaped
config. Only what a CPU machine cannot provide is added: ``--device cpu`` and
``--skip-tokenizer-init`` (the config folder has no tokenizer).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import plugin_testenv  # first: sets the process up before sglang loads
import pytest

plugin_testenv.require_sglang()

from test_plugin_args import MODEL_CONFIG, collect, field, run_driver  # noqa: E402

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
SCRIPTS = {
    "e2e_test_pd_infini.sh": "pd",
    "e2e_test_pd_infini_task.sh": "pd",
    "e2e_test_mix_sharegpt.sh": "single",
}
CPU_ONLY = ["--device", "cpu", "--skip-tokenizer-init"]


def run_script(script: str, tmp: Path, model: Path) -> list[dict]:
    """Run ``script`` with ENGINE=sglang and the recording python3; its records in order."""
    records = tmp / "records" / script
    records.mkdir(parents=True)
    stub = tmp / "bin"
    stub.mkdir(exist_ok=True)
    python3 = stub / "python3"
    python3.write_text(
        f'#!/usr/bin/env bash\nexec "{sys.executable}" "{HERE / "launch_recorder.py"}" "$@"\n'
    )
    python3.chmod(0o755)
    tasks = tmp / "tasks"
    tasks.mkdir(exist_ok=True)
    (tasks / "longbook_qa_eng.jsonl").write_text("{}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NSA_", "SGLANG_"))}
    env.update(
        ENGINE="sglang",
        DSV32W4=str(model),
        PATH=f"{stub}:{env['PATH']}",
        PYTHON=str(python3),  # the benchmark client is recorded too
        E2E_WORK=str(tmp / "work" / script),
        E2E_PID_DIR=str(tmp / "pids" / script),
        E2E_RECORD_DIR=str(records),
        TASK_DATASET_DIR=str(tasks),
        SERVER_START_TIMEOUT="60",
        KILL_GRACE_S="5",
    )
    res = tmp / "res" / script
    args = ["--request-rates", "inf", "--num-prompts", "1"]
    args += ["--no-offload-res-dir", str(res / "no"), "--offload-res-dir", str(res / "off")]
    proc = subprocess.run(
        ["bash", str(ROOT / script), *args],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(p.read_text()) for p in sorted(records.iterdir())]


@pytest.fixture(scope="module")
def launch_lines(tmp_path_factory):
    """Per script: its recorded calls; then every server line, resolved."""
    tmp = tmp_path_factory.mktemp("e2e_lines")
    model = tmp / "dsv32"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(MODEL_CONFIG))
    calls = {script: run_script(script, tmp, model) for script in SCRIPTS}
    servers = [
        (script, call)
        for script, script_calls in calls.items()
        for call in script_calls
        if call["module"] == "sglang.launch_server"
    ]
    by_env: dict[str, list] = {"on": [], "off": []}
    for script, call in servers:
        offload = call["env"].get("NSA_KV_OFFLOAD") == "1"
        by_env["on" if offload else "off"].append((script, call))
    procs = {}
    for name, items in by_env.items():
        # NSA_KV_OFFLOAD decides at plugin load (once per process); the other ECHO
        # settings are read at resolution, so they go with each line.
        cases = [
            {
                "argv": [*call["argv"], *CPU_ONLY],
                "env": {k: v for k, v in call["env"].items() if k.startswith("NSA_")},
            }
            for _, call in items
        ]
        env = {"NSA_KV_OFFLOAD": "1"} if name == "on" else {}
        procs[name] = run_driver(cases, env, tmp, f"lines_{name}")
    resolved = []
    for name, proc in procs.items():
        state, results = collect(proc)
        assert state["echo_installed"] == (name == "on")
        resolved += [(*item, result) for item, result in zip(by_env[name], results, strict=True)]
    return {"calls": calls, "resolved": resolved}


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_scripts_launch_one_server_per_mode(launch_lines, script):
    calls = launch_lines["calls"][script]
    servers = [c for c in calls if c["module"] == "sglang.launch_server"]
    assert [c["env"].get("NSA_KV_OFFLOAD") for c in servers] == ["0", "1"]
    assert not [c for c in calls if c["module"] == "sglang_router.launch_router"]
    assert any(c["module"] == "sglang_echo.bench_serving" for c in calls)
    for call in servers:
        argv = call["argv"]
        assert "--enable-dp-attention" in argv  # the artifact's deployment
        if SCRIPTS[script] == "pd":  # 0.5.23's decode-only benchmark topology
            assert argv[argv.index("--disaggregation-mode") + 1] == "decode"
            assert argv[argv.index("--disaggregation-transfer-backend") + 1] == "fake"


def test_every_launch_line_resolves(launch_lines):
    resolved = launch_lines["resolved"]
    assert len(resolved) == 2 * len(SCRIPTS)
    for script, call, result in resolved:
        mode = "offload" if call["env"].get("NSA_KV_OFFLOAD") == "1" else "no-offload"
        assert "fields" in result, f"{script} {mode}: {result.get('error')}\n{call['argv']}"
        assert field(result, "attn_dp_size") == 8 and field(result, "tp_size") == 8
        assert field(result, "enable_hisparse") is (mode == "offload")
        if mode == "offload":
            config = json.loads(field(result, "hisparse_config"))
            assert config["echo_dev_cache"] == int(call["env"]["NSA_DEV_CACHE_SIZE"])
