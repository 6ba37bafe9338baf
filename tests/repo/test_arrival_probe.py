"""benchmark/arrival_probe.py on the CPU: each arm's arrivals timed, the writer's host time
inside them, arrivals beside a decoding batch, and a record naming its command and commit."""

from __future__ import annotations

import json

import pytest

from benchmark import arrival_probe


def test_probe_times_each_arrival_and_writes_its_record(tmp_path):
    rec = arrival_probe.main(
        ["--out", str(tmp_path), "--prompt-len", "600", "--repeats", "2", "--profiled", "1",
         "--layers", "2", "--commit", "abc"]
    )  # fmt: skip
    assert json.loads((tmp_path / "arrival_probe.json").read_text()) == rec
    m = rec["metrics"]
    assert rec["commit"] == "abc" and rec["device"] == "cpu"
    assert m["prompt_tokens"] == 600 and m["beside_decode"] == 0 == m["decode_steps_during"]
    assert set(m["arms"]) == {"two_streams", "one_stream"}
    for arm in m["arms"].values():
        assert len(arm["arrival_ms"]) == 2 and all(x > 0 for x in arm["arrival_ms"])
        # On the CPU the writes run inside the transfer's start: the writer's host time is
        # a part of each arrival's start-to-arrival time.
        assert 0 < arm["writer_host_ms_median"] <= arm["arrival_ms_median"]
        assert arm["stream_ms_median"] is None  # no CUDA here
    assert m["host_bytes_per_arrival"] == 2 * 600 * m["host_row_bytes"]
    assert m["d2h_roofline_gbps"] is None and m["two_over_one_stream"] > 0


def test_probe_times_arrivals_beside_a_decoding_batch(tmp_path):
    rec = arrival_probe.main(
        ["--out", str(tmp_path), "--prompt-len", "300", "--repeats", "1", "--profiled", "0",
         "--layers", "2", "--beside-decode", "1"]
    )  # fmt: skip
    m = rec["metrics"]
    assert m["beside_decode"] == 1 and m["decode_steps_during"] > 0
    assert all(len(arm["arrival_ms"]) == 1 for arm in m["arms"].values())


@pytest.mark.parametrize("flag", ["--repeats", "--beside-decode"])
def test_probe_refuses_bad_counts(tmp_path, flag):
    with pytest.raises(SystemExit, match=f"{flag} must be >= "):
        arrival_probe.main(["--out", str(tmp_path), flag, "-1"])
