"""benchmark/served_vs_study.py: the served-against-engine record from a study record and a
sweep's per-rate runs (synthetic inputs; the device stage makes the real ones)."""

from __future__ import annotations

import json

import pytest

from benchmark import served_vs_study


def _run(thr: float, itl: float, ids: list[list[int]], **extra) -> dict:
    return {
        "output_throughput": thr,
        "median_itl_ms": itl,
        "p99_itl_ms": 2 * itl,
        "median_ttft_ms": 10.0,
        "p99_ttft_ms": 20.0,
        "output_ids": ids,
        **extra,
    }


def _write(tmp_path, runs: dict[str, dict[str, dict]], study: dict) -> tuple:
    (tmp_path / "study").mkdir()
    (tmp_path / "study" / "e2e_study.json").write_text(json.dumps(study))
    for eng, by_rate in runs.items():
        d = tmp_path / "sweep" / "infini" / eng
        d.mkdir(parents=True)
        for rate, rec in by_rate.items():
            (d / f"req_rate_{rate}.jsonl").write_text(json.dumps(rec) + "\n")
    return tmp_path / "study", tmp_path / "sweep"


def test_record_from_study_and_sweep(tmp_path):
    same, other = [[1, 2], [3, 4]], [[1, 2], [3, 5]]
    runs = {
        "no-offload": {
            "1": _run(90, 6.0, same),
            "inf": _run(300, 7.0, same, served_efficiency=0.7, steady_output_throughput=320),
        },
        "offload": {
            "1": _run(90, 6.3, same),
            "inf": _run(
                600,
                12.0,
                other,
                served_efficiency=0.5,
                steady_output_throughput=800,
                server_echo={"hit_rate": 0.95},
                admission_ms_p50=3.0,
                mean_decode_batch=12.0,
                mean_step_requests={"running": 15.0, "arriving": 3.0, "waiting": 40.0},
                mean_free_tokens=9000,
                server_engine={
                    "graph_captures_during_run": 0.0,
                    "triton_compiles": 2.0,
                    "decode_steps": 100.0,
                    "decode_device_seconds": 1.0,
                    "admissions": 4.0,
                    "admission_part_seconds.row": 0.0004,
                    "admission_part_seconds.reserve": 0.006,
                    "admission_part_cpu_seconds.row": 0.0004,
                    "admission_part_cpu_seconds.reserve": 0.002,
                },
                server_schedule={"overlap": True, "engine_process": False},
                input_lens=[1000, 3000],  # a mean prompt of 2000 tokens
                counter_series={
                    "columns": [
                        "t_s",
                        "decode_steps",
                        "mean_decode_batch",
                        "waiting",
                        "free_tokens",
                    ],
                    "rows": [
                        [0.5, 10, 4.0, 0.0, 9000],  # nothing waiting (the ramp)
                        [1.0, 30, 12.0, 5.0, 1000],  # waiting, less than a prompt free
                        [1.5, 20, 10.0, 5.0, 4000],  # waiting with room for one
                        [2.0, 0, None, 5.0, None],  # no decode step: not counted
                    ],
                },
            ),
        },
    }
    study = {
        "metrics": {
            "ratio_paper_all_hbm": 4.0,
            "hit_rate_per_layer": [0.96, 0.98],
            "hit_rate_from_admission": {"per_layer": [0.92, 0.94], "decode_steps": 149},
        },
        "runs": [  # ECHO's full-batch steps at batch 16, 8 ms each (2000 tok/s); a b1 run
            {"engine": "echo_paper", "phase": "full", "batch": 16, "step_ms_device": 8.0,
             "tokens_per_s_device": 2000.0},
            {"engine": "echo_paper", "phase": "b1", "batch": 1, "step_ms_device": 5.0,
             "tokens_per_s_device": 200.0},
        ],
    }  # fmt: skip
    s, w = _write(tmp_path, runs, study)
    out = tmp_path / "r.json"
    rec = served_vs_study.main(["--study", str(s), "--sweep", str(w), "--out", str(out),
                                "--commit", "abc"])  # fmt: skip
    m = rec["metrics"]
    assert json.loads(out.read_text())["commit"] == "abc"
    assert m["served_ratio_inf"] == 2.0 and m["served_over_study"] == 0.5
    assert m["steady_ratio_inf"] == 2.5
    assert m["itl_p50_ratio_rate1"] == pytest.approx(1.05)
    assert m["study_hit_rate"] == pytest.approx(0.97) and m["served_hit_rate"] == 0.95
    assert m["study_hit_rate_from_admission"] == {"hit_rate": 0.93, "decode_steps": 149}
    assert m["echo_served_efficiency"] == 0.5 and m["no_offload_served_efficiency"] == 0.7
    assert m["admission_ms_p50"] == 3.0 and m["graph_captures_during_run"] == 0
    # the one run whose server counted compiles (the others predate the counter: not 0)
    assert m["triton_compiles_during_run"] == 2.0
    assert m["admission_ms_parts_inf"] == {"row": 0.1, "reserve": 1.5}  # ms per admission
    assert m["admission_cpu_ms_parts_inf"] == {"row": 0.1, "reserve": 0.5}  # its CPU ms
    # Served ECHO against the study: batch 12 / 16, steps 8 / 10 ms, efficiency 0.5.
    f = m["throughput_factors"]["offload"]
    assert (f["batch"], f["step"], f["efficiency"]) == (0.75, 0.8, 0.5)
    assert f["product"] == 0.3 and f["measured"] == 0.3  # 600 / 2000 tok/s
    assert m["throughput_factors"]["no-offload"] is None  # no study runs, no counters
    assert (f["served_running"], f["served_arriving"], f["served_waiting"]) == (15.0, 3.0, 40.0)
    assert f["served_free_tokens"] == 9000
    limits = m["batch_limits_inf"]["offload"]
    assert limits["no_request_waiting"] == {"step_share": 0.167, "mean_batch": 4.0}
    assert limits["memory"] == {"step_share": 0.5, "mean_batch": 12.0}
    assert limits["other"] == {"step_share": 0.333, "mean_batch": 10.0}
    assert m["batch_limits_inf"]["no-offload"] is None  # its run has no series
    assert m["outputs_equal"] is False
    assert m["outputs_equal_by_rate"] == {"1": [2, 2], "inf": [1, 2]}
    assert m["outputs_equal_across_rates"] == {"no-offload": [2, 2], "offload": [1, 2]}
    assert m["latency"]["offload"]["inf"]["p99_itl_ms"] == 24.0
    assert m["server_schedule"] == {
        "no-offload": None,  # a record from before bench_serving wrote it
        "offload": {"overlap": True, "engine_process": False},
    }


def test_runs_without_ids_compare_nothing(tmp_path):
    runs = {"no-offload": {"inf": _run(1, 1, [None])}, "offload": {"inf": _run(2, 1, [[1]])}}
    s, w = _write(tmp_path, runs, {"metrics": {}})
    rec = served_vs_study.main(["--study", str(s), "--sweep", str(w), "--out", str(tmp_path / "r")])
    assert rec["metrics"]["outputs_equal"] is None and rec["metrics"]["served_over_study"] is None


def test_ingress_reads_when_the_prompts_reached_the_engine():
    """Half and all of a run's prompts taken in, from the per-interval ``received``."""
    columns = ["t_s", "decode_steps", "received"]
    served = {
        "input_lens": [100] * 8,
        "counter_series": {
            "columns": columns,
            "rows": [[0.5, 3, 2.0], [1.0, 4, 2.0], [1.5, 4, 0.0], [2.0, 5, 4.0], [2.5, 5, 0.0]],
        },
    }
    got = served_vs_study.ingress(served)
    assert got == {
        "prompts": 8,
        "received_half_s": 1.0,
        "received_all_s": 2.0,
        "received_per_s": 4.0,
    }
    # prompts still missing at the end: no "all" time; no series or no column: None
    served["counter_series"]["rows"][-2][2] = 3.0
    assert served_vs_study.ingress(served)["received_all_s"] is None
    assert served_vs_study.ingress({"input_lens": [1]}) is None
    assert (
        served_vs_study.ingress(
            {"input_lens": [1], "counter_series": {"columns": ["t_s"], "rows": [[0.5]]}}
        )
        is None
    )


def test_the_rate_one_step_ratio_compares_batches_both_ran_often_enough():
    echo = {
        "decode_device_seconds_by_batch": {"1": 5.2, "2": 1.3, "5": 0.1},
        "decode_device_steps_by_batch": {"1": 1000, "2": 200, "5": 10},
    }
    noff = {
        "decode_device_seconds_by_batch": {"1": 5.0, "2": 1.2, "3": 0.5},
        "decode_device_steps_by_batch": {"1": 1000, "2": 200, "3": 80},
    }
    ratio = served_vs_study.step_ratio_by_batch(echo, noff)
    # batch 5 ran 10 steps on ECHO only, batch 3 on no-offload only: neither is compared
    assert ratio == {"1": pytest.approx(1.04), "2": pytest.approx(1.0833, abs=1e-4)}
    assert served_vs_study.step_ratio_by_batch(echo, None) is None
    assert served_vs_study.step_ratio_by_batch({"median_itl_ms": 6.0}, noff) is None


def test_study_hit_rate_at_the_served_ages():
    # Cumulative hits / misses of the study's batch: 2/2 after one step, 9/3 after two,
    # 20/4 after three (its hit rate grows with age).
    curve = {"columns": ["step", "hits", "misses"], "rows": [[1, 2, 2], [2, 9, 3], [3, 20, 4]]}
    # Outputs of 2, 3 and 9 tokens: ages 1, 2 and 8 (past the curve: counted at its last step).
    out = served_vs_study.hit_rate_at_ages(curve, [2, 3, 9, 1])
    assert out == {
        "hit_rate": round((2 + 9 + 20) / (4 + 12 + 24), 4),
        "curve_steps": 3,
        "past_curve": 1,
    }
    assert served_vs_study.hit_rate_at_ages(None, [2]) is None
    assert served_vs_study.hit_rate_at_ages(curve, [1]) is None  # no decode step at all
