"""Offline batched generation: chunked prefill, then greedy decode until each request ends.

Requests of a batch have different prompt lengths (packed, no padding) and leave the
batch as soon as they finish, returning their token locations to the pool.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from sglang_echo.model.deepseek_v32 import DeepseekV32ForCausalLM
from sglang_echo.model.forward_batch import ForwardBatch
from sglang_echo.model.kv_cache import KVCache
from sglang_echo.runtime.token_table import RequestTable, TokenSlotAllocator


@dataclass
class Request:
    index: int
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = field(default_factory=list)
    locs: list[int] = field(default_factory=list)
    row: int = -1
    cached_len: int = 0  # positions whose KV rows are in the cache
    finished: bool = False
    step_logits: list[torch.Tensor] = field(default_factory=list)

    @property
    def prefill_done(self) -> bool:
        return self.cached_len >= len(self.prompt)


@dataclass
class RunStats:
    prompt_tokens: int = 0
    output_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s


class Engine:
    def __init__(
        self,
        model: DeepseekV32ForCausalLM,
        kv_cache: KVCache,
        token_capacity: int,
        max_batch_size: int,
        max_context: int,
        chunked_prefill_size: int = 8192,
        ignore_eos: bool = False,
        use_cuda_graph: bool = False,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = model.lm_head.weight.device
        self.allocator = TokenSlotAllocator(token_capacity)
        self.table = RequestTable(max_batch_size, max_context, self.device)
        self.max_batch_size = max_batch_size
        self.chunked_prefill_size = chunked_prefill_size
        self.eos_ids = set() if ignore_eos else set(model.config.eos_token_ids)
        self.stats = RunStats()
        self.decode_runner = None
        if use_cuda_graph:
            from sglang_echo.runtime.cuda_graph import CudaGraphDecodeRunner

            self.decode_runner = CudaGraphDecodeRunner(model, kv_cache, max_context)

    # ----------------------------------------------------------------- public
    def generate(
        self,
        prompts: Sequence[list[int]],
        max_new_tokens: int,
        record_logits: bool = False,
        on_request_done: Callable[[Request], None] | None = None,
    ) -> list[Request]:
        requests = [Request(i, list(p), max_new_tokens) for i, p in enumerate(prompts)]
        for start in range(0, len(requests), self.max_batch_size):
            batch = requests[start : start + self.max_batch_size]
            self._run_batch(batch, record_logits, on_request_done)
        return requests

    # --------------------------------------------------------------- batches
    def _run_batch(
        self,
        batch: list[Request],
        record_logits: bool,
        on_done: Callable[[Request], None] | None,
    ) -> None:
        for req in batch:
            req.row = self.table.alloc_row()
        self.stats.prompt_tokens += sum(len(r.prompt) for r in batch)
        t0 = self._now()
        while any(not r.prefill_done for r in batch):
            self._prefill_chunk([r for r in batch if not r.prefill_done], record_logits, on_done)
        t1 = self._now()
        self.stats.prefill_s += t1 - t0
        while True:
            active = [r for r in batch if not r.finished]
            if not active:
                break
            self._decode_step(active, record_logits, on_done)
            self.stats.decode_steps += 1
        self.stats.decode_s += self._now() - t1

    def _prefill_chunk(
        self,
        pending: list[Request],
        record_logits: bool,
        on_done: Callable[[Request], None] | None,
    ) -> None:
        budget = self.chunked_prefill_size
        members: list[tuple[Request, int]] = []
        for req in pending:
            if budget <= 0:
                break
            n = min(len(req.prompt) - req.cached_len, budget)
            members.append((req, n))
            budget -= n
        ids, positions, out_locs = [], [], []
        for req, n in members:
            start = req.cached_len
            locs = self.allocator.alloc(n)
            self.table.assign(req.row, start, locs)
            req.locs.extend(locs)
            req.cached_len += n
            ids.extend(req.prompt[start : start + n])
            positions.extend(range(start, start + n))
            out_locs.extend(locs)
        finishing = [i for i, (req, _) in enumerate(members) if req.prefill_done]
        last_token = []
        acc = 0
        for _req, n in members:
            acc += n
            last_token.append(acc - 1)
        batch = self._make_batch(
            ids,
            positions,
            out_locs,
            [req for req, _ in members],
            [n for _, n in members],
            is_decode=False,
            logits_rows=[last_token[i] for i in finishing],
        )
        logits = self.model(batch, self.kv_cache)
        for j, i in enumerate(finishing):
            self._accept(members[i][0], logits[j], record_logits, on_done)

    def _decode_step(
        self,
        active: list[Request],
        record_logits: bool,
        on_done: Callable[[Request], None] | None,
    ) -> None:
        out_locs = self.allocator.alloc(len(active))
        positions = [req.cached_len for req in active]
        ids = [req.output[-1] for req in active]
        self.table.assign_next([req.row for req in active], positions, out_locs)
        for req, loc in zip(active, out_locs, strict=True):
            req.locs.append(loc)
            req.cached_len += 1
        batch = self._make_batch(
            ids, positions, out_locs, active, [1] * len(active), is_decode=True, logits_rows=None
        )
        if self.decode_runner is not None:
            logits = self.decode_runner(batch)
        else:
            logits = self.model(batch, self.kv_cache)
        for req, row in zip(active, logits, strict=True):
            self._accept(req, row, record_logits, on_done)

    # --------------------------------------------------------------- helpers
    def _make_batch(
        self,
        ids: list[int],
        positions: list[int],
        out_locs: list[int],
        reqs: list[Request],
        extend_lens: list[int],
        is_decode: bool,
        logits_rows: list[int] | None,
    ) -> ForwardBatch:
        def as_tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=self.device)

        context_lens = [r.cached_len for r in reqs]
        rows = as_tensor([r.row for r in reqs])
        width = max(context_lens)
        return ForwardBatch(
            input_ids=as_tensor(ids),
            positions=as_tensor(positions),
            out_locs=as_tensor(out_locs),
            context_locs=self.table.table[rows, :width],
            extend_lens=extend_lens,
            context_lens=context_lens,
            is_decode=is_decode,
            logits_indices=None if logits_rows is None else as_tensor(logits_rows),
        )

    def _accept(
        self,
        req: Request,
        logits: torch.Tensor,
        record_logits: bool,
        on_done: Callable[[Request], None] | None,
    ) -> None:
        token = int(torch.argmax(logits).item())
        req.output.append(token)
        self.stats.output_tokens += 1
        if record_logits:
            req.step_logits.append(logits.detach().to("cpu", copy=True))
        if len(req.output) >= req.max_new_tokens or token in self.eos_ids:
            self._finish(req)
            if on_done is not None:
                on_done(req)

    def _finish(self, req: Request) -> None:
        req.finished = True
        if req.locs:
            self.kv_cache.release(torch.tensor(req.locs, dtype=torch.int64, device=self.device))
            self.allocator.free(req.locs)
        self.table.free_row(req.row)
        req.locs = []
        req.row = -1

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()
