"""MTP speculative decoding: DeepSeek's NextN layer drafts, the target verifies.

Each round drafts S tokens per request with the NextN layer (model/nextn.py), then checks
all of them in ONE target forward: Q = S + 1 decode lanes per request over its cached
context (the last accepted token and the S drafts, lane j at position start + j seeing
positions 0..start + j). The longest prefix of drafts that equals the target's own choice
is accepted, plus the target's next token, so a round commits 1..Q tokens and the output
is exactly what one-token decode steps would give. Every step of a round (the draft
steps, the verify, the draft over the verified positions) is a decode step of fixed
lanes: the shape CUDA graphs capture.

The target's choice at a verify position is the runtime's own sampler
(runtime/sampling.py) on that position's logits, with the request's noise key and the
output index that position would have in plain decoding as the counter: greedy rows take
the argmax, sampled rows (temperature, top-p, top-k) draw by the counter-based race. So a
seeded request's draw at output index i depends only on (seed, i, the logits there), the
same as the non-speculative scheduler's, and a draft is accepted iff it equals that draw:
seeded speculative output is token for token the seeded non-speculative output (drafts
only decide how many of those tokens one round commits). The draft itself stays greedy;
it proposes, it never decides.

Why it stays lossless under ECHO (offload/echo_cache.py): a verify's lanes write their KV
rows as a decode step does (each layer writes every lane's row before its indexer and
attention read anything, so lane j sees lanes < j of its request), and one resolve per
layer serves the union of the Q lanes' selections (``selections_distinct`` False: they
repeat locations). A rejected position keeps its token location; the next round's verify
starts at the first rejected position and writes it again. A location that is still
resident then gets its device row rewritten in place, with the decode write's placement
and without it (SGLANG_ECHO_DECODE_PLACE=0: ``EchoManager.write_host(residents=True)``),
so no stale device row of a rewritten location can be served, and locations are reused in
place: no release and re-allocation per round. No query can see a rejected row before it
is rewritten: a query at position p selects only positions <= p (the indexer's causal
mask), and every rejected position is at or past the next verify's first position. The
decode prefetch keeps one threshold per request row, so a verify runs without it. The
draft's own one-layer pool is a plain pool (its full KV is one layer's worth, beside the
target's many): its rows are overwritten in place the same way, by the draft over the
verified positions that follows each verify.

The runtime bookkeeping (request-table rows, token locations, releases through the KV
backend) is ``StepRunner``'s; only the batches are built here. A round over a batch
(draft, verify, the accepted window, the draft over what was committed) is ``SpecRounds``'s,
shared by the offline ``SpeculativeGenerator`` below and the server's scheduler
(runtime/scheduler_speculative.py): each decides on its own how accepted tokens end a
request.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch

from sglang_echo.model.deepseek_v32 import DeepseekV32ForCausalLM
from sglang_echo.model.forward_batch import ForwardBatch
from sglang_echo.model.kv_cache import KVCache, PlainKVCache
from sglang_echo.model.nextn import NextNLayer
from sglang_echo.runtime.cuda_graph import GraphBackend
from sglang_echo.runtime.host_ints import int64_tensor
from sglang_echo.runtime.request import SamplingParams, SeqState
from sglang_echo.runtime.sampling import SampledBatch, new_sample_key, sample_batch
from sglang_echo.runtime.spec_graphs import SpecStepGraphs
from sglang_echo.runtime.speculative_flags import MAX_DRAFT_TOKENS
from sglang_echo.runtime.step_runner import StepRunner

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
class SpecLane:
    """A request in flight as a round sees it: its cached state (``seq.cached_len`` =
    target positions whose KV is committed; the last output token is not cached yet) and
    the draft's carry, the first draft token of the coming round and the NextN out_hidden
    that produced it. ``params`` and ``key``: its sampling and noise key, as the
    scheduler gives them."""

    seq: SeqState
    params: SamplingParams = field(default_factory=lambda: GREEDY)
    key: int = 0
    draft_token: int = -1
    draft_hidden: torch.Tensor | None = None


@dataclass(eq=False)
class _Live(SpecLane):
    """An offline request: a lane with the output it builds."""

    result: SpecResult = field(default_factory=SpecResult)

    @property
    def done(self) -> bool:
        return bool(self.result.finish_reason)


@dataclass
class Verified:
    """One verify's outcome, per lane in the round's order: ``accepted`` its window (the
    matching drafts and the target's next token, 1..Q tokens), ``picks`` the target's
    choices at those positions (token, finite, logprob: the scheduler accepts them one by
    one), ``starts`` its first verified position. ``logits`` [lanes x Q, vocab] and
    ``hidden`` (every verified position's target state) stay for the draft extend."""

    lanes: list[SpecLane]
    starts: list[int]
    accepted: list[list[int]]
    picks: list[SampledBatch]
    logits: torch.Tensor
    hidden: torch.Tensor
    q: int


class SpecRounds:
    """The round over a batch of lanes, and the draft over committed positions.

    The draft gets a plain one-layer pool with the target's token locations, so a
    position's draft and target rows share one location and one request-table entry; the
    locations, rows and the target's KV backend are ``steps``' (a StepRunner)."""

    def __init__(
        self,
        target: DeepseekV32ForCausalLM,
        draft: NextNLayer,
        steps: StepRunner,
        num_draft_tokens: int,
        token_capacity: int,
        graphs: bool = False,
        graph_backend: GraphBackend | None = None,
    ) -> None:
        """``graphs``: the round's decode-lane steps replay CUDA graphs
        (runtime/spec_graphs.py; ``graph_backend``: the decode runner's pool by default, a
        stand-in in tests)."""
        if not 1 <= num_draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"num_draft_tokens must be in [1, {MAX_DRAFT_TOKENS}]")
        self.target = target
        self.draft_model = draft
        self.steps = steps
        self.num_draft = num_draft_tokens
        self.device = steps.device
        dtype = target.lm_head.weight.dtype
        self.draft_cache = PlainKVCache.for_model(draft.config, token_capacity, dtype, self.device)
        runner = steps.decode_runner
        # The decode runner's device clock (CUDA events, runtime/cuda_graph.py): each of a
        # round's steps is timed under the round's batch size, so /metrics' decode device
        # time (and a benchmark's served efficiency) covers speculative servers too.
        self.clock = runner.clock if runner is not None else None
        # Rounds of more requests than this run eagerly (--cuda-graph-max-bs), as decode does.
        self.graph_max_bs = runner.max_batch_size if runner is not None else None
        self.graphs: SpecStepGraphs | None = None
        if graphs:
            if graph_backend is None and runner is not None:
                graph_backend = runner.backend  # one memory pool for every graph
            self.graphs = SpecStepGraphs(
                target, draft, steps.kv_cache, self.draft_cache, steps.table.max_context,
                backend=graph_backend,
            )  # fmt: skip

    def _timed(self, requests: int) -> AbstractContextManager[None]:
        return self.clock.timed(requests) if self.clock is not None else nullcontext()

    # ------------------------------------------------------------------- a round
    def verify(
        self, lanes: list[SpecLane], drafter: Callable[[list[SpecLane]], list[list[int]]]
    ) -> Verified:
        """Place Q = S + 1 positions per lane, draft S tokens (``drafter``: ``draft``, or
        a test's script of it), verify them (the lane's last output and its S drafts) in
        one target decode step of Q lanes per request and commit each lane's accepted
        window (``seq.cached_len``); the caller appends the accepted tokens to the outputs.
        Rejected positions keep their token locations, rewritten by the next verify (see
        the module docstring)."""
        q = self.num_draft + 1
        self.steps.flush_releases()
        starts = [lane.seq.cached_len for lane in lanes]
        for lane, start in zip(lanes, starts, strict=True):
            have = len(lane.seq.locs)
            if have < start + q:
                self.steps.place(lane.seq, have, self.steps.allocator.alloc(start + q - have))
        drafts = drafter(lanes)
        ids = [[lane.seq.output[-1], *d] for lane, d in zip(lanes, drafts, strict=True)]
        batch = self.batch([lane.seq for lane in lanes], ids, starts, decode=True)
        graphs = self._graphs_for(len(lanes))
        with self._timed(len(lanes)):
            if graphs is not None:
                logits, hidden = graphs.verify(batch)
            else:
                logits, hidden = self.target.forward_with_hidden(batch, self.steps.kv_cache)
        # Position j of a lane with n outputs is output index n + j: the counter the
        # non-speculative scheduler would sample that token with.
        rows = [lane for lane in lanes for _ in range(q)]
        counters = [len(lane.seq.output) + j for lane in lanes for j in range(q)]
        flat = self.choose(logits, rows, counters)
        accepted, picks = [], []
        for i, (lane, d, start) in enumerate(zip(lanes, drafts, starts, strict=True)):
            best = flat.tokens[i * q : (i + 1) * q]
            k = self.accepted_drafts(lane, d, best)
            accepted.append([*d[:k], best[k]])
            at = slice(i * q, i * q + k + 1)
            picks.append(SampledBatch(best[: k + 1], flat.finite[at], flat.logprobs[at]))
            lane.seq.cached_len = start + k + 1  # positions start..start+k are committed
        return Verified(lanes, starts, accepted, picks, logits, hidden, q)

    def accepted_drafts(self, lane: SpecLane, drafts: list[int], best: list[int]) -> int:
        """How many of ``drafts`` the round accepts: the longest prefix equal to the
        target's own choices ``best`` (a benchmark may force another count: the tokens
        committed are then the drafts it accepts and the target's choice after them)."""
        k = 0
        while k < len(drafts) and drafts[k] == best[k]:
            k += 1
        return k

    def extend_drafts(self, v: Verified, going_on: Sequence[bool]) -> None:
        """The draft over each going-on lane's verified positions, with the target's
        states there: the next round's first draft (a lane that finished is skipped).

        All Q positions go, as decode lanes (fixed shapes, like the verify): position
        start + j takes the accepted token j where there is one and a filler past the
        window; the next round's first draft comes from the last accepted position. A
        filler's draft row lies past the committed positions, where the next round's draft
        steps and draft extend write before any draft query reads (queries are causal)."""
        keep = [i for i, go in enumerate(going_on) if go]
        if not keep:
            return
        q = v.q
        hidden = v.hidden
        if len(keep) < len(v.lanes):  # the going-on lanes' states (all: no gather)
            hidden = hidden[self.ints([r for i in keep for r in range(i * q, (i + 1) * q)])]
        ids = [[*v.accepted[i], *[v.accepted[i][-1]] * (q - len(v.accepted[i]))] for i in keep]
        last = [n * q + len(v.accepted[i]) - 1 for n, i in enumerate(keep)]
        self.draft_over(
            [v.lanes[i] for i in keep], ids, [v.starts[i] for i in keep], hidden,
            decode_lanes=last,
        )  # fmt: skip

    def draft(self, lanes: list[SpecLane]) -> list[list[int]]:
        """S draft tokens per lane: the carried first draft, then the NextN layer on its
        own out_hidden and argmax token at the next position (one-token steps on the
        draft pool; their rows past the accepted positions are rewritten later)."""
        drafts = [[lane.draft_token] for lane in lanes]
        hidden = torch.stack([lane.draft_hidden for lane in lanes])
        seqs = [lane.seq for lane in lanes]
        for j in range(1, self.num_draft):
            starts = [lane.seq.cached_len + j - 1 for lane in lanes]
            ids = [[d[-1]] for d in drafts]
            batch = self.batch(seqs, ids, starts, decode=True)
            logits, hidden = self._draft_lanes(batch, hidden, len(lanes))
            for d, token in zip(drafts, logits.argmax(-1).tolist(), strict=True):
                d.append(token)
        return drafts

    def draft_over(
        self,
        lanes: list[SpecLane],
        next_ids: list[list[int]],
        starts: list[int],
        target_hidden: torch.Tensor,
        decode_lanes: list[int] | None = None,
    ) -> None:
        """The draft over newly committed positions (a prompt chunk, or a round's verified
        ones): position p takes the token at p + 1 and the target's hidden state at p,
        overwriting the draft rows the draft steps wrote there; each lane's last row
        gives the next round's first draft and its out_hidden. ``decode_lanes``: every
        position as a decode lane, and the rows (one per lane, in the batch's order) whose
        draft is the next round's; None: an extend, each lane's last position's."""
        seqs = [lane.seq for lane in lanes]
        decode = decode_lanes is not None
        batch = self.batch(seqs, next_ids, starts, decode=decode)
        if decode:
            batch.logits_indices = self.ints(decode_lanes)  # queued, no host wait
            logits, out_hidden = self._draft_lanes(batch, target_hidden, len(lanes))
        else:
            ends = itertools.accumulate(len(ids) for ids in next_ids)
            batch.logits_indices = self.ints([end - 1 for end in ends])
            logits, out_hidden = self.draft_model(batch, target_hidden, self.draft_cache)
        for i, (lane, token) in enumerate(zip(lanes, logits.argmax(-1).tolist(), strict=True)):
            lane.draft_token = token
            lane.draft_hidden = out_hidden[i]

    # ---------------------------------------------------------------- helpers
    def _graphs_for(self, requests: int) -> SpecStepGraphs | None:
        """The step graphs for a round of ``requests`` requests (None: eager)."""
        if self.graph_max_bs is not None and requests > self.graph_max_bs:
            return None
        return self.graphs

    def _draft_lanes(
        self, batch: ForwardBatch, hidden: torch.Tensor, requests: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A draft step of decode lanes: from its CUDA graph where there are graphs."""
        graphs = self._graphs_for(requests)
        with self._timed(requests):
            if graphs is not None:
                return graphs.draft_step(batch, hidden)
            return self.draft_model(batch, hidden, self.draft_cache)

    @staticmethod
    def choose(logits: torch.Tensor, lanes: list[SpecLane], counters: list[int]) -> SampledBatch:
        """One token per logits row by the runtime's sampler (runtime/sampling.py), with
        row i's lane params and noise key and output index ``counters[i]``."""
        return sample_batch(
            logits, [lane.params for lane in lanes], [lane.key for lane in lanes], counters
        )

    def batch(
        self, seqs: list[SeqState], ids: list[list[int]], starts: list[int], decode: bool
    ) -> ForwardBatch:
        """Request i's ``ids`` at positions starts[i].. over its first starts[i] + len
        positions, at the token locations its table row holds there.

        ``decode``: every token a decode lane of its own (position p over positions
        0..p of its request's row): the fixed-shape step a CUDA graph captures, whatever
        the counts. A request with several tokens has several lanes on one row, whose
        selections repeat locations (``selections_distinct`` False). Else an extend."""
        lens = [len(x) for x in ids]
        context = [s + n for s, n in zip(starts, lens, strict=True)]
        positions = [p for s, n in zip(starts, lens, strict=True) for p in range(s, s + n)]
        out_locs = [
            seq.locs[p] for seq, s, n in zip(seqs, starts, lens, strict=True)
            for p in range(s, s + n)
        ]  # fmt: skip
        if decode:
            row_of = [seq.row for seq, n in zip(seqs, lens, strict=True) for _ in range(n)]
            lens, context = [1] * len(positions), [p + 1 for p in positions]
        else:
            row_of = [seq.row for seq in seqs]
        rows = self.ints(row_of)
        return ForwardBatch(
            input_ids=self.ints([t for x in ids for t in x]),
            positions=self.ints(positions),
            out_locs=self.ints(out_locs),
            context_locs=self.steps.table.table[rows, : max(context)],
            extend_lens=lens,
            context_lens=context,
            is_decode=decode,
            logits_indices=None,
            request_rows=rows,
            selections_distinct=len(set(row_of)) == len(row_of),
        )

    def ints(self, values: list[int]) -> torch.Tensor:
        """``values`` as an int64 tensor on the device, queued without a host wait."""
        return int64_tensor(values, self.device)


class SpeculativeGenerator:
    """Generation (greedy or seeded sampling) of a batch of prompts with NextN drafts of ``num_draft_tokens``.

    ``kv_cache`` is the target's (plain pool or ECHO); the rounds are ``SpecRounds``'.
    Prompts are prefilled one request at a time in chunks of ``chunk_size`` (an ECHO
    append must fit its device cache).

    ``record_logits``: keep every verify's logits in the results (the lossless checks);
    off for long runs, whose [Q, vocab] rows per round would pile up on the host.
    ``cuda_graphs``: the rounds' steps replay CUDA graphs (runtime/spec_graphs.py).
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
        cuda_graphs: bool = False,
        graph_backend: GraphBackend | None = None,
    ) -> None:
        self.target = target
        self.chunk_size = chunk_size
        self.max_batch_size = max_batch_size
        self.steps = StepRunner(target, kv_cache, token_capacity, max_batch_size, max_context)
        self.rounds = SpecRounds(
            target, draft, self.steps, num_draft_tokens, token_capacity,
            graphs=cuda_graphs, graph_backend=graph_backend,
        )  # fmt: skip
        self.num_draft = num_draft_tokens
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
            _Live(SeqState(list(p)), params, new_sample_key(params), result=SpecResult())
            for p in prompts
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
            batch = self.rounds.batch([seq], [ids[start : start + n]], [start], decode=False)
            batch.logits_indices = self.rounds.ints([n - 1])
            logits, h = self.target.forward_with_hidden(batch, self.steps.kv_cache)
            hidden.append(h)
        (first,) = self.rounds.choose(logits[:1], [live], [0]).tokens
        if self._accept(live, [first], max_new):
            return
        self.rounds.draft_over([live], [[*ids[1:], first]], [0], torch.cat(hidden))

    # ------------------------------------------------------------------- a round
    def _round(self, active: list[_Live], max_new: int) -> None:
        """Draft S tokens, verify Q = S + 1 positions in one target decode step, accept, and
        re-run the draft over the accepted positions with the target's states."""
        v = self.rounds.verify(active, self._draft)
        going_on = []
        for i, (live, accepted) in enumerate(zip(active, v.accepted, strict=True)):
            if self.record_logits:
                rows = v.logits[i * v.q : (i + 1) * v.q]
                live.result.verify_logits.append(rows.to("cpu", copy=True))
            live.result.accept_lens.append(len(accepted))
            going_on.append(not self._accept(live, accepted, max_new))
        self.rounds.extend_drafts(v, going_on)

    def _draft(self, active: list[_Live]) -> list[list[int]]:
        """The round's drafts (``SpecRounds.draft``; tests script them here)."""
        return self.rounds.draft(active)

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

    def _lap(self, phase: str, began: float) -> float:
        now = time.perf_counter()
        self.phase_s[phase] += now - began
        return now


__all__ = [
    "MAX_DRAFT_TOKENS",
    "SpecLane",
    "SpecResult",
    "SpecRounds",
    "SpeculativeGenerator",
    "Verified",
]
