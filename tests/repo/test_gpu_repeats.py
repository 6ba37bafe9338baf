"""benchmark/gpu_repeats.py counts every round, also when rounds run at once."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmark import gpu_repeats


def test_parallel_rounds_are_each_counted_and_a_failure_is_kept(tmp_path: Path) -> None:
    probe = tmp_path / "test_probe.py"
    probe.write_text(
        "def test_ok():\n    pass\n\ndef test_bad():\n    assert 1 == 2, 'bad probe'\n"
    )
    out = tmp_path / "rec.json"
    record = gpu_repeats.main(
        [str(probe), "--rounds", "3", "--parallel", "2", "--out", str(out), "--commit", "abc"]
    )
    assert json.loads(out.read_text()) == record
    assert record["rounds"] == 3 and record["parallel"] == 2
    ok = next(v for k, v in record["tests"].items() if k.endswith("::test_ok"))
    bad = next(v for k, v in record["tests"].items() if k.endswith("::test_bad"))
    assert (ok["runs"], ok["passed"]) == (3, 3)
    assert (bad["runs"], bad["passed"]) == (3, 0) and len(bad["failures"]) == 3
    assert not record["all_passed"]
