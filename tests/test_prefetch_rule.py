"""The decode-prefetch rule under SGLANG_NSA_FUSE_LOGITS_RECALL_DECODE=auto
(offload/prefetch_rule.py): off before any measurement, then on exactly when the previous
decode step missed at least the threshold's share of its selections, counting only that
step's own hits and misses (not a prefill chunk's between two decode steps)."""

from __future__ import annotations

import pytest
import torch

from sglang_echo.offload.prefetch_rule import AUTO_MISS_FRACTION, DecodePrefetchRule


def _step(rule: DecodePrefetchRule, hits: torch.Tensor, misses: torch.Tensor, h, m) -> bool:
    """One decode step adding h hits and m misses (spread over two layers)."""
    on = rule.decide()
    rule.before_step(hits, misses)
    hits += torch.tensor([h // 2, h - h // 2])
    misses += torch.tensor([m // 2, m - m // 2])
    rule.after_step(hits, misses)
    return on


def test_rule_follows_the_previous_decode_steps_miss_fraction():
    rule = DecodePrefetchRule(torch.device("cpu"), 2, threshold=0.1)
    hits, misses = torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    assert _step(rule, hits, misses, 80, 20) is False  # nothing measured yet
    assert _step(rule, hits, misses, 95, 5) is True  # 20% missed before
    assert _step(rule, hits, misses, 90, 10) is False  # 5% before
    hits += 10  # a prefill chunk between decode steps: all hits, not the decode step's
    assert _step(rule, hits, misses, 0, 0) is True  # 10% before: the boundary counts
    assert _step(rule, hits, misses, 50, 50) is False  # nothing selected before
    assert _step(rule, hits, misses, 1, 0) is True
    assert (rule.steps_on, rule.steps) == (3, 6)


def test_rule_threshold_is_checked_and_defaults_to_the_measured_one():
    assert DecodePrefetchRule(torch.device("cpu"), 2).threshold == AUTO_MISS_FRACTION
    with pytest.raises(ValueError, match="threshold"):
        DecodePrefetchRule(torch.device("cpu"), 2, threshold=1.5)


class _Copy:
    """Stands in for a CUDA event after a slot's copies: landed or not, as the test says."""

    def __init__(self) -> None:
        self.landed = True

    def record(self) -> None:
        self.landed = False  # queued behind a step that has not run yet

    def query(self) -> bool:
        return self.landed


def test_with_a_step_still_running_the_rule_reads_the_newest_landed_step():
    """Overlap scheduling launches a step while the one before still runs: the rule then
    decides from the step before that one, each measurement once, never an older one after
    a newer one, and keeps its decision when nothing new has landed."""
    rule = DecodePrefetchRule(torch.device("cpu"), 2, threshold=0.1)
    rule._copied = [_Copy(), _Copy()]
    hits, misses = torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
    assert _step(rule, hits, misses, 80, 20) is False  # step A (20% missed), slot 0
    assert _step(rule, hits, misses, 99, 1) is False  # B (1%), slot 1: nothing landed
    rule._copied[0].landed = True  # A lands while B runs
    assert _step(rule, hits, misses, 95, 5) is True  # from A; C (5%) goes to slot 0
    assert _step(rule, hits, misses, 50, 50) is True  # nothing landed: kept; D (50%), slot 1
    rule._copied[0].landed = True  # C lands while D runs
    assert _step(rule, hits, misses, 70, 30) is False  # from C; E (30%) to slot 0
    rule._copied[1].landed = rule._copied[0].landed = True  # D and E land
    assert _step(rule, hits, misses, 0, 0) is True  # from E, the newest; D is skipped
    assert _step(rule, hits, misses, 0, 0) is True  # nothing new: kept
    assert (rule.steps_on, rule.steps) == (4, 7)
