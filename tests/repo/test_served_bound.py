"""benchmark/served_bound.py: the ideal schedule of a served run's own workload."""

from __future__ import annotations

import json

import pytest

from benchmark import served_bound, served_vs_study


def _run(
    outputs: list[int], ms_by_batch: dict[int, float], held: int, transfer_s: float, thr: float
):
    steps = {str(b): 10.0 for b in ms_by_batch}
    return {
        "output_lens": outputs,
        "output_throughput": thr,
        "decode_device_steps_by_batch": steps,
        "decode_device_seconds_by_batch": {
            str(b): 10.0 * ms / 1e3 for b, ms in ms_by_batch.items()
        },
        "server_engine": {"transfers": len(outputs), "transfer_seconds": transfer_s * len(outputs)},
        "counter_series": {"columns": ["t_s", "running"], "rows": [[0.5, held - 0.4], [1.0, held]]},
    }


def test_step_line_recovers_a_linear_step_time():
    run = _run([2], {1: 5.5, 2: 6.0, 4: 7.0}, 2, 0.0, 1.0)
    base, per = served_bound.step_line(run)
    assert base == pytest.approx(5.0) and per == pytest.approx(0.5)


def test_replay_fills_to_the_cap_and_drains():
    # Three requests of 3 tokens (2 decode steps each), at most 2 at once, 10 ms a step.
    seconds, batch = served_bound.replay([3, 3, 3], 0.0, 2, (10.0, 0.0))
    assert seconds == pytest.approx(0.04)
    assert batch == pytest.approx(1.5)  # batches 2, 2, 1, 1


def test_replay_waits_for_each_prompt_to_arrive():
    # The second prompt's KV is in at 0.2 s; the first finished its one step at 0.11 s.
    seconds, batch = served_bound.replay([2, 2], 0.1, 4, (10.0, 0.0))
    assert seconds == pytest.approx(0.21)
    assert batch == pytest.approx(1.0)


def test_bound_takes_the_ratio_apart():
    ms = {1: 10.0, 2: 10.0, 3: 10.0}
    runs = {
        "no-offload": _run([11] * 4, ms, 1, 0.0, 50.0),  # 40 steps of 10 ms: 110 tok/s ideal
        "offload": _run([11] * 4, ms, 4, 0.0, 300.0),  # 10 steps: 440 tok/s ideal
    }
    out = served_bound.bound(runs, study_ratio=5.0, served_ratio=6.0)
    ramp = out["no_ramp"]
    assert ramp["engines"]["offload"]["output_tok_per_s"] == pytest.approx(440.0)
    assert ramp["engines"]["no-offload"]["output_tok_per_s"] == pytest.approx(110.0)
    assert ramp["ideal_ratio"] == pytest.approx(4.0)
    assert ramp["bound_over_study"] == pytest.approx(0.8)
    assert ramp["served_over_bound"] == pytest.approx(1.5)
    assert ramp["engines"]["offload"]["served_over_ideal"] == pytest.approx(300 / 440, abs=1e-4)
    assert out["with_ramp"] == out["no_ramp"]  # nothing to arrive: the same schedule


def test_bound_is_none_without_the_counters():
    runs = {"no-offload": _run([3], {1: 1.0}, 1, 0.0, 1.0), "offload": {"output_lens": [3]}}
    assert served_bound.bound(runs, 2.0, 2.0) is None


def _record_folder(tmp_path, runs: dict) -> None:
    (tmp_path / "served_vs_study.json").write_text(
        json.dumps(
            {
                "commit": "abc",
                "device": "GPU X",
                "date": "d",
                "command": "c",
                "metrics": {"study_ratio": 5.0, "served_ratio_inf": 3.0, "served_over_study": 0.6},
            }
        )
    )
    for eng, run in runs.items():
        d = tmp_path / "sweep" / "infini" / eng
        d.mkdir(parents=True)
        (d / "req_rate_inf.jsonl").write_text(json.dumps(run) + "\n")


def test_cli_writes_a_record_with_its_command_and_source(tmp_path):
    ms = {1: 10.0, 2: 11.0}
    _record_folder(
        tmp_path,
        {
            "no-offload": _run([5] * 3, ms, 1, 0.01, 50.0),
            "offload": _run([5] * 3, ms, 2, 0.02, 90.0),
        },
    )
    out = tmp_path / "bound.json"
    rec = served_bound.main(["--record", str(tmp_path), "--out", str(out), "--commit", "def"])
    assert json.loads(out.read_text()) == rec
    assert rec["commit"] == "def" and rec["date"] and "GPU X" in rec["device"]
    assert rec["command"].startswith("python3 benchmark/served_bound.py --record")
    assert rec["source"]["commit"] == "abc"
    with_ramp, no_ramp = rec["metrics"]["with_ramp"], rec["metrics"]["no_ramp"]
    # The arrivals can only slow the ideal schedule down.
    for eng in ("offload", "no-offload"):
        assert (
            with_ramp["engines"][eng]["output_tok_per_s"]
            <= no_ramp["engines"][eng]["output_tok_per_s"]
        )


def test_cli_says_what_is_missing(tmp_path, capsys):
    with pytest.raises(SystemExit):
        served_bound.main(["--record", str(tmp_path), "--out", str(tmp_path / "x.json")])
    assert "served_vs_study.json does not exist" in capsys.readouterr().err


def test_served_vs_study_carries_the_bound():
    ms = {1: 10.0, 2: 10.0}
    runs = {
        "no-offload": {"inf": _run([3] * 2, ms, 1, 0.0, 50.0)},
        "offload": {"inf": _run([3] * 2, ms, 2, 0.0, 90.0)},
    }
    study = {"metrics": {"ratio_paper_all_hbm": 2.0}}
    m = served_vs_study.combine(study, runs)
    assert m["schedule_bound_inf"]["no_ramp"]["ideal_ratio"] == pytest.approx(2.0)
