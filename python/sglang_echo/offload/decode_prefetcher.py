"""Decode intra-query prefetch as the model's indexer sees it (docs/ARCHITECTURE.md
section 6).

Per decode step and layer, the indexer (model/indexer.py) asks for each request's
threshold and scores the keys. Three designs:

- *in-kernel* (``in_kernel=True``): the fp8 logits kernel stages
  each key block's misses above the threshold itself, into the request's region of a
  staging buffer, while the other blocks are scored (kernels/logits_stage.py). No chunks,
  no side-stream copies, nothing allocated; the resolve's recall takes staged rows
  device to device (EchoManager.resolve). ``copy_rows`` splits the copy: the logits copy a
  request's first ranks, a side stream the rest beside the top-k.
- *chunked* (``in_kernel=False``, the runtime's default, ``DEFAULT_IN_KERNEL``; the SGLang
  plugin's, whose logits are DeepGEMM's): the
  logits run in ``chunks`` pieces of key positions; after each, ``stage`` selects the
  chunk's misses above the threshold and copies their rows into the staging buffer on a
  side stream, on a bounded grid, while the next chunks and the top-k run
  (kernels/decode_stage.py).
- *allocating* (``staged=False``, the first design, kept for the A/B in
  benchmark/kernels/decode_prefetch_bench.py): the fused logits kernel flags the
  candidates, ``launch`` maps them into cache slots and copies their rows on a side stream
  while the top-k runs.

Either way the exact top-k decides what attention reads, and each request's k-th score
goes to ``observe``. Thresholds are per layer (each layer's indexer has its own score
scale) and per request row of the request table; ``reset_rows`` clears a row when a new
request takes it. All state has fixed shapes and every step-time call is a plain tensor
op or a kernel, so a decode step with prefetch is capturable in a CUDA graph.
"""

from __future__ import annotations

import torch

from sglang_echo.config import default_stage_rows
from sglang_echo.kernels.decode_stage import (
    StagedRows,
    stage_copy,
    stage_copy_reference,
    stage_select,
    stage_select_reference,
)
from sglang_echo.kernels.logits_stage import (
    STAGE_BLOCK_N,
    StageBuffers,
    copy_rest,
    copy_rest_reference,
    fp8_index_logits_staged,
    stage_scores,
    stage_scores_reference,
)
from sglang_echo.offload.manager import EchoManager
from sglang_echo.offload.predictor import DecodeThresholdPredictor

# Candidates per request and layer (allocating design). ECHO suggests ~64 growing with
# context; at top-k 2048 a request misses ~(1 - hit rate) x 2048 of its selections, so
# 512 covers hit rates down to ~0.75 while bounding what a bad threshold can waste.
DEFAULT_DECODE_PREFETCH_CAP = 512
# Two chunks: the first chunk's rows move while the second is scored. On an H200 (batch
# 16 x 128K, 911a4d4) four chunks started the copies earlier but cost more launches and
# tails: 1.12x / 1.02x / 0.93x at hit 0.5 / 0.9 / 0.97 against 1.12x / 1.06x / 0.96x.
DEFAULT_STAGE_CHUNKS = 2
# The staging stream's priority (lower is higher; CUDA clamps to its range). A chunk's
# select and copy are queued behind the next chunk's logits programs, which fill every
# SM: at equal priority they ran only once the logits drained (H200 profile, a192da2).
STAGE_STREAM_PRIORITY = -10
# The runtime's design (EchoConfig.decode_stage_in_kernel overrides it). On an H200 (batch
# 16 x 128K, fa294dc) the chunked design's whole step was faster where the prefetch runs
# (1.20x / 1.17x / 1.05x over none at hit 0.5 / 0.8 / 0.9, against 1.18x / 1.09x / 1.01x):
# its copies overlap the top-k too, while the in-kernel copies stall logits programs (two
# resident per SM at 128 keys a program) and end with the logits. The in-kernel design
# wins Figure 18's definition (logits + recall alone): 1.25x against 0.98x at hit 0.5.
DEFAULT_IN_KERNEL = False
# In-kernel design: rows per request the logits kernel copies itself (None: all it
# stages); a side stream copies the rest beside the top-k (kernels/logits_stage.py
# copy_rest). On an H200 (e431e82, five rounds, 384 and 448 rows) the split beat the
# chunked design at hit 0.5 only (1.25x against 1.18-1.20x), tied at 0.4 and lost at 0.3
# and 0.6-0.8 (1.24-1.27x against 1.32-1.34x at 0.6): no band of miss fractions where a
# per-step choice of design would pay, so none is made and the logits copy all.
DEFAULT_IN_KERNEL_COPY_ROWS: int | None = None
# Chunked design: each chunk's select on a stream of its own instead of the copies'. On one
# stream a chunk's select waited for the previous chunk's copy (H200 profile at hit 0.5,
# gpu_checks_logs/ae80c55/prefetch_profile.log: the second select started when the first
# copy ended, ~60 us after its logits), and the second copy behind it. Timed beside each
# other (gpu_checks_logs/bdcc9e9/): 1.22x against 1.19x at hit 0.5 with two chunks, 1.22x
# against 1.20x with three; equal within the rounds' range at hit 0.8 to 1.0. In the
# record's run (decode_prefetch.json, 20ebfe8) equal at every hit rate: never slower.
DEFAULT_SELECT_STREAM = True


class DecodePrefetcher:
    def __init__(
        self,
        manager: EchoManager,
        max_rows: int,
        cap: int | None = None,
        alpha: float = 0.5,
        staged: bool = True,
        chunks: int = DEFAULT_STAGE_CHUNKS,
        side_priority: int = STAGE_STREAM_PRIORITY,
        in_kernel: bool = DEFAULT_IN_KERNEL,
        block_n: int = STAGE_BLOCK_N,
        copy_rows: int | None = None,
        select_stream: bool | None = None,
    ) -> None:
        if cap is None and staged:
            # Staged rows per request and layer (split over the chunks, a chunk's share
            # pooled over the batch's requests): what config's byte budget holds.
            rows = manager.cache.rows
            cap = default_stage_rows(rows.shape[-1] * rows.element_size())
        elif cap is None:
            cap = DEFAULT_DECODE_PREFETCH_CAP
        if cap < 1:
            raise ValueError(f"decode prefetch cap must be >= 1 candidate per request, got {cap}")
        in_kernel = staged and in_kernel
        if staged and not in_kernel and not 1 <= chunks <= cap:
            raise ValueError(f"decode prefetch chunks must be in 1..cap ({cap}), got {chunks}")
        self.manager = manager
        self.cap = int(cap)
        self.max_rows = int(max_rows)
        self.staged = staged
        self.in_kernel = in_kernel
        self.block_n = int(block_n)  # keys per program of the in-kernel design's logits
        # Rows per request the in-kernel logits copy (the rest: copy_rest on the side
        # stream); read at construction, so tests can set the module default.
        copy_rows = DEFAULT_IN_KERNEL_COPY_ROWS if copy_rows is None else copy_rows
        if copy_rows is not None and copy_rows < 0:
            raise ValueError(f"in-kernel copy rows must be >= 0, got {copy_rows}")
        self.copy_rows = self.cap if copy_rows is None else min(int(copy_rows), self.cap)
        self._copied: torch.cuda.Event | None = None  # copy_rest's, for the coming resolve
        # Chunked design: the selects on a stream of their own, so that a chunk's select
        # does not queue behind the previous chunk's copy (module default).
        self.select_stream = DEFAULT_SELECT_STREAM if select_stream is None else bool(select_stream)
        self.side_priority = int(side_priority)
        layers = manager.cache.num_layers
        self.predictors = [
            DecodeThresholdPredictor(max_rows, manager.device, alpha) for _ in range(layers)
        ]
        self._streams: dict[str, torch.cuda.Stream] | None = None  # by role, made on first use
        if in_kernel:
            c = manager.cache
            self.chunks = 1
            self.stage_buffers = StageBuffers(
                self.max_rows, self.cap, c.row_dim, c.rows.dtype, c.host_tokens, manager.device
            )
        elif staged:
            self.chunks = int(chunks)
            self.chunk_cap = self.cap // self.chunks
            self._build_staging()

    def _build_staging(self) -> None:
        """The staging buffer and its index (shared by the layers: a layer's staging is
        consumed by its resolve before the next layer's logits start)."""
        m, c = self.manager, self.manager.cache
        entries = self.chunks * self.max_rows * self.chunk_cap
        dev = m.device
        self.stage_rows = torch.zeros(entries, c.row_dim, dtype=c.rows.dtype, device=dev)
        self.stage_ids = torch.full((entries,), -1, dtype=torch.int64, device=dev)
        self.stage_counts = torch.zeros(self.chunks, dtype=torch.int32, device=dev)
        self.stage_map = torch.zeros(c.host_tokens + 2, dtype=torch.int32, device=dev)

    @property
    def nbytes(self) -> int:
        """Device bytes of the staged design's buffers (rows, ids, counts, map); the
        thresholds are a few bytes per request row."""
        if not self.staged:
            return 0
        if self.in_kernel:
            return self.stage_buffers.nbytes
        buffers = (self.stage_rows, self.stage_ids, self.stage_counts, self.stage_map)
        return sum(t.nbytes for t in buffers)

    def chunk_bounds(self, length: int, span: int) -> list[tuple[int, int]]:
        """[start, end) of each chunk of a [B, length] score table, starts aligned to the
        logits kernel's ``span`` positions per program (fewer chunks for short tables).
        Even chunks: a smaller first chunk, to start the copies earlier, was within the
        rounds' spread on an H200 (commit 8c90ac6; docs/ARCHITECTURE.md)."""
        if length <= 0:
            return [(0, 0)]
        per_chunk = -(-length // self.chunks)
        per = max(-(-per_chunk // span) * span, span)
        return [(s, min(s + per, length)) for s in range(0, length, per)]

    def stage_logits(
        self,
        layer: int,
        q: torch.Tensor,
        weights: torch.Tensor,
        keys: torch.Tensor,
        key_scales: torch.Tensor,
        locs: torch.Tensor,
        seq_lens: torch.Tensor,
        theta: torch.Tensor,
    ) -> torch.Tensor:
        """In-kernel design: the fp8 logits [B, L] (kernels.indexer.fp8_index_logits's
        arguments and bits), each request's misses above ``theta`` staged by the same
        launch, on the current stream."""
        m = self.manager
        batch = q.shape[0]
        self._check_batch(batch)
        host = self._host_rows(layer)
        scores = fp8_index_logits_staged(
            q, weights, keys, key_scales, locs, seq_lens, theta, m.cache.host_to_device[layer],
            host, self.stage_buffers, m.prefetched_rows[layer : layer + 1],
            block_n=self.block_n, copy_limit=self.copy_rows,
        )  # fmt: skip
        self._copied = None
        if self.copy_rows >= self.cap:
            return scores
        side = self._side_stream()
        if side is None:
            copy = copy_rest if m.use_kernels else copy_rest_reference
            copy(host, self.stage_buffers, batch, self.copy_rows)
            return scores
        side.wait_stream(torch.cuda.current_stream(m.device))  # fork: the staged logits
        with torch.cuda.stream(side):
            copy_rest(host, self.stage_buffers, batch, self.copy_rows)
            self._copied = torch.cuda.Event()
            self._copied.record(side)
        return scores

    def _check_batch(self, batch: int) -> None:
        if batch > self.max_rows:
            raise ValueError(f"decode batch of {batch} exceeds the {self.max_rows} request rows")

    def _host_rows(self, layer: int) -> torch.Tensor:
        m = self.manager
        host = m.host_view if m.host_view is not None else m.host.rows
        return host[layer]

    def stage(
        self,
        layer: int,
        chunk: int,
        scores: torch.Tensor,
        locs: torch.Tensor,
        seq_lens: torch.Tensor,
        theta: torch.Tensor,
        start: int,
        end: int,
    ) -> None:
        """Stage the misses above theta among positions [start, end) of ``scores`` (just
        computed on the current stream). On CUDA with the kernels: on a side stream
        forked here; after the step's last chunk and its top-k, :meth:`finish` hands the
        layer's staging to the manager. Elsewhere: synchronous, in torch."""
        m = self.manager
        batch = scores.shape[0]
        self._check_batch(batch)
        if self.in_kernel:  # scores computed elsewhere (the bf16 indexer): one pass, here
            if chunk != 0 or start != 0:
                raise ValueError("the in-kernel design stages a step's scores in one pass")
            stage = stage_scores if m.use_kernels else stage_scores_reference
            stage(
                scores[:, :end], locs, seq_lens, theta, m.cache.host_to_device[layer],
                self._host_rows(layer), self.stage_buffers, m.prefetched_rows[layer : layer + 1],
            )  # fmt: skip
            return
        # A chunk's region: its share of the buffer, of which this batch may fill
        # ``limit`` rows (rows per request x requests), in any split between requests.
        stride = self.max_rows * self.chunk_cap
        region, limit = chunk * stride, self.region_limit(batch)
        count = self.stage_counts[chunk : chunk + 1]
        h2d = m.cache.host_to_device[layer]
        args = (scores, locs, seq_lens, theta, h2d, start, end, self.stage_ids, count,
                self.stage_map, region, limit)  # fmt: skip
        total = m.prefetched_rows[layer : layer + 1]
        host = self._host_rows(layer)
        copy_args = (host, self.stage_rows, self.stage_ids, count, total, region, limit)
        side = self._side_stream()
        if side is None:
            if chunk == 0:
                self.stage_counts.zero_()
            (stage_select if m.use_kernels else stage_select_reference)(*args)
            copy = stage_copy if m.use_kernels else stage_copy_reference
            copy(*copy_args)
            return
        pick = self._side_stream("select") if self.select_stream else side
        pick.wait_stream(torch.cuda.current_stream(m.device))  # fork: this chunk's logits
        with torch.cuda.stream(pick):
            if chunk == 0:
                self.stage_counts.zero_()
            stage_select(*args)
        if pick is not side:  # the copy waits for this select, not the select for a copy
            side.wait_stream(pick)
        with torch.cuda.stream(side):
            # A bounded grid even beside the top-k alone: with the recall's full grid the
            # last chunk's copy held the top-k back (H200, hit 0.5: 1.03x against 1.12x).
            stage_copy(*copy_args)
        _used_on(pick, scores, locs, seq_lens, theta)

    def finish(
        self, layer: int, scores: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor
    ) -> None:
        """After the exact top-k of a staged step: the thresholds learn its k-th scores
        (:meth:`observe_topk`) and the layer's staging goes to the manager, whose recall
        waits for the copies only. On CUDA the threshold update runs on a stream of its
        own, joined after the recall: queued behind the copies on the side stream, it held
        the recall back by its ~5 us whenever the last copy outlasted the top-k
        (gpu_checks_logs/736295d/prefetch_profile.log, hit 0.5)."""
        m = self.manager
        staged = self.staged_rows(layer, positions.shape[0])
        side = self._side_stream()
        if side is None:
            self.observe_topk(layer, scores, positions, rows)
            m.stage_ready(layer, staged, None)
            return
        copied = self._copied
        if not self.in_kernel:  # the chunks' copies, queued on the side stream
            copied = torch.cuda.Event()
            copied.record(side)
        learn = self._side_stream("learn")
        learn.wait_stream(torch.cuda.current_stream(m.device))  # fork: the top-k
        with torch.cuda.stream(learn):
            self.observe_topk(layer, scores, positions, rows)
            done = torch.cuda.Event()
            done.record(learn)
        m.stage_ready(layer, staged, copied, joined=done)
        self._copied = None
        _used_on(learn, scores, positions, rows)

    def abandon_pending(self) -> None:
        """Forget this step's side-stream copy (its step stopped half way)."""
        self._copied = None

    def wait_copies(self) -> None:
        """The current stream waits for the in-kernel design's side-stream copy of this
        step (for callers that skip :meth:`finish`, as Figure 18's timing does)."""
        if self._copied is not None:
            torch.cuda.current_stream(self.manager.device).wait_event(self._copied)
            self._copied = None

    def region_limit(self, batch: int) -> int:
        """Rows a batch of ``batch`` requests may stage per chunk (rows per request x
        requests, in any split between them)."""
        return batch * self.chunk_cap

    def staged_rows(self, layer: int, batch: int) -> StagedRows:
        """The staging of ``layer``'s current step (a batch of ``batch`` requests) as the
        recall reads it."""
        m = self.manager
        if self.in_kernel:
            return self.stage_buffers.view(m.prefetch_hits[layer : layer + 1])
        return StagedRows(
            self.stage_rows, self.stage_map, self.stage_ids, self.stage_counts,
            self.max_rows * self.chunk_cap, self.region_limit(batch),
            m.prefetch_hits[layer : layer + 1],
        )  # fmt: skip

    def _side_stream(self, role: str = "copy") -> torch.cuda.Stream | None:
        """The side stream of ``role``: "copy" (the staging copies), "select" (the chunks'
        selects) or "learn" (the threshold update); None off CUDA or without kernels."""
        m = self.manager
        if m.device.type != "cuda" or not m.use_kernels:
            return None
        if self._streams is None:
            self._streams = {
                name: torch.cuda.Stream(device=m.device, priority=self.side_priority)
                for name in ("copy", "select", "learn")
            }
        return self._streams[role]

    def cap_for(self, topk: int) -> int:
        """Candidates per request: at most top-k, so a step's list (B x cap lanes) fits
        the cache whenever its selections do."""
        return max(1, min(self.cap, topk))

    def theta(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """Thresholds [B] float32 of the requests in ``rows`` (+inf: no prediction yet)."""
        return self.predictors[layer].predict(rows)

    def host_to_device(self, layer: int) -> torch.Tensor:
        return self.manager.cache.host_to_device[layer]

    def launch(self, layer: int, candidate_ids: torch.Tensor, counts: torch.Tensor) -> None:
        """Allocating design: candidates [B, cap] (-1 past counts[b], as
        kernels/decode_prefetch.py writes them, so the counts need no masking pass here)."""
        del counts
        self.manager.prefetch(layer, candidate_ids)

    def observe(self, layer: int, kth: torch.Tensor, rows: torch.Tensor) -> None:
        """This step's exact k-th scores [B] (-inf: fewer than k visible keys) of the
        requests in ``rows`` (distinct). With the cache kernels, one launch."""
        p = self.predictors[layer]
        if not self.manager.use_kernels:
            p.update(kth, rows)
            return
        from sglang_echo.kernels.decode_prefetch import update_thresholds

        update_thresholds(p.theta, p.finite, kth, rows, p.alpha)

    def observe_topk(
        self, layer: int, scores: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor
    ) -> None:
        """:meth:`observe` from the exact top-k itself (scores [B, L] float32, positions
        [B, topk]): with the kernels one launch computes the k-th scores and updates the
        thresholds, off the gather and reductions a separate k-th score costs."""
        p = self.predictors[layer]
        if not self.manager.use_kernels:
            missing = positions < 0
            picked = torch.gather(scores, 1, positions.clamp(min=0))
            kth = picked.masked_fill(missing, float("inf")).amin(dim=1)
            p.update(kth.masked_fill(missing.any(dim=1), float("-inf")), rows)
            return
        from sglang_echo.kernels.decode_prefetch import update_thresholds_from_topk

        update_thresholds_from_topk(p.theta, p.finite, scores, positions, rows, p.alpha)

    def reset_rows(self, rows: torch.Tensor | list[int]) -> None:
        for p in self.predictors:
            p.reset(rows)


def _used_on(stream: torch.cuda.Stream, *tensors: torch.Tensor) -> None:
    """Tensors of the current stream that ``stream`` reads: their memory is not handed
    out again before ``stream``'s work queued so far is done (the caching allocator's
    record_stream; under graph capture it holds them to the end of the capture). Without
    it, a step's next allocation on the main stream could reuse a freed score or position
    table while the side stream still reads it (an illegal address on the H200 at 17 x
    100K, eager first steps)."""
    for t in tensors:
        t.record_stream(stream)
