"""The top-k peer harness (benchmark/kernels/topk_peers.py).

Before a peer is timed its set must equal ours: the check must accept any order of the
same indices and refuse a set that breaks a tie the other way. The tie-heavy input must
really tie at the k-th score, or it would not test the tie order.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmark" / "kernels"))

from topk_peers import flashinfer_topk, same_set, tie_heavy  # noqa: E402

from sglang_echo.kernels.topk import topk_positions_reference  # noqa: E402


def test_same_set_ignores_order_and_refuses_another_tie_break() -> None:
    g = torch.Generator().manual_seed(3)
    scores = tie_heavy(torch.randn(4, 500, generator=g), step=0.5)
    qpos = torch.full((4,), 499)
    ours = topk_positions_reference(scores, qpos, 40)
    shuffled = ours[:, torch.randperm(40, generator=g)]
    assert same_set(ours, shuffled)
    # ties to the higher position: the same scores, another set wherever the k-th ties
    flipped = topk_positions_reference(scores.flip(1), qpos, 40)
    high = (499 - flipped).sort(dim=1).values
    assert torch.equal(
        torch.gather(scores, 1, high).sort(1).values, torch.gather(scores, 1, ours).sort(1).values
    )
    assert not same_set(ours, high)
    assert not same_set(ours, ours[:, :39])


def test_tie_heavy_scores_tie_at_the_kth() -> None:
    scores = tie_heavy(torch.randn(8, 2000, generator=torch.Generator().manual_seed(4)))
    kth = scores.topk(100, dim=1).values[:, -1:]
    assert ((scores == kth).sum(dim=1) > 1).all()


def test_a_missing_flashinfer_is_a_reason_and_an_unknown_mode_an_error() -> None:
    got = flashinfer_topk("deterministic_ties_low")
    try:
        import flashinfer  # noqa: F401
    except Exception:
        assert isinstance(got, str) and "flashinfer does not import" in got
    else:
        assert callable(got)
    with pytest.raises(ValueError, match="unknown FlashInfer top-k mode"):
        flashinfer_topk("fastest")
