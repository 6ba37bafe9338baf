"""Decode intra-query prefetch as the model's indexer sees it (docs/ARCHITECTURE.md
section 6): the chunked staged design, the runtime's and the SGLang plugin's.

Per decode step and layer, the indexer (model/indexer.py) asks for each request's
threshold and scores the keys in ``chunks`` pieces of key positions; after each piece,
``stage`` selects the chunk's misses above the threshold and copies their rows into a
staging buffer on side streams, on a bounded grid, while the next chunks and the top-k run
(kernels/decode_stage.py). Nothing is allocated; the resolve's recall takes staged rows
device to device (EchoManager.resolve). After the exact top-k, ``finish`` teaches the
thresholds the step's k-th scores and hands the staging to the manager.

The exact top-k decides what attention reads. Thresholds are per layer (each layer's
indexer has its own score scale) and per request row of the request table;
``reset_rows`` clears a row when a new request takes it. All state has fixed shapes and
every step-time call is a plain tensor op or a kernel, so a decode step with prefetch is
capturable in a CUDA graph.
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
    update_thresholds_from_topk,
)
from sglang_echo.model.selection_hooks import DecodeSelectionHooks
from sglang_echo.offload.footprint import decode_prefetch_bytes
from sglang_echo.offload.manager import EchoManager
from sglang_echo.offload.predictor import DecodeThresholdPredictor, layer_state, reset_layer_rows

# Two chunks: the first chunk's rows move while the second is scored. On an H200 (batch
# 16 x 128K) four chunks started the copies earlier but cost more launches and tails: as
# fast where half the selections missed, slower where few did (docs/ARCHITECTURE.md
# section 6, "Tried", and section 15, "Measured choices").
DEFAULT_STAGE_CHUNKS = 2
# The staging streams' priority (lower is higher; CUDA clamps to its range). A chunk's
# select and copy are queued behind the next chunk's logits programs, which fill every
# SM: at equal priority they ran only once the logits drained (an H200 profile:
# docs/ARCHITECTURE.md section 6).
STAGE_STREAM_PRIORITY = -10


class DecodePrefetcher(DecodeSelectionHooks):
    # Its bytes from sizes alone, for sizing before it exists (offload/footprint.py).
    bytes_for = staticmethod(decode_prefetch_bytes)

    def __init__(
        self,
        manager: EchoManager,
        max_rows: int,
        cap: int | None = None,
        alpha: float = 0.5,
        chunks: int = DEFAULT_STAGE_CHUNKS,
    ) -> None:
        if cap is None:
            # Staged rows per request and layer (split over the chunks, a chunk's share
            # pooled over the batch's requests): what config's byte budget holds.
            rows = manager.cache.rows
            cap = default_stage_rows(rows.shape[-1] * rows.element_size())
        if cap < 1:
            raise ValueError(f"decode prefetch cap must be >= 1 staged row per request, got {cap}")
        if not 1 <= chunks <= cap:
            raise ValueError(f"decode prefetch chunks must be in 1..cap ({cap}), got {chunks}")
        self.manager = manager
        self.cap = int(cap)
        self.max_rows = int(max_rows)
        self.chunks = int(chunks)
        self.chunk_cap = self.cap // self.chunks
        layers = manager.cache.num_layers
        self._thresholds = layer_state(layers, max_rows, manager.device, float("inf"))
        self.predictors = [
            DecodeThresholdPredictor(
                max_rows,
                manager.device,
                alpha,
                state=(self._thresholds[0][i], self._thresholds[1][i]),
            )
            for i in range(layers)
        ]
        self._streams: dict[str, torch.cuda.Stream] | None = None  # by role, made on first use
        # The staging buffer and its index (shared by the layers: a layer's staging is
        # consumed by its resolve before the next layer's logits start).
        c, dev = manager.cache, manager.device
        entries = self.chunks * self.max_rows * self.chunk_cap
        self.stage_rows = torch.zeros(entries, c.row_dim, dtype=c.rows.dtype, device=dev)
        self.stage_ids = torch.full((entries,), -1, dtype=torch.int64, device=dev)
        self.stage_counts = torch.zeros(self.chunks, dtype=torch.int32, device=dev)
        self.stage_map = torch.zeros(c.host_tokens + 2, dtype=torch.int32, device=dev)

    @property
    def nbytes(self) -> int:
        """Device bytes of the staging (rows, ids, counts, map) and the layers' thresholds."""
        buffers = (self.stage_rows, self.stage_ids, self.stage_counts, self.stage_map)
        return sum(t.nbytes for t in (*buffers, *self._thresholds))

    def chunk_bounds(self, length: int, span: int) -> list[tuple[int, int]]:
        """[start, end) of each chunk of a [B, length] score table, starts aligned to the
        logits kernel's ``span`` positions per program (fewer chunks for short tables).
        Even chunks: a smaller first chunk, to start the copies earlier, was within the
        rounds' spread on an H200 (docs/ARCHITECTURE.md section 6, "Tried")."""
        if length <= 0:
            return [(0, 0)]
        per_chunk = -(-length // self.chunks)
        per = max(-(-per_chunk // span) * span, span)
        return [(s, min(s + per, length)) for s in range(0, length, per)]

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
        computed on the current stream). On CUDA with the kernels: on side streams forked
        here; after the step's last chunk and its top-k, :meth:`finish` hands the layer's
        staging to the manager. Elsewhere: synchronous, in torch."""
        m = self.manager
        batch = scores.shape[0]
        if batch > self.max_rows:
            raise ValueError(f"decode batch of {batch} exceeds the {self.max_rows} request rows")
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
        # The selects on a stream of their own, so that a chunk's select does not queue
        # behind the previous chunk's copy (an H200 profile where half the selections
        # missed: on one stream the second select started only when the first copy ended,
        # long after its logits; timed beside each other, never slower: docs/ARCHITECTURE.md
        # section 6).
        pick = self._side_stream("select")
        pick.wait_stream(torch.cuda.current_stream(m.device))  # fork: this chunk's logits
        with torch.cuda.stream(pick):
            if chunk == 0:
                self.stage_counts.zero_()
            stage_select(*args)
        side.wait_stream(pick)  # the copy waits for this select, not the select for a copy
        with torch.cuda.stream(side):
            # A bounded grid even beside the top-k alone: with the recall's full grid the
            # last chunk's copy held the top-k back, and where half the selections missed
            # the prefetch kept little of its gain (docs/ARCHITECTURE.md section 15).
            stage_copy(*copy_args)
        _used_on(pick, scores, locs, seq_lens, theta)

    def finish(
        self, layer: int, scores: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor
    ) -> None:
        """After the exact top-k of a staged step: the thresholds learn its k-th scores
        (:meth:`observe_topk`) and the layer's staging goes to the manager, whose recall
        waits for the copies only. On CUDA the threshold update runs on a stream of its
        own, joined after the recall: queued behind the copies on the side stream, it held
        the recall back by its own time whenever the last copy outlasted the top-k (an H200
        profile: docs/ARCHITECTURE.md section 15, "Measured choices")."""
        m = self.manager
        staged = self.staged_rows(layer, positions.shape[0])
        side = self._side_stream()
        if side is None:
            self.observe_topk(layer, scores, positions, rows)
            m.prefetches.stage_ready(layer, staged, None)
            return
        copied = torch.cuda.Event()  # the chunks' copies, queued on the side stream
        copied.record(side)
        learn = self._side_stream("learn")
        learn.wait_stream(torch.cuda.current_stream(m.device))  # fork: the top-k
        with torch.cuda.stream(learn):
            self.observe_topk(layer, scores, positions, rows)
            done = torch.cuda.Event()
            done.record(learn)
        m.prefetches.stage_ready(layer, staged, copied, joined=done)
        _used_on(learn, scores, positions, rows)

    def region_limit(self, batch: int) -> int:
        """Rows a batch of ``batch`` requests may stage per chunk (rows per request x
        requests, in any split between them)."""
        return batch * self.chunk_cap

    def staged_rows(self, layer: int, batch: int) -> StagedRows:
        """The staging of ``layer``'s current step (a batch of ``batch`` requests) as the
        recall reads it."""
        return StagedRows(
            self.stage_rows, self.stage_map, self.stage_ids, self.stage_counts,
            self.max_rows * self.chunk_cap, self.region_limit(batch),
            self.manager.prefetch_hits[layer : layer + 1],
        )  # fmt: skip

    def _side_stream(self, role: str = "copy") -> torch.cuda.Stream | None:
        """The side stream of ``role``: "copy" (the staging copies), "select" (the chunks'
        selects) or "learn" (the threshold update); None off CUDA or without kernels."""
        m = self.manager
        if m.device.type != "cuda" or not m.use_kernels:
            return None
        if self._streams is None:
            self._streams = {
                name: torch.cuda.Stream(device=m.device, priority=STAGE_STREAM_PRIORITY)
                for name in ("copy", "select", "learn")
            }
        return self._streams[role]

    def theta(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """Thresholds [B] float32 of the requests in ``rows`` (+inf: no prediction yet)."""
        return self.predictors[layer].predict(rows)

    def observe_topk(
        self, layer: int, scores: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor
    ) -> None:
        """The thresholds of the requests in ``rows`` (distinct) learn this step's exact
        k-th scores, taken from the top-k itself (scores [B, L] float32, positions
        [B, topk]; -inf where fewer than k keys are visible): with the kernels one launch
        computes the k-th scores and updates the thresholds, off the gather and reductions
        a separate k-th score costs."""
        p = self.predictors[layer]
        if not self.manager.use_kernels:
            missing = positions < 0
            picked = torch.gather(scores, 1, positions.clamp(min=0))
            kth = picked.masked_fill(missing, float("inf")).amin(dim=1)
            p.update(kth.masked_fill(missing.any(dim=1), float("-inf")), rows)
            return
        update_thresholds_from_topk(p.theta, p.finite, scores, positions, rows, p.alpha)

    def reset_rows(self, rows: torch.Tensor | list[int]) -> None:
        """Every layer's thresholds of ``rows`` back to "no prediction" (two launches)."""
        reset_layer_rows(self._thresholds, rows, float("inf"))


def _used_on(stream: torch.cuda.Stream, *tensors: torch.Tensor) -> None:
    """Tensors of the current stream that ``stream`` reads: their memory is not handed
    out again before ``stream``'s work queued so far is done (the caching allocator's
    record_stream; under graph capture it holds them to the end of the capture). Without
    it, a step's next allocation on the main stream could reuse a freed score or position
    table while the side stream still reads it (an illegal address on the H200 at 17 x
    100K, eager first steps)."""
    for t in tensors:
        t.record_stream(stream)
