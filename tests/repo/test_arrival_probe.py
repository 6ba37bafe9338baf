"""benchmark/arrival_probe.py on the CPU: one arrival's start-to-arrival time, the writer's
host time inside it, and a record naming its command and commit."""

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
    assert m["prompt_tokens"] == 600 and len(m["arrival_ms"]) == 2
    assert all(x > 0 for x in m["arrival_ms"])
    # On the CPU the writes run inside the transfer's start: the writer's host time is a
    # part of each arrival's start-to-arrival time.
    assert 0 < m["writer_host_ms_median"] <= m["arrival_ms_median"]
    assert m["host_bytes_per_arrival"] == 2 * 600 * m["host_row_bytes"]
    assert m["d2h_roofline_gbps"] is None and m["stream_ms_median"] is None  # no CUDA here


def test_probe_refuses_no_repeats(tmp_path):
    with pytest.raises(SystemExit, match="--repeats must be >= 1"):
        arrival_probe.main(["--out", str(tmp_path), "--repeats", "0"])
