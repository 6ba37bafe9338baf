"""``benchmark/kernels/sm90_resources.py``: the sparse-MLA kernel's default config compiles
for sm_90a on the CPU and ptxas reports its registers, spills and shared memory (run in a
process without TRITON_INTERPRET, which would make the kernel an interpreted function)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_default_config_resources_are_reported(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "benchmark/kernels/sm90_resources.py", "--only-default", "--out",
         str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads((tmp_path / "sm90_resources.json").read_text())
    assert record["device"].startswith("cpu: compile only") and record["command"]
    (row,) = record["metrics"]["configs"]
    assert row == record["metrics"]["default"]
    assert 0 < row["registers"] <= 255 and row["spill_store_bytes"] >= 0
    assert row["shared_bytes"] > 0 and row["wgmma"] >= 0
    assert row["row_loads_async"] + row["row_loads_sync"] > 0  # the KV-row gathers were found
    # the KV tiles reach shared memory for the MMA, and the bf16 ones as 16-byte vectors
    assert row["shared_stores_v4"] > 0 and row["shared_stores_scalar"] == 0
    fp8 = record["metrics"]["fp8_default"]
    assert fp8["kv"] == "fp8_e4m3" and fp8["shared_stores_v4"] + fp8["shared_stores_scalar"] > 0
