"""The scheduler's MTP speculative decode: a decode step becomes one speculative round.

Why apart from the scheduler: the round itself (draft S tokens with the NextN layer,
verify Q = S + 1 positions per request in one target decode step, the accepted window, the
draft over what was committed) is ``SpecRounds``' (runtime/speculative.py), shared with
the offline ``generate``; what is the scheduler's own is small but separate: each
request's draft carry across steps, the draft over each prefill chunk (so the first
round has a draft), and handing each accepted token to the scheduler's per-token
acceptance (``Scheduler._accept_sampled``: stop tokens, stop strings, max_new_tokens,
non-finite rows, events) one at a time, the rest of the window discarded as soon as the
request ends. A request that ends gives back every location it holds, its rejected draft
tail's included (``StepRunner.release_later`` takes all of ``locs``).

Tokens are those of the non-speculative scheduler (greedy or seeded: each verified
position is sampled with the request's key and that position's output index); drafts
only decide how many one round commits. No overlap schedule: a round's next inputs are
its accepted tokens, read on the host.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from sglang_echo.runtime.host_ints import int64_tensor
from sglang_echo.runtime.request import ServeRequest
from sglang_echo.runtime.sampling import SampledBatch
from sglang_echo.runtime.speculative import SpecLane, SpecRounds


class SpeculativeDecode:
    """Speculative prefill drafts and decode rounds over the scheduler's requests."""

    def __init__(self, scheduler: Any, rounds: SpecRounds) -> None:
        """``scheduler``: the Scheduler (its steps, stats, events and acceptance)."""
        self.s = scheduler
        self.rounds = rounds
        self.num_draft = rounds.num_draft
        self.lanes: dict[int, SpecLane] = {}  # id(request) -> its lane (draft carry)
        # Rounds by accepted tokens (1..Q, before a request's end cuts the window).
        self.accept_lens: Counter[int] = Counter()
        # The last prefill chunk (members in batch order, hidden states) until its first
        # tokens are accepted: the draft over a completed prompt's last position takes it.
        self._chunk: tuple[list[tuple[ServeRequest, int]], torch.Tensor] | None = None

    def lane(self, req: ServeRequest) -> SpecLane:
        lane = self.lanes.get(id(req))
        if lane is None or lane.seq is not req:
            lane = SpecLane(req, req.params, req.sample_key)
            self.lanes[id(req)] = lane
        return lane

    def arrived(self, req: ServeRequest, draft_token: int, draft_hidden: torch.Tensor) -> None:
        """A decode node's arrival: its draft carry came with its KV (no prefill here to
        draft over), so its first round has a draft."""
        lane = self.lane(req)
        lane.draft_token, lane.draft_hidden = draft_token, draft_hidden

    def forget(self, req: ServeRequest) -> None:
        """A request released (ended or preempted): its carry goes; a recompute drafts
        over its whole sequence again."""
        self.lanes.pop(id(req), None)

    # ---------------------------------------------------------------- prefill
    def prefill_chunk(
        self, pending: list[ServeRequest], budget: int
    ) -> tuple[list[ServeRequest], torch.Tensor]:
        """``StepRunner.prefill_chunk`` keeping the hidden states for ``draft_prompts``."""
        members, done, logits, hidden = self.s.steps.prefill_chunk_with_hidden(pending, budget)
        self._chunk = (members, hidden)
        return done, logits

    def draft_prompts(self) -> None:
        """The draft over the last prefill chunk, once its first tokens are accepted:
        position p takes the id at p + 1 (the next prompt id, or the first output at a
        prompt's end) and the target's state at p. A request that already ended is left
        out; one whose prompt is complete gets its first draft."""
        chunk, self._chunk = self._chunk, None
        if chunk is None:
            return
        members, hidden = chunk
        reqs, ids, starts, rows = [], [], [], []
        at = 0
        for req, n in members:
            if not req.finished:
                start = req.cached_len - n
                end = req.cached_len
                last = req.output[-1] if req.prefill_done else req.prefill_ids[end]
                reqs.append(req)
                ids.append([*req.prefill_ids[start + 1 : end], last])
                starts.append(start)
                rows.extend(range(at, at + n))
            at += n
        if not reqs:
            return
        try:
            with self.s.stats.timed("prefill"):
                picked = hidden[int64_tensor(rows, hidden.device)]
                self.rounds.draft_over([self.lane(r) for r in reqs], ids, starts, picked)
        except Exception as exc:  # the phase's requests end, the rest go on
            self.s._fail(reqs, "draft", exc)

    # ----------------------------------------------------------------- decode
    def decode(self, decoding: list[ServeRequest]) -> None:
        """One round over ``decoding``; its accepted tokens through the scheduler's
        acceptance one at a time, then the draft over what each going-on request kept."""
        s = self.s
        lanes = [self.lane(r) for r in decoding]
        v = s.run_decode_step(decoding, lambda: self.rounds.verify(lanes, self._draft))
        if v is None:
            return
        going_on = []
        with s.stats.timed("accept"), s.events.holding_events():
            for req, picks in zip(decoding, v.picks, strict=True):
                self.accept_lens[len(picks.tokens)] += 1
                going_on.append(self._accept_window(req, picks))
        try:
            with s.stats.timed("decode"):
                self.rounds.extend_drafts(v, going_on)
        except Exception as exc:
            s._fail([r for r, go in zip(decoding, going_on, strict=True) if go], "draft", exc)

    def _accept_window(self, req: ServeRequest, picks: SampledBatch) -> bool:
        """The window's tokens one at a time until the request ends (the rest is
        discarded); True when it goes on."""
        for token, ok, lp in zip(picks.tokens, picks.finite, picks.logprobs, strict=True):
            if req.finished:  # ended meanwhile (its consumer failed, an abort)
                return False
            self.s._accept_sampled([req], SampledBatch([token], [ok], [lp]))
        return not req.finished

    def _draft(self, lanes: list[SpecLane]) -> list[list[int]]:
        """The round's drafts (``SpecRounds.draft``; tests script them here)."""
        return self.rounds.draft(lanes)


def accept_stats(accept_lens: Counter[int], num_draft: int) -> dict[str, float]:
    """The speculative gauges SGLang exports, from the rounds' accepted lengths (1..Q per
    request and round): the mean accepted length (drafts kept + the target's token) and
    the share of proposed drafts kept; a round a request's end cut short counts as cut."""
    rounds = sum(accept_lens.values())
    kept = sum((length - 1) * n for length, n in accept_lens.items())
    return {
        "avg_spec_accept_length": sum(k * n for k, n in accept_lens.items()) / rounds
        if rounds
        else 0.0,
        "spec_accept_rate": kept / (rounds * num_draft) if rounds else 0.0,
        "spec_num_steps": float(num_draft),
        "spec_num_draft_tokens": float(num_draft + 1),
        "spec_verify_rounds_total": float(rounds),
        "spec_accepted_tokens_total": float(sum(k * n for k, n in accept_lens.items())),
    }
