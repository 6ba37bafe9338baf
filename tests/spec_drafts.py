"""Scripted MTP drafts for the speculative tests (runtime/speculative.py and the server's
runtime/scheduler_speculative.py): the tiny checkpoints' random NextN layer is never
right, so these tests replace each round's drafts by the reference's next tokens up to a
count, wrong after it, and acceptance of every length actually happens. The real draft
still runs first, so its one-layer pool is written as usual."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import pytest
import torch

from sglang_echo.runtime.speculative import SpeculativeGenerator


def script_drafts(
    monkeypatch: pytest.MonkeyPatch,
    owner: type,
    reference_of: Callable[[Any], list[int]],
    vocab_size: int,
    produced_of: Callable[[Any], int],
    key_of: Callable[[Any], Any] | None = None,
    always_right: bool = False,
    rounds_of: Callable[[Any], int] | None = None,
) -> None:
    """Patch ``owner._draft`` (a method taking the round's lanes, returning drafts).

    For each lane: ``reference_of`` its reference tokens, ``produced_of`` how many it has
    produced so far, and its rounds so far: ``rounds_of`` the lane's own count, or counted
    here under ``key_of``, a stable key. The first k drafts are right, where k cycles 0..S
    with the lane's rounds (or is S with ``always_right``)."""
    original = owner._draft
    rounds: dict[Any, int] = defaultdict(int)

    def scripted(self, lanes):
        out = []
        for lane, d in zip(lanes, original(self, lanes), strict=True):
            ref, at = reference_of(lane), produced_of(lane)
            right = [ref[min(at + j, len(ref) - 1)] for j in range(len(d))]
            if rounds_of is not None:
                done = rounds_of(lane)
            else:
                done = rounds[key_of(lane)]
                rounds[key_of(lane)] += 1
            keep = len(d) if always_right else done % (len(d) + 1)
            out.append(right[:keep] + [(t + 1) % vocab_size for t in right[keep:]])
        return out

    monkeypatch.setattr(owner, "_draft", scripted)


def script_generator_drafts(
    monkeypatch: pytest.MonkeyPatch, reference_of: Callable[[Any], list[int]], vocab_size: int
) -> None:
    """``script_drafts`` for the offline generator (runtime/speculative.py): its lanes count
    what they produced in ``result.tokens`` and their rounds in ``result.accept_lens``, so
    two runs of the same prompts take the same drafts round for round."""
    script_drafts(
        monkeypatch,
        SpeculativeGenerator,
        reference_of,
        vocab_size,
        produced_of=lambda live: len(live.result.tokens),
        rounds_of=lambda live: len(live.result.accept_lens),
    )


class ReplayingGraphs:
    """A stand-in CUDA-graph backend: ``capture`` runs the step once (as a capture records
    it) and a replay runs it again on the same static tensors, into the same outputs. What
    it checks is the plumbing: the inputs copied into a shape's static tensors (lanes,
    context width, the draft's states and logits rows) before each replay."""

    def __init__(self, fail_lanes: tuple[int, ...] = ()) -> None:
        self.fail_lanes = fail_lanes
        self.captured: list[int] = []
        self.replays = 0

    def capture(self, step):
        out = step()
        lanes = out[1].shape[0]
        if lanes in self.fail_lanes:
            raise RuntimeError("operation not permitted when stream is capturing (injected)")
        self.captured.append(lanes)

        def replay() -> None:
            self.replays += 1
            with torch.inference_mode():
                for old, new in zip(out, step(), strict=True):
                    old.copy_(new)

        return replay, out
