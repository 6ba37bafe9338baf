"""One model forward over a set of requests: a prefill chunk or a decode step.

Shared by the offline ``Engine`` (fixed batches) and the serving ``Scheduler``
(continuous batching): both hand in the requests to step and get logits back; choosing
tokens and deciding when a request ends stays with the caller. This class owns where
each request's KV rows live (token locations and request-table rows) and gives them back
when a request is released.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sglang_echo.kernels.pinned_store import PinnedReadback
from sglang_echo.model.deepseek_v32 import DeepseekV32ForCausalLM
from sglang_echo.model.forward_batch import ForwardBatch
from sglang_echo.model.kv_cache import KVCache
from sglang_echo.runtime.host_ints import int64_tensor
from sglang_echo.runtime.input_staging import DecodeInputStaging
from sglang_echo.runtime.request import SeqState
from sglang_echo.runtime.streams import on_engine_stream
from sglang_echo.runtime.token_table import RequestTable, TokenSlotAllocator


@dataclass(frozen=True)
class CarriedTokens:
    """Next input ids still on the device: ``tokens[sources[i]]`` is the id of the request
    at ``rows[i]`` of the step (overlap scheduling, runtime/scheduler.py)."""

    tokens: torch.Tensor
    rows: list[int]
    sources: list[int]


class StepRunner:
    def __init__(
        self,
        model: DeepseekV32ForCausalLM,
        kv_cache: KVCache,
        token_capacity: int,
        max_requests: int,
        max_context: int,
        use_cuda_graph: bool = False,
        cuda_graph_max_bs: int | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = model.lm_head.weight.device
        self.allocator = TokenSlotAllocator(token_capacity)
        self.table = RequestTable(max_requests, max_context, self.device)
        self.max_requests = max_requests
        self.max_context = max_context
        self._released: list[list[int]] = []  # token locations queued by release_later
        # Per-request state of the KV backend (ECHO's decode-prefetch thresholds) is sized
        # by the request table, once, before any step.
        kv_cache.bind_request_rows(max_requests)
        self.staging = DecodeInputStaging(max_requests, self.device)
        # Each step's sampled tokens come back through it (kernels/pinned_store.py).
        self.readback = PinnedReadback(self.device)
        self.decode_runner = None
        if use_cuda_graph:
            from sglang_echo.runtime.cuda_graph import CudaGraphDecodeRunner

            self.decode_runner = CudaGraphDecodeRunner(
                model, kv_cache, max_context, max_batch_size=cuda_graph_max_bs
            )

    def capture_decode_graphs(self) -> int:
        """Capture every decode shape this runner can take, now (a server, before it says
        it is ready: runtime/cuda_graph.py); returns how many were captured."""
        if self.decode_runner is None:
            return 0
        bound = self.decode_runner.max_batch_size or self.max_requests
        sizes = list(range(1, min(bound, self.max_requests) + 1))
        with on_engine_stream(self.device):
            return self.decode_runner.capture_all(sizes)

    # ------------------------------------------------------------- lifecycle
    def admit(self, req: SeqState) -> None:
        req.row = self.table.alloc_row()
        self.kv_cache.admit_row(req.row)

    def release(self, req: SeqState) -> None:
        """Return the request's token locations (and ECHO's slots for them) and its row."""
        self.release_later(req)
        self.flush_releases()

    def release_later(self, req: SeqState) -> None:
        """Give back the request's table row now and queue its token locations: the next
        ``flush_releases`` frees the KV backend's state of every queued request in one call
        (ECHO: one launch for all layers) and only then returns the locations to the
        allocator, so nothing can be handed out again while the cache still maps it."""
        if req.locs:
            self._released.append(req.locs)
        if req.row >= 0:
            self.table.free_row(req.row)
        req.locs = array("q")
        req.row = -1

    def flush_releases(self) -> None:
        """Release everything ``release_later`` queued (a no-op when nothing is)."""
        if not self._released:
            return
        queued, self._released = self._released, []
        flat = array("q")
        for locs in queued:
            flat.extend(locs)
        self.kv_cache.release(int64_tensor(flat))
        for locs in queued:
            self.allocator.free(locs)

    # ----------------------------------------------------------------- steps
    def prefill_chunk(
        self, pending: Sequence[SeqState], budget: int
    ) -> tuple[list[SeqState], torch.Tensor]:
        """Up to ``budget`` prompt tokens of ``pending`` (in order) in one forward.

        A preempted request's "prompt" here is its prompt + outputs (``prefill_ids``).
        Returns the requests whose prompt is now fully cached and their next-token logits
        ([len(done), vocab]); the others only advanced ``cached_len``.
        """
        _, done, batch = self._prefill_batch(pending, budget)
        return done, self.model(batch, self.kv_cache)

    def prefill_chunk_with_hidden(
        self, pending: Sequence[SeqState], budget: int
    ) -> tuple[list[tuple[SeqState, int]], list[SeqState], torch.Tensor, torch.Tensor]:
        """``prefill_chunk`` that also returns the chunk's members (request, tokens) in
        batch order and every position's final-normed hidden state: MTP's draft runs over
        the prompt with them (runtime/scheduler_speculative.py)."""
        members, done, batch = self._prefill_batch(pending, budget)
        logits, hidden = self.model.forward_with_hidden(batch, self.kv_cache)
        return members, done, logits, hidden

    def _prefill_batch(
        self, pending: Sequence[SeqState], budget: int
    ) -> tuple[list[tuple[SeqState, int]], list[SeqState], ForwardBatch]:
        """A prefill chunk's members, the requests it completes, and its batch (the
        members' token locations placed)."""
        self.flush_releases()
        members: list[tuple[SeqState, int]] = []
        for req in pending:
            if budget <= 0:
                break
            n = min(len(req.prefill_ids) - req.cached_len, budget)
            members.append((req, n))
            budget -= n
        ids, positions, out_locs = [], [], []
        for req, n in members:
            start = req.cached_len
            locs = self.allocator.alloc(n)
            self.place(req, start, locs)
            req.cached_len += n
            ids.extend(req.prefill_ids[start : start + n])
            positions.extend(range(start, start + n))
            out_locs.extend(locs)
        done_rows: list[int] = []
        done: list[SeqState] = []
        acc = 0
        for req, n in members:
            acc += n
            if req.prefill_done:
                done.append(req)
                done_rows.append(acc - 1)
        batch = self._make_batch(
            ids,
            positions,
            out_locs,
            [req for req, _ in members],
            [n for _, n in members],
            is_decode=False,
            logits_rows=done_rows,
        )
        return members, done, batch

    def decode(
        self, active: Sequence[SeqState], carried: CarriedTokens | None = None
    ) -> torch.Tensor:
        """One new token per request (its last output) -> logits [len(active), vocab].
        ``carried``: the requests whose token is still on the device (an overlapped step's
        choice, not yet read) take it from there."""
        self.flush_releases()
        out_locs = self.allocator.alloc(len(active))
        positions = [req.cached_len for req in active]
        ids = [req.output[-1] for req in active]  # a carried request's is overwritten below
        rows = [req.row for req in active]
        # One non-blocking upload of the step's inputs (runtime/input_staging.py).
        ids_t, pos_t, locs_t, rows_t = self.staging.upload([ids, positions, out_locs, rows])
        if carried is not None:  # one upload of both index lists
            both = int64_tensor([*carried.rows, *carried.sources], self.device)
            dst, src = both.split(len(carried.rows))
            ids_t.index_copy_(0, dst, carried.tokens.index_select(0, src))
        self.table.assign_next_on_device(rows_t, pos_t, locs_t, max(positions))
        self.kv_cache.note_owner(rows_t, locs_t)
        for req, loc in zip(active, out_locs, strict=True):
            req.locs.append(loc)
            req.cached_len += 1
        batch = ForwardBatch(
            input_ids=ids_t,
            positions=pos_t,
            out_locs=locs_t,
            context_locs=self.table.table[rows_t, : max(positions) + 1],
            extend_lens=[1] * len(active),
            context_lens=[p + 1 for p in positions],
            is_decode=True,
            logits_indices=None,
            request_rows=rows_t,
        )
        # ECHO's decode prefetch under auto picks this step's mode (and graph) here.
        self.kv_cache.before_decode_step()
        if self.decode_runner is not None:
            logits = self.decode_runner(batch)
        else:
            logits = self.model(batch, self.kv_cache)
        self.kv_cache.after_decode_step()
        return logits

    def place(self, req: SeqState, start: int, locs: Sequence[int]) -> torch.Tensor:
        """Token locations ``locs`` hold ``req``'s positions start.. (not yet cached).
        Returns them as an int64 tensor on the device (converted and copied once; a
        decode node's transfer reuses it). The copy is from pinned memory and does not
        block: a pageable copy would make the engine thread wait for every step queued."""
        on_device = int64_tensor(locs, self.device)  # for the table and the owner
        self.table.assign(req.row, start, on_device)
        req.locs.extend(locs)
        self.kv_cache.note_owner(req.row, on_device)
        return on_device

    # --------------------------------------------------------------- helpers
    def _ints(self, values: list[int]) -> torch.Tensor:
        return int64_tensor(values, self.device)

    def _make_batch(
        self,
        ids: list[int],
        positions: list[int],
        out_locs: list[int],
        reqs: Sequence[SeqState],
        extend_lens: list[int],
        is_decode: bool,
        logits_rows: list[int] | None,
    ) -> ForwardBatch:
        context_lens = [r.cached_len for r in reqs]
        rows = self._ints([r.row for r in reqs])
        width = max(context_lens)
        return ForwardBatch(
            input_ids=self._ints(ids),
            positions=self._ints(positions),
            out_locs=self._ints(out_locs),
            context_locs=self.table.table[rows, :width],
            extend_lens=extend_lens,
            context_lens=context_lens,
            is_decode=is_decode,
            logits_indices=None if logits_rows is None else self._ints(logits_rows),
            request_rows=rows,
        )
