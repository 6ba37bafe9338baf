"""benchmark/ingress_probe.py on the CPU: the real app over a stub engine in a process of its
own, every prompt submitted once per round and arm, and a record naming its command."""

from __future__ import annotations

import json

from benchmark import ingress_probe


def test_probe_times_every_submission_of_both_arms(tmp_path):
    rec = ingress_probe.main(
        ["--out", str(tmp_path), "--prompts", "3", "--prompt-len", "50", "--rounds", "2",
         "--commit", "abc", "--command", "python benchmark/ingress_probe.py ..."]
    )  # fmt: skip
    assert json.loads((tmp_path / "ingress_probe.json").read_text()) == rec
    assert rec["commit"] == "abc" and rec["command"].startswith("python benchmark/ingress")
    assert rec["device"].startswith("cpu: ") and rec["date"]
    assert set(rec["metrics"]) == {"one_thread", "pool"}
    for arm in rec["metrics"].values():
        at = arm["seconds_at_quantile"]
        assert all(len(at[str(q)]) == 2 for q in ingress_probe.QUANTILES)  # a value per round
        for r in range(2):  # submissions in time order, none before the first send
            column = [at[str(q)][r] for q in ingress_probe.QUANTILES]
            assert column[0] >= 0 and column == sorted(column)
        assert arm["all_in_s_median"] >= arm["half_in_s_median"] > 0
        assert arm["prompts_per_s_median"] > 0


def test_probe_refuses_a_run_that_measures_nothing(tmp_path):
    import pytest

    with pytest.raises(SystemExit, match="--prompts >= 2"):
        ingress_probe.main(["--out", str(tmp_path), "--prompts", "1"])
