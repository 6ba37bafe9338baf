"""MTP speculative decoding: DeepSeek's NextN layer drafts, the target verifies.

Each round drafts S tokens per request with the NextN layer (model/nextn.py), then checks
all of them in ONE target forward: an extend of Q = S + 1 tokens per request over its
cached context (the last accepted token and the S drafts). The longest prefix of drafts
that equals the target's own choice is accepted, plus the target's next token, so a round
commits 1..Q tokens and the output is exactly what one-token decode steps would give.

The target's choice at a verify position is the runtime's own sampler
(runtime/sampling.py) on that position's logits, with the request's noise key and the
output index that position would have in plain decoding as the counter: greedy rows take
the argmax, sampled rows (temperature, top-p, top-k) draw by the counter-based race. So a
seeded request's draw at output index i depends only on (seed, i, the logits there), the
same as the non-speculative scheduler's, and a draft is accepted iff it equals that draw:
seeded speculative output is token for token the seeded non-speculative output (drafts
only decide how many of those tokens one round commits). The draft itself stays greedy;
it proposes, it never decides.

Why it stays lossless under ECHO (offload/echo_cache.py): the verify is a prefill-style
extend, so its KV rows go through ``EchoKVCache.write``'s append path. A rejected
position keeps its token location; the next round's verify starts at the first rejected
position and writes it again, in each layer before that layer's indexer and attention
read anything. The append's allocation (kernels/alloc.py, append mode) finds a location
that is still resident as a hit and the new rows are copied into that very slot, while
the host row and the index key are overwritten too; if the slot is taken for another
lane's miss instead, the location is unmapped. Either way no stale device row of a
rewritten location can be served, so the locations are reused in place: no release and
re-allocation (which would cost a release launch per round and churn the allocator).
No query can see a rejected row before it is rewritten: a query at position p selects
only positions <= p (the indexer's causal mask), and every rejected position is at or
past the next verify's first position. The draft's own one-layer pool is a plain pool
(its full KV is one layer's worth, beside the target's many): its rows are overwritten
in place the same way, by the draft extend that follows each verify.

The runtime bookkeeping (request-table rows, token locations, releases through the KV
backend) is ``StepRunner``'s; only the batches are built here.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from sglang_echo.model.deepseek_v32 import DeepseekV32ForCausalLM
from sglang_echo.model.forward_batch import ForwardBatch
from sglang_echo.model.kv_cache import KVCache, PlainKVCache
from sglang_echo.model.nextn import NextNLayer
from sglang_echo.runtime.host_ints import int64_tensor
from sglang_echo.runtime.request import SamplingParams, SeqState
from sglang_echo.runtime.sampling import new_sample_key, sample_batch
from sglang_echo.runtime.step_runner import StepRunner

MAX_DRAFT_TOKENS = 3  # the NextN layer chained on itself: deeper drafts rarely pay off
GREEDY = SamplingParams(temperature=0.0)


@dataclass
class SpecResult:
    """One request's output. ``verify_logits``: every round's float32 target logits for
    its Q verified positions ([Q, vocab], on the CPU), kept for the lossless checks;
    ``accept_lens``: tokens each round accepted (1..Q, before truncation at the end)."""

    tokens: list[int] = field(default_factory=list)
    verify_logits: list[torch.Tensor] = field(default_factory=list)
    accept_lens: list[int] = field(default_factory=list)
    finish_reason: str = ""


@dataclass(eq=False)
class _Live:
    """A request in flight: its cached state (``seq.cached_len`` = target positions whose
    KV is committed; the last output token is not cached yet) and the draft's carry, the
    first draft token of the coming round and the NextN out_hidden that produced it.
    ``params`` and ``key``: its sampling and noise key, as the scheduler would give it."""

    seq: SeqState
    result: SpecResult
    params: SamplingParams = field(default_factory=lambda: GREEDY)
    key: int = 0
    draft_token: int = -1
    draft_hidden: torch.Tensor | None = None

    @property
    def done(self) -> bool:
        return bool(self.result.finish_reason)


class SpeculativeGenerator:
    """Generation (greedy or seeded sampling) of a batch of prompts with NextN drafts of ``num_draft_tokens``.

    ``kv_cache`` is the target's (plain pool or ECHO); the draft gets a plain one-layer
    pool with the same token locations, so a position's draft and target rows share one
    location and one request-table entry. Prompts are prefilled one request at a time in
    chunks of ``chunk_size`` (an ECHO append must fit its device cache).

    ``record_logits``: keep every verify's logits in the results (the lossless checks);
    off for long runs, whose [Q, vocab] rows per round would pile up on the host.
    ``phase_s``: wall seconds spent in prefills (with their draft extends) and in rounds."""

    def __init__(
        self,
        target: DeepseekV32ForCausalLM,
        draft: NextNLayer,
        kv_cache: KVCache,
        num_draft_tokens: int,
        token_capacity: int,
        max_batch_size: int,
        max_context: int,
        chunk_size: int = 8192,
        eos_token_ids: Sequence[int] | None = None,
        record_logits: bool = True,
    ) -> None:
        if not 1 <= num_draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"num_draft_tokens must be in [1, {MAX_DRAFT_TOKENS}]")
        self.target = target
        self.draft = draft
        self.num_draft = num_draft_tokens
        self.chunk_size = chunk_size
        self.max_batch_size = max_batch_size
        self.steps = StepRunner(target, kv_cache, token_capacity, max_batch_size, max_context)
        self.device = self.steps.device
        dtype = target.lm_head.weight.dtype
        self.draft_cache = PlainKVCache.for_model(draft.config, token_capacity, dtype, self.device)
        eos = target.config.eos_token_ids if eos_token_ids is None else eos_token_ids
        self.eos_ids = set(eos)
        self.record_logits = record_logits
        self.phase_s = {"prefill": 0.0, "decode": 0.0}

    # ------------------------------------------------------------------ the driver
    def generate(
        self,
        prompts: Sequence[list[int]],
        max_new_tokens: int,
        params: SamplingParams | None = None,
    ) -> list[SpecResult]:
        """Outputs of ``prompts`` in their order, ``max_new_tokens`` at most each; up to
        ``max_batch_size`` requests run together, in waves. ``params``: every request's
        sampling (its temperature, top-p, top-k and seed; None = greedy), applied as the
        scheduler applies it, so the tokens equal non-speculative decoding's."""
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        params = GREEDY if params is None else params
        results = []
        for start in range(0, len(prompts), self.max_batch_size):
            wave = prompts[start : start + self.max_batch_size]
            results.extend(self._run_wave(wave, max_new_tokens, params))
        return results

    def _run_wave(
        self, prompts: Sequence[list[int]], max_new: int, params: SamplingParams
    ) -> list[SpecResult]:
        need = max(len(p) for p in prompts) + max_new + self.num_draft
        if need > self.steps.max_context:
            raise ValueError(f"prompt + max_new_tokens + drafts needs {need} positions")
        if not all(prompts):
            raise ValueError("empty prompt")
        lives = [
            _Live(SeqState(list(p)), SpecResult(), params, new_sample_key(params)) for p in prompts
        ]
        try:  # rows and locations go back even when a forward fails
            began = time.perf_counter()  # each phase ends on a host read of its tokens
            for live in lives:
                self.steps.admit(live.seq)
                self._prefill(live, max_new)
            began = self._lap("prefill", began)
            while active := [live for live in lives if not live.done]:
                self._round(active, max_new)
            self._lap("decode", began)
        finally:
            for live in lives:
                self.steps.release(live.seq)
        return [live.result for live in lives]

    # ---------------------------------------------------------------- the prefill
    def _prefill(self, live: _Live, max_new: int) -> None:
        """The target over the prompt (chunked), its first token, then the draft over the
        prompt: position p takes the next id (prompt[p + 1], the first token at the end)
        and the target's hidden state at p, and its last row gives the first draft."""
        seq, ids = live.seq, live.seq.prompt
        hidden, logits = [], None
        for start in range(0, len(ids), self.chunk_size):
            n = min(self.chunk_size, len(ids) - start)
            self.steps.place(seq, start, self.steps.allocator.alloc(n))
            seq.cached_len = start + n
            batch = self._batch([seq], [ids[start : start + n]], [start], decode=False)
            batch.logits_indices = self._ints([n - 1])
            logits, h = self.target.forward_with_hidden(batch, self.steps.kv_cache)
            hidden.append(h)
        (first,) = self._choose(logits[:1], [live], [0])
        if self._accept(live, [first], max_new):
            return
        self._draft_extend([live], [[*ids[1:], first]], [0], torch.cat(hidden))

    # ------------------------------------------------------------------- a round
    def _round(self, active: list[_Live], max_new: int) -> None:
        """Draft S tokens, verify Q = S + 1 positions in one target extend, accept, and
        re-run the draft over the accepted positions with the target's states."""
        q = self.num_draft + 1
        starts = [live.seq.cached_len for live in active]
        for live, start in zip(active, starts, strict=True):
            have = len(live.seq.locs)
            if have < start + q:  # rejected positions keep their locations (see above)
                self.steps.place(live.seq, have, self.steps.allocator.alloc(start + q - have))
        drafts = self._draft(active)
        ids = [[live.seq.output[-1], *d] for live, d in zip(active, drafts, strict=True)]
        batch = self._batch([live.seq for live in active], ids, starts, decode=False)
        logits, hidden = self.target.forward_with_hidden(batch, self.steps.kv_cache)
        best = self._verify_choices(logits, active, q)
        cont, cont_ids, cont_starts, cont_rows = [], [], [], []
        for i, (live, d, start) in enumerate(zip(active, drafts, starts, strict=True)):
            k = 0
            while k < self.num_draft and d[k] == best[i][k]:
                k += 1
            accepted = [*d[:k], best[i][k]]
            if self.record_logits:
                live.result.verify_logits.append(logits[i * q : (i + 1) * q].to("cpu", copy=True))
            live.result.accept_lens.append(k + 1)
            live.seq.cached_len = start + k + 1  # positions start..start+k are committed
            if not self._accept(live, accepted, max_new):
                cont.append(live)
                cont_ids.append(accepted)
                cont_starts.append(start)
                cont_rows.extend(range(i * q, i * q + k + 1))
        if cont:
            self._draft_extend(cont, cont_ids, cont_starts, hidden[self._ints(cont_rows)])

    def _draft(self, active: list[_Live]) -> list[list[int]]:
        """S draft tokens per request: the carried first draft, then the NextN layer on
        its own out_hidden and argmax token at the next position (one-token steps on the
        draft pool; their rows past the accepted positions are rewritten later)."""
        drafts = [[live.draft_token] for live in active]
        hidden = torch.stack([live.draft_hidden for live in active])
        seqs = [live.seq for live in active]
        for j in range(1, self.num_draft):
            starts = [live.seq.cached_len + j - 1 for live in active]
            ids = [[d[-1]] for d in drafts]
            batch = self._batch(seqs, ids, starts, decode=True)
            logits, hidden = self.draft(batch, hidden, self.draft_cache)
            for d, token in zip(drafts, logits.argmax(-1).tolist(), strict=True):
                d.append(token)
        return drafts

    def _draft_extend(
        self,
        lives: list[_Live],
        next_ids: list[list[int]],
        starts: list[int],
        target_hidden: torch.Tensor,
    ) -> None:
        """The draft over newly committed positions (the prompt, or a round's accepted
        ones): position p takes the token at p + 1 and the target's hidden state at p,
        overwriting the draft rows the draft steps wrote there; each request's last row
        gives the next round's first draft and its out_hidden."""
        seqs = [live.seq for live in lives]
        batch = self._batch(seqs, next_ids, starts, decode=False)
        ends = torch.tensor([len(ids) for ids in next_ids]).cumsum(0) - 1
        batch.logits_indices = ends.to(self.device)
        logits, out_hidden = self.draft(batch, target_hidden, self.draft_cache)
        for i, (live, token) in enumerate(zip(lives, logits.argmax(-1).tolist(), strict=True)):
            live.draft_token = token
            live.draft_hidden = out_hidden[i]

    # ---------------------------------------------------------------- choices
    def _verify_choices(self, logits: torch.Tensor, active: list[_Live], q: int) -> list[list[int]]:
        """The target's token at each of a verify's Q positions per request: position j
        of a request with n output tokens is its output index n + j, the counter the
        non-speculative scheduler would sample that token with."""
        lives = [live for live in active for _ in range(q)]
        counters = [len(live.seq.output) + j for live in active for j in range(q)]
        flat = self._choose(logits, lives, counters)
        return [flat[i * q : (i + 1) * q] for i in range(len(active))]

    @staticmethod
    def _choose(logits: torch.Tensor, lives: list[_Live], counters: list[int]) -> list[int]:
        """One token per logits row by the runtime's sampler (runtime/sampling.py), with
        row i's request params and noise key and output index ``counters[i]``."""
        return sample_batch(
            logits, [live.params for live in lives], [live.key for live in lives], counters
        ).tokens

    # ------------------------------------------------------------------ helpers
    def _accept(self, live: _Live, tokens: list[int], max_new: int) -> bool:
        """Append accepted tokens up to an EOS (kept) or ``max_new_tokens`` (the rest of
        the window is dropped); True when the request has finished."""
        out = live.result.tokens
        for token in tokens:
            out.append(token)
            live.seq.output.append(token)
            if token in self.eos_ids:
                live.result.finish_reason = "stop"
            elif len(out) >= max_new:
                live.result.finish_reason = "length"
            if live.done:
                return True
        return False

    def _batch(
        self, seqs: list[SeqState], ids: list[list[int]], starts: list[int], decode: bool
    ) -> ForwardBatch:
        """Request i's ``ids`` at positions starts[i].. over its first starts[i] + len
        positions, at the token locations its table row holds there."""
        lens = [len(x) for x in ids]
        context = [s + n for s, n in zip(starts, lens, strict=True)]
        positions = [p for s, n in zip(starts, lens, strict=True) for p in range(s, s + n)]
        out_locs = [
            seq.locs[p] for seq, s, n in zip(seqs, starts, lens, strict=True)
            for p in range(s, s + n)
        ]  # fmt: skip
        rows = self._ints([seq.row for seq in seqs])
        return ForwardBatch(
            input_ids=self._ints([t for x in ids for t in x]),
            positions=self._ints(positions),
            out_locs=self._ints(out_locs),
            context_locs=self.steps.table.table[rows, : max(context)],
            extend_lens=lens,
            context_lens=context,
            is_decode=decode,
            logits_indices=None,
            request_rows=rows,
        )

    def _lap(self, phase: str, began: float) -> float:
        now = time.perf_counter()
        self.phase_s[phase] += now - began
        return now

    def _ints(self, values: list[int]) -> torch.Tensor:
        return int64_tensor(values, self.device)


__all__ = ["MAX_DRAFT_TOKENS", "SpecResult", "SpeculativeGenerator"]
