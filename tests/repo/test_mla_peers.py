"""The sparse-MLA peer harness (benchmark/kernels/mla_peers.py) and the bench's batch sweep.

What a peer must show before it could be the CUDA default is slot invariance: the same
rows at other slots give the same bits (offload and no-offload present one request's rows
from different buffers). The check must pass for our kernel and fail for a kernel whose
result depends on where rows live.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmark" / "kernels"))

from mla_peers import flashinfer_mla, slot_invariant  # noqa: E402

from sglang_echo.kernels.sparse_mla import (  # noqa: E402
    sparse_mla_from_buffer,
    sparse_mla_reference,
)

LAT, ROPE, SCALE = 32, 16, 0.1


def _inputs(queries=2, heads=16, topk=24, slots=96):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(queries, heads, LAT + ROPE, generator=g)
    buffer = torch.randn(slots, LAT + ROPE, generator=g)
    rows = torch.stack([torch.randperm(slots, generator=g)[:topk] for _ in range(queries)])
    return q, buffer, rows


def test_our_kernel_is_slot_invariant() -> None:  # interpreted (conftest) on the CPU
    q, buffer, rows = _inputs()

    def plan(q, b, r):
        return lambda: sparse_mla_from_buffer(q, b, r, LAT, SCALE, block_h=16, block_k=16)

    assert slot_invariant(plan, q, buffer, rows)


def test_slot_invariance_fails_for_a_kernel_that_reads_slot_positions() -> None:
    q, buffer, rows = _inputs()

    def plan(q, b, r):  # the reference, plus a term that depends on the slot numbers
        return lambda: sparse_mla_reference(q, b, r, LAT, SCALE) + r.sum() * 1e-3

    assert not slot_invariant(plan, q, buffer, rows)


def test_flashinfer_missing_is_a_reason_not_a_number() -> None:
    made = flashinfer_mla(LAT, SCALE)
    if callable(made):
        pytest.skip("flashinfer imports here: the GPU run measures it")
    assert isinstance(made, str) and "flashinfer" in made


def test_bench_batch_sweep_smoke_on_cpu(tmp_path: Path) -> None:
    """The bench's CPU smoke run with --batches and the peer: every kernel of the sweep is
    checked (rel. error, slot invariance), and a peer that cannot run says why."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python")}
    cmd = [
        sys.executable,
        str(ROOT / "benchmark" / "kernels" / "sparse_mla_bench.py"),
        "--device", "cpu", "--out", str(tmp_path), "--batches", "2", "--peer", "flashinfer",
    ]  # fmt: skip
    subprocess.run(cmd, check=True, env=env, cwd=ROOT, capture_output=True, timeout=900)
    record = json.loads((tmp_path / "sparse_mla.json").read_text())
    sweep = record["metrics"]["batch_sweep"]
    row = sweep["batches"]["2"]
    from sparse_mla_bench import CPU_BATCH_SWEEP

    ours = ("ours_default", *(f"ours_{name}" for name in CPU_BATCH_SWEEP))
    assert len(ours) == 3
    assert set(ours) <= set(row)
    for name in ours:
        assert row[name]["slot_invariant"] is True
        assert row[name]["rel_err"] < 1e-2
        assert row[name]["us"] > 0
    if "flashinfer" not in row:
        assert "flashinfer" in sweep["missing_peers"]
