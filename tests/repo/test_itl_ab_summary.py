"""benchmark/itl_ab_summary.py folds the itl_ab stage's probe clocks into one record
(synthetic clocks here: the arithmetic and the refusals)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from benchmark.itl_ab_summary import decode_wall_ms, main


def _clock(batch: int, device_ms: float, seconds: float, receive: float, steps: int = 100) -> dict:
    return {
        "device": "GPU-X",
        "num_prompts": batch,
        "seconds": seconds,
        "decode_steps": steps,
        "phase_s": {"admit": 0.01, "receive": receive, "decode": 0.2},
        "device_ms_per_step": device_ms,
        "wall_ms_per_step": 1e3 * seconds / steps,
    }


def _write(folder: Path, name: str, clock: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps(clock))


def _args(tmp_path: Path, *runs: Path) -> list[str]:
    return [
        "--runs", *map(str, runs), "--out", str(tmp_path / "rec.json"),
        "--measured-by", "bash benchmark/device_session.sh OUTDIR itl_ab",
        "--device", "GPU-X", "--runs-commit", "a" * 40,
    ]  # fmt: skip


def test_each_arm_over_the_base_per_batch_with_its_spread(tmp_path):
    b1, b16 = tmp_path / "b1", tmp_path / "b16"
    _write(b1, "echo_1.json", _clock(1, 6.0, 0.71, 0.1))
    _write(b1, "echo_2.json", _clock(1, 6.2, 0.73, 0.1))
    _write(b1, "echo_X_0_1.json.txt", _clock(1, 5.8, 0.69, 0.1))  # a committed log's name
    _write(b16, "echo_1.json", _clock(16, 10.0, 1.2, 0.3))
    _write(b16, "no-offload_1.json", _clock(16, 9.0, 1.0, 0.05))
    args = _args(tmp_path, b1, b16)
    record = main(args)
    assert shlex.split(record["command"])[2:] == args  # reruns as written, spaces and all
    assert json.loads((tmp_path / "rec.json").read_text()) == record
    assert record["command"].startswith("python3 benchmark/itl_ab_summary.py --runs ")
    by = record["metrics"]["by_batch"]
    echo1 = by["1"]["arms"]["echo"]
    assert echo1["rounds"] == 2 and echo1["device_ms_per_step"]["median"] == pytest.approx(6.1)
    assert echo1["device_ms_per_step"]["spread"] == pytest.approx(0.2 / 6.1, abs=1e-4)
    assert by["1"]["over_echo"]["echo_X_0"]["device_ms_per_step"] == pytest.approx(
        5.8 / 6.1, abs=1e-4
    )
    # the decode-only wall leaves the arrival out: (0.69 - 0.01 - 0.1) s over 100 steps
    assert by["1"]["arms"]["echo_X_0"]["decode_wall_ms_per_step"]["median"] == pytest.approx(5.8)
    over = by["16"]["over_echo"]["no-offload"]
    assert over["wall_ms_per_step"] == pytest.approx(1.0 / 1.2, abs=1e-4)
    assert decode_wall_ms(_clock(16, 9.0, 1.0, 0.05)) == pytest.approx(9.4)


def test_clocks_without_device_time_or_of_another_device_are_refused(tmp_path):
    cpu = tmp_path / "cpu"
    _write(cpu, "echo_1.json", _clock(1, 0.0, 1.0, 0.1))
    with pytest.raises(SystemExit, match="not a CUDA-graph run"):
        main(_args(tmp_path, cpu))
    other = tmp_path / "other"
    _write(other, "echo_1.json", {**_clock(1, 6.0, 1.0, 0.1), "device": "GPU-Y"})
    with pytest.raises(SystemExit):  # argparse's error: the clocks name another device
        main(_args(tmp_path, other))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit, match=r"no ARM_ROUND\.json"):
        main(_args(tmp_path, empty))
