"""benchmark/mtp_bound.py: an MTP study's batch-1 round taken apart (synthetic records,
so every share is known)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmark.mtp_bound import batch1_bound, round_parts

ROOT = Path(__file__).resolve().parents[2]


def _repeat(step: float, rnd: float, verify: float, tokens: float) -> dict:
    plain = {"tokens_per_s": 1e3 / step, "step_ms": step}
    spec = {"tokens_per_s": tokens * 1e3 / rnd, "round_ms": rnd, "verify_ms": verify}
    return {"plain": plain, "spec": spec | {"tokens_per_round": tokens}}


def test_round_parts_in_shares_of_a_plain_step():
    r = _repeat(step=5.0, rnd=7.5, verify=6.0, tokens=1.875)
    parts = round_parts(r["plain"], r["spec"], layers=8)
    assert parts["speedup"] == pytest.approx(1.875 * 5.0 / 7.5)
    assert parts["verify_over_step"] == pytest.approx(1.2)
    assert parts["draft_over_step"] == pytest.approx(0.3)
    assert parts["free_draft_bound"] == pytest.approx(1.875 / 1.2)  # a draft that costs nothing
    assert parts["one_layer_draft_estimate"] == pytest.approx(1.875 / (1.2 + 1 / 8))
    # at the goal's shares the speed-up is the goal
    assert 1.875 / (1.2 + parts["draft_over_step_for_goal"]) == pytest.approx(1.6)
    assert 1.875 / (parts["verify_over_step_for_goal"] + 0.3) == pytest.approx(1.6)
    with pytest.raises(ValueError, match="not a round"):
        round_parts(r["plain"], r["spec"] | {"verify_ms": 9.0}, layers=8)  # longer than the round


def test_batch1_bound_takes_medians_per_backend():
    batch1 = {
        "echo": [_repeat(5.0, 7.5, 6.0, 1.875), _repeat(5.0, 8.0, 6.0, 1.875), _repeat(5.0, 7.0, 6.0, 1.875)],
        "no-offload": [_repeat(4.0, 6.0, 5.0, 1.8)],
    }  # fmt: skip
    bound = batch1_bound(batch1, layers=8)
    assert bound["backends"]["echo"]["speedup"] == pytest.approx(1.875 * 5.0 / 7.5, abs=1e-4)
    assert bound["backends"]["no-offload"]["draft_over_step"] == pytest.approx(0.25)
    with pytest.raises(ValueError, match="no batch-1 repeats"):
        batch1_bound({"echo": batch1["echo"]}, layers=8)


def test_the_command_writes_a_record_and_refuses_a_folder_without_one(tmp_path):
    src = tmp_path / "mtp_study"
    src.mkdir()
    source = {
        "commit": "abc", "device": "GPU", "date": "2026-12-06", "command": "x",
        "config": {"layers": 8},
        "phases": {"batch1": {n: [_repeat(5.0, 7.5, 6.0, 1.875)] for n in ("echo", "no-offload")}},
    }  # fmt: skip
    (src / "mtp_study.json").write_text(json.dumps(source))
    out = tmp_path / "bound.json"
    cmd = [sys.executable, "benchmark/mtp_bound.py", "--record", str(src), "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    record = json.loads(out.read_text())
    assert record["source"]["commit"] == "abc" and record["device"].startswith("GPU (the runs)")
    assert record["metrics"]["backends"]["echo"]["speedup"] == pytest.approx(1.25)
    missing = [*cmd[:3], str(tmp_path / "nowhere"), *cmd[4:]]
    bad = subprocess.run(missing, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert bad.returncode == 2 and "the folder that holds mtp_study.json" in bad.stderr
