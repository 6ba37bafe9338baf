"""benchmark/kernels/victim_policy_study.py on a small synthetic trace in the layout
benchmark/topk/trace.py writes: every policy's hit rate is a rate, and exact LRU (a stack
algorithm) never hits less with a larger cache."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark" / "kernels"))
from victim_policy_study import study


def _write_trace(path: Path, layers: int = 2, steps: int = 24, batch: int = 3, k: int = 8):
    rng = np.random.default_rng(0)
    arrays = {}
    for model, reuse in (("trained", 0.8), ("untrained", 0.2)):
        sel = np.zeros((layers, steps, batch, k), dtype=np.uint16)
        for layer in range(layers):
            for b in range(batch):
                current = rng.choice(200, size=k, replace=False)
                for t in range(steps):
                    sel[layer, t, b] = current
                    fresh = rng.choice(200, size=k, replace=False)
                    keep = rng.random(k) < reuse
                    current = np.where(keep, current, fresh)
        arrays[f"{model}__sel"] = sel
    np.savez(path, **arrays)


def test_study_reports_rates_and_lru_is_monotone_in_cache_size(tmp_path):
    npz = tmp_path / "trace.npz"
    _write_trace(npz)
    result = study(npz, [1.25, 2.0, 4.0])
    for model in ("trained", "untrained"):
        lru = [result[model][f]["mean"]["lru_exact"] for f in ("1.25", "2.0", "4.0")]
        assert lru == sorted(lru), lru
        for per_factor in result[model].values():
            assert all(0.0 <= r <= 1.0 for r in per_factor["mean"].values())
    assert (
        result["trained"]["2.0"]["mean"]["lru_exact"]
        > result["untrained"]["2.0"]["mean"]["lru_exact"]
    )
