"""benchmark/mtp_study.py on the CPU at its smoke size: MTP rounds with forced acceptance
on the study's decode node commit the same tokens on ECHO as on no-offload (ECHO is
lossless under speculation whatever the drafts), and the record carries what the device
stage reports."""

from __future__ import annotations

import json

from benchmark import mtp_study


def test_mtp_study_smoke_record(tmp_path):
    argv = ["--smoke", "--out", str(tmp_path), "--layers", "2", "--phases", "batch1"]
    argv += ["--repeats", "1", "--steps", "3", "--warmup", "1", "--accept-rate", "0.6"]
    assert mtp_study.main(argv) == 0
    record = json.loads((tmp_path / "mtp_study.json").read_text())
    m = record["metrics"]
    assert m["outputs_equal_batch1"] is True
    for key in ("mtp_speedup_batch1_echo", "verify_over_decode_step_no_offload"):
        assert m[key]["median"] > 0
    runs = record["phases"]["batch1"]["echo"]
    per_round = runs[0]["spec"]["tokens_per_round"]
    assert 1.0 <= per_round <= 2.0  # S = 1: one or two tokens a round
    assert {"commit", "device", "date", "command", "config"} <= record.keys()
    bound = m["bound_batch1"]["backends"]["echo"]  # benchmark/mtp_bound.py on the run
    assert bound["speedup"] <= bound["free_draft_bound"]
    assert abs(bound["speedup"] - m["mtp_speedup_batch1_echo"]["median"]) < 1e-3


def test_forced_acceptance_is_the_same_coin_for_every_backend():
    class Seq:
        seed, output = 5, [1, 2, 3]

    class Lane:
        seq = Seq()

    rounds = mtp_study.ForcedRounds.__new__(mtp_study.ForcedRounds)
    rounds.rate = 0.5
    counts = [rounds.accepted_drafts(Lane(), [7, 7, 7], [0, 0, 0]) for _ in range(3)]
    assert len(set(counts)) == 1  # seeded by (request, output length): no hidden state
    rounds.rate = 1.0
    assert rounds.accepted_drafts(Lane(), [7, 7], [0, 0]) == 2  # even wrong drafts
    rounds.rate = 0.0
    assert rounds.accepted_drafts(Lane(), [0, 0], [0, 0]) == 0  # even right ones
