"""Prefetch score predictors: per-request EMA state in fixed-shape tensors."""

from __future__ import annotations

import math

import pytest
import torch

from sglang_echo.offload.predictor import DecodeThresholdPredictor, PrefillOffsetPredictor

INF = math.inf


def test_decode_threshold_ema_per_row():
    p = DecodeThresholdPredictor(max_rows=4)
    rows = torch.tensor([2, 0])
    assert torch.equal(p.predict(rows), torch.tensor([INF, INF]))  # nothing yet
    p.update(torch.tensor([4.0, -2.0]), rows)
    assert torch.equal(p.predict(rows), torch.tensor([4.0, -2.0]))  # first value as is
    p.update(torch.tensor([2.0, 6.0]), rows)
    assert torch.equal(p.predict(rows), torch.tensor([3.0, 2.0]))  # 0.5 new + 0.5 old
    assert p.predict(torch.tensor([1, 3])).isinf().all()  # untouched rows
    p.reset([2])  # row 2 goes to a new request
    assert torch.equal(p.predict(rows), torch.tensor([INF, 2.0]))


def test_decode_threshold_short_context_and_padding():
    p = DecodeThresholdPredictor(max_rows=3, alpha=0.5)
    rows = torch.tensor([0, 1, 2])
    valid = torch.tensor([True, True, False])  # lane 2 is padding
    # Fewer than k keys: k-th score -inf -> prefetch every visible miss.
    p.update(torch.tensor([-INF, 1.0, 5.0]), rows, valid)
    assert torch.equal(p.predict(rows), torch.tensor([-INF, 1.0, INF]))
    # The next finite value replaces -inf instead of averaging with it.
    p.update(torch.tensor([3.0, 3.0, 5.0]), rows, valid)
    assert torch.equal(p.predict(rows), torch.tensor([3.0, 2.0, INF]))
    assert p.theta[p.scratch_row] == INF


def test_prefill_offset_block_mean_and_ema():
    p = PrefillOffsetPredictor(max_rows=3)
    off, known = p.predict(torch.tensor([0, 1]))
    assert torch.equal(off, torch.zeros(2)) and not known.any()
    # One block with rows of request 1 (k-th 1, 3, -inf) and request 0 (k-th 10).
    rows = torch.tensor([1, 1, 1, 0])
    p.update(torch.tensor([1.0, 3.0, -INF, 10.0]), rows)
    off, known = p.predict(torch.tensor([1, 0, 2]))
    assert torch.equal(off, torch.tensor([2.0, 10.0, 0.0]))
    assert torch.equal(known, torch.tensor([True, True, False]))
    p.update(torch.tensor([6.0, 6.0]), torch.tensor([1, 1]), valid=torch.tensor([True, False]))
    off, _ = p.predict(torch.tensor([1, 0]))
    assert torch.equal(off, torch.tensor([4.0, 10.0]))  # 0.5 * 6 + 0.5 * 2; row 0 kept
    p.reset(torch.tensor([1]))
    off, known = p.predict(torch.tensor([1]))
    assert off.item() == 0.0 and not known.item()


def test_predictor_bad_config():
    with pytest.raises(ValueError, match="alpha"):
        DecodeThresholdPredictor(4, alpha=0.0)
    with pytest.raises(ValueError, match="max_rows"):
        PrefillOffsetPredictor(0)
    with pytest.raises(ValueError, match="expected kth"):
        DecodeThresholdPredictor(4).update(torch.zeros(2), torch.zeros(3, dtype=torch.long))
