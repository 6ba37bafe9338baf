"""Decode prefetch inside the indexer's logits kernel (ECHO's in-kernel prefetch): each
program that scores a block of a request's keys also stages that block's predicted
misses, so the rows start crossing PCIe while the rest of the logits are computed.

Per key block, after its logits (the plain kernel's code, kernels/indexer.py
``_fp8_logits_block``, so the scores are the same bits):

1. *flag*: positions whose logit beats the request's predicted threshold ``theta[b]`` and
   whose host id is not resident (``host_to_device[id] == ABSENT``; the map is read only
   for keys above theta, a few per request);
2. *reserve*: a block with flags takes ranks in its request's region with one atomic on
   the request's counter; ranks at or past ``cap`` are dropped (a poor threshold cannot
   take more than the region);
3. *record*: ``ids[b * cap + rank] = id`` and ``stage_map[id] = b * cap + rank``;
4. *copy*: the block's kept rows, host -> ``rows[b * cap + rank]``, by the same program.

A block with no flags costs a compare and a masked gather; nothing is launched for the
prefetch at all. Why the program copies its own rows (issue 29's overlap probe and the
chunked design in kernels/decode_stage.py): a copy that waits for a chunk of logits to
finish overlaps at most the chunks after it, and a separate select relaunches over scores
already in registers here. A program stalled on PCIe reads holds its SM slot, but the
other resident programs keep computing, and only blocks with misses stall.

The staging is read by the recall through ``StagedRows`` (kernels/decode_stage.py): here
a region is a request's (``cap`` entries, count ``counts[b]``), and an entry is valid for
a host id when ``ids[entry] == id`` and its lane lies below the region's count, so the map
needs no clearing. Which candidates fill a full region follows the order of the atomics,
so it is not deterministic; what attention reads is: the exact top-k and the allocation
never look at the staging, and a staged row is the host row's bytes.

A split between the logits and a side stream (``copy_limit``): the kernel copies only
the ranks below ``copy_limit`` of each region, and :func:`copy_rest`, launched on a side
stream after the logits on a bounded grid, copies the others while the top-k and the
allocation run; the recall waits for it. The transfer then spans the logits and what
follows them, and fewer logits programs wait on PCIe.

:func:`stage_scores` applies steps 1-4 to scores already computed (the bf16 indexer's),
from the same block code.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_echo.kernels.cache_layout import ABSENT, byte_rows, byte_vector
from sglang_echo.kernels.decode_stage import (
    COPY_CHUNKS,
    StagedRows,
    _copy_pieces,
    copy_programs,
)
from sglang_echo.kernels.indexer import (
    DEFAULT_BLOCK_N,
    DEFAULT_NUM_STAGES,
    _check,
    _fp8_logits_block,
    _request_query,
)

# Keys per program of the staged logits kernel: the plain kernel's block (its bits).
STAGE_BLOCK_N = DEFAULT_BLOCK_N
COPY_PIECES = 128  # VEC-byte pieces a program copies per iteration (2 KB at 16-byte pieces)
SCORES_TILE = 1024  # positions per program of stage_scores


class StageBuffers:
    """One layer-step's in-kernel staging: ``rows`` [regions x cap, row_dim], ``ids``
    [regions x cap] int64, ``counts`` [regions] int32 (may exceed cap: ranks past it are
    dropped), ``stage_map`` [host tokens + 2] int32 (never cleared). A region per request
    of the batch. Shared by the layers: a layer's staging is consumed by its resolve
    before the next layer's logits start."""

    def __init__(self, regions: int, cap: int, row_dim: int, dtype, host_tokens: int, device):
        if regions < 1 or cap < 1:
            raise ValueError(f"staging needs >= 1 region and >= 1 row each, got {regions}, {cap}")
        self.regions, self.cap = int(regions), int(cap)
        entries = self.regions * self.cap
        self.rows = torch.zeros(entries, row_dim, dtype=dtype, device=device)
        self.ids = torch.full((entries,), -1, dtype=torch.int64, device=device)
        self.counts = torch.zeros(self.regions, dtype=torch.int32, device=device)
        self.stage_map = torch.zeros(host_tokens + 2, dtype=torch.int32, device=device)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.rows, self.ids, self.counts, self.stage_map))

    def view(self, hits: torch.Tensor) -> StagedRows:
        """As the recall reads it; ``hits`` [1] int64 counts the staged rows recalled."""
        return StagedRows(
            self.rows, self.stage_map, self.ids, self.counts, self.cap, self.cap, hits
        )

    def begin(self, batch: int) -> None:
        """Empty every region before a batch of ``batch`` requests stages: all of them, not
        only the batch's, since a region past the batch keeps an earlier, larger batch's
        count, and a stale map entry into it would pass the recall's validity rule."""
        if batch > self.regions:
            raise ValueError(f"a batch of {batch} requests exceeds the {self.regions} regions")
        self.counts.zero_()


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _stage_block(
    logits, loc, live, b, theta, h2d_ptr, host_ptr, rows_ptr, ids_ptr, counts_ptr, map_ptr,
    total_ptr, cap, copy_limit, host_stride, rows_stride,
    ABSENT_ID: tl.constexpr, ROW_BYTES: tl.constexpr, VEC: tl.constexpr,
    PIECES: tl.constexpr,
):  # fmt: skip
    """Steps 1-4 of the module docstring for one block of request ``b``'s positions; step 4
    only for ranks below ``copy_limit`` (:func:`copy_rest` moves the others)."""
    over = live & (logits > theta)
    slot = tl.load(h2d_ptr + loc, mask=over, other=0)
    flag = over & (slot == ABSENT_ID)
    flags = flag.to(tl.int32)
    n_flags = tl.sum(flags, 0)
    if n_flags > 0:
        base = tl.atomic_add(counts_ptr + b, n_flags)
        rank = base + tl.cumsum(flags, 0) - 1
        take = flag & (rank < cap)
        region = b.to(tl.int64) * cap
        entry = region + rank
        tl.store(ids_ptr + entry, loc, mask=take)
        tl.store(map_ptr + loc, entry.to(tl.int32), mask=take)
        kept = tl.maximum(tl.minimum(n_flags, cap - base), 0)
        tl.atomic_add(total_ptr, kept.to(tl.int64))
        tl.debug_barrier()  # the ids stored above by other threads of this program
        per_row: tl.constexpr = ROW_BYTES // VEC
        copied = tl.maximum(tl.minimum(n_flags, copy_limit - base), 0)
        pieces = copied.to(tl.int64) * per_row
        start = tl.zeros((), dtype=tl.int64)
        while start < pieces:
            piece = start + tl.arange(0, PIECES)
            e = region + base + piece // per_row
            col = (piece % per_row) * VEC
            _copy_pieces(
                host_ptr, rows_ptr, ids_ptr, e, col, piece < pieces, host_stride, rows_stride,
                VEC=VEC,
            )  # fmt: skip
            start += PIECES


@triton.jit
def _fp8_logits_stage_kernel(
    q_ptr, w_ptr, k_ptr, k_scale_ptr, locs_ptr, lens_ptr, out_ptr,
    theta_ptr, h2d_ptr, host_ptr, rows_ptr, ids_ptr, counts_ptr, map_ptr, total_ptr,
    length, k_stride, k_scale_stride, locs_stride, out_stride, cap, copy_limit, host_stride,
    rows_stride,
    H: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISE_ACC: tl.constexpr,
    KEYS_AS_M: tl.constexpr, ABSENT_ID: tl.constexpr, ROW_BYTES: tl.constexpr,
    VEC: tl.constexpr, PIECES: tl.constexpr,
):  # fmt: skip
    """The plain logits kernel's block (one per program), then its staging."""
    b = tl.program_id(0)
    q, w, seq_len = _request_query(q_ptr, w_ptr, lens_ptr, b, H=H, D=D)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    logits, loc, live = _fp8_logits_block(
        q, w, k_ptr, k_scale_ptr, locs_ptr, b, n, seq_len, k_stride, k_scale_stride,
        locs_stride, D=D, PRECISE_ACC=PRECISE_ACC, KEYS_AS_M=KEYS_AS_M,
    )  # fmt: skip
    tl.store(out_ptr + b * out_stride + n, logits, mask=n < length)
    _stage_block(
        logits, loc, live, b, tl.load(theta_ptr + b), h2d_ptr, host_ptr, rows_ptr, ids_ptr,
        counts_ptr, map_ptr, total_ptr, cap, copy_limit, host_stride, rows_stride,
        ABSENT_ID=ABSENT_ID, ROW_BYTES=ROW_BYTES, VEC=VEC, PIECES=PIECES,
    )  # fmt: skip


@triton.jit
def _scores_stage_kernel(
    scores_ptr, locs_ptr, lens_ptr, theta_ptr, h2d_ptr, host_ptr, rows_ptr, ids_ptr,
    counts_ptr, map_ptr, total_ptr, length, scores_stride, locs_stride, cap, host_stride,
    rows_stride,
    TILE: tl.constexpr, ABSENT_ID: tl.constexpr, ROW_BYTES: tl.constexpr, VEC: tl.constexpr,
    PIECES: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    n = tl.program_id(1) * TILE + tl.arange(0, TILE)
    live = (n < length) & (n < tl.load(lens_ptr + b))
    s = tl.load(scores_ptr + b * scores_stride + n, mask=live, other=float("-inf"))
    loc = tl.load(locs_ptr + b * locs_stride + n, mask=live, other=0).to(tl.int64)
    _stage_block(
        s, loc, live, b, tl.load(theta_ptr + b), h2d_ptr, host_ptr, rows_ptr, ids_ptr,
        counts_ptr, map_ptr, total_ptr, cap, cap, host_stride, rows_stride,
        ABSENT_ID=ABSENT_ID, ROW_BYTES=ROW_BYTES, VEC=VEC, PIECES=PIECES,
    )  # fmt: skip


@triton.jit
def _copy_rest_kernel(
    host_ptr, rows_ptr, ids_ptr, counts_ptr, regions, cap, copy_limit, host_stride,
    rows_stride,
    ROW_BYTES: tl.constexpr, VEC: tl.constexpr, CHUNKS: tl.constexpr,
):  # fmt: skip
    """rows[e] = host[ids[e]] for each region's ranks in [copy_limit, min(count, cap)): a
    grid-stride loop over (lane, VEC-byte piece) of every region in turn."""
    per_row: tl.constexpr = ROW_BYTES // VEC
    b = tl.zeros((), dtype=tl.int64)
    while b < regions:  # (a while loop: the interpreter's range() takes no runtime bound)
        staged = tl.minimum(tl.load(counts_ptr + b), cap)
        rest = tl.maximum(staged - copy_limit, 0).to(tl.int64) * per_row
        first = b * cap + copy_limit
        base = tl.program_id(0).to(tl.int64) * CHUNKS
        while base < rest:
            piece = base + tl.arange(0, CHUNKS)
            e = first + piece // per_row
            col = (piece % per_row) * VEC
            _copy_pieces(
                host_ptr, rows_ptr, ids_ptr, e, col, piece < rest, host_stride, rows_stride,
                VEC=VEC,
            )  # fmt: skip
            base += tl.num_programs(0) * CHUNKS
        b += 1


# --------------------------------------------------------------------------- launchers
def _stage_args(
    host_rows: torch.Tensor, stage: StageBuffers, batch: int
) -> tuple[tuple, dict, torch.Tensor, torch.Tensor]:
    host_b, rows_b = byte_rows(host_rows, "staging"), byte_rows(stage.rows, "staging")
    if host_b.shape[1] != rows_b.shape[1]:
        raise ValueError("host and staging rows must have the same width")
    stage.begin(batch)
    row_bytes = host_b.shape[1]
    consts = dict(ROW_BYTES=row_bytes, VEC=byte_vector(row_bytes), PIECES=COPY_PIECES)
    return (host_b, rows_b, stage.ids, stage.counts, stage.stage_map), consts, host_b, rows_b


def fp8_index_logits_staged(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    key_scales: torch.Tensor,
    locs: torch.Tensor,
    seq_lens: torch.Tensor,
    theta: torch.Tensor,
    host_to_device: torch.Tensor,
    host_rows: torch.Tensor,
    stage: StageBuffers,
    total: torch.Tensor,
    block_n: int = STAGE_BLOCK_N,
    num_warps: int = 4,
    num_stages: int = DEFAULT_NUM_STAGES,
    copy_limit: int | None = None,
) -> torch.Tensor:
    """:func:`kernels.indexer.fp8_index_logits` (same arguments and bits, one key block per
    program) that also stages each request's misses above ``theta`` [B] float32 into its
    region of ``stage`` (emptied here first) and adds the staged rows to ``total`` (int64
    [1]). ``host_rows`` [host tokens, row_dim]: the pinned pool's CUDA alias (any tensor
    when interpreted). ``copy_limit``: the kernel copies the rows of ranks below it (None:
    all); :func:`copy_rest` copies the others. One launch beside the counters' memset."""
    if keys.stride(1) != 1:
        raise ValueError("keys need unit stride along D")
    _check(q, weights, keys, key_scales, locs, seq_lens)
    batch, heads, dim = q.shape
    length = locs.shape[1]
    out = torch.empty(batch, length, dtype=torch.float32, device=q.device)
    if batch == 0 or length == 0:
        return out
    buffers, consts, host_b, rows_b = _stage_args(host_rows, stage, batch)
    _fp8_logits_stage_kernel[(batch, triton.cdiv(length, block_n))](
        q.contiguous(), weights.contiguous().float(), keys, key_scales, locs, seq_lens, out,
        theta, host_to_device, *buffers, total,
        length, keys.stride(0), key_scales.stride(0), locs.stride(0), out.stride(0),
        stage.cap, stage.cap if copy_limit is None else copy_limit, host_b.stride(0),
        rows_b.stride(0),
        H=heads, D=dim, BLOCK_N=block_n, PRECISE_ACC=32, KEYS_AS_M=True, ABSENT_ID=ABSENT,
        num_warps=num_warps, num_stages=num_stages, **consts,
    )  # fmt: skip
    return out


def stage_scores(
    scores: torch.Tensor,
    locs: torch.Tensor,
    seq_lens: torch.Tensor,
    theta: torch.Tensor,
    host_to_device: torch.Tensor,
    host_rows: torch.Tensor,
    stage: StageBuffers,
    total: torch.Tensor,
) -> None:
    """The staging of :func:`fp8_index_logits_staged` from computed scores [B, L] float32
    (locs [B, >= L] host ids, seq_lens [B], theta [B] float32). One launch beside the
    counters' memset."""
    batch, length = scores.shape
    if batch == 0 or length == 0:
        return
    buffers, consts, host_b, rows_b = _stage_args(host_rows, stage, batch)
    _scores_stage_kernel[(batch, triton.cdiv(length, SCORES_TILE))](
        scores, locs, seq_lens, theta, host_to_device, *buffers, total,
        length, scores.stride(0), locs.stride(0), stage.cap, host_b.stride(0), rows_b.stride(0),
        TILE=SCORES_TILE, ABSENT_ID=ABSENT, **consts,
    )  # fmt: skip


def copy_rest(
    host_rows: torch.Tensor,
    stage: StageBuffers,
    batch: int,
    copy_limit: int,
    programs: int | None = None,
) -> None:
    """Copy the staged rows the logits kernel left (ranks ``copy_limit`` up to each
    region's count, at most ``cap``) for a batch of ``batch`` requests, on a bounded grid
    (``programs``, default a quarter of the SMs, as the chunked design's copy): launched on
    a side stream after the logits, it runs beside the top-k and the allocation."""
    host_b, rows_b = byte_rows(host_rows, "staging"), byte_rows(stage.rows, "staging")
    if batch == 0 or copy_limit >= stage.cap:
        return
    row_bytes = host_b.shape[1]
    _copy_rest_kernel[(programs or copy_programs(rows_b.device),)](
        host_b, rows_b, stage.ids, stage.counts, batch, stage.cap, copy_limit,
        host_b.stride(0), rows_b.stride(0),
        ROW_BYTES=row_bytes, VEC=byte_vector(row_bytes), CHUNKS=COPY_CHUNKS,
    )  # fmt: skip


# --------------------------------------------------------------------------- reference
def copy_rest_reference(
    host_rows: torch.Tensor, stage: StageBuffers, batch: int, copy_limit: int
) -> None:
    """:func:`copy_rest` in torch (reads the counts on the host)."""
    for b in range(batch):
        n = max(min(int(stage.counts[b]), stage.cap) - copy_limit, 0)
        entries = torch.arange(b * stage.cap + copy_limit, b * stage.cap + copy_limit + n)
        entries = entries.to(stage.rows.device)
        ids = stage.ids[entries]
        stage.rows[entries] = host_rows[ids.to(host_rows.device)].to(stage.rows.device)


def stage_scores_reference(
    scores: torch.Tensor,
    locs: torch.Tensor,
    seq_lens: torch.Tensor,
    theta: torch.Tensor,
    host_to_device: torch.Tensor,
    host_rows: torch.Tensor,
    stage: StageBuffers,
    total: torch.Tensor,
) -> None:
    """:func:`stage_scores` in torch: each request's candidates in position order, the
    first ``cap`` kept (the kernels' order within a region follows their atomics, and so
    does their set when a region overflows); ``counts[b]`` = all its candidates."""
    batch, length = scores.shape
    if batch == 0 or length == 0:
        return
    stage.begin(batch)
    pos = torch.arange(length, device=scores.device)
    visible = pos[None, :] < seq_lens.to(torch.int64)[:, None]
    loc = torch.where(visible, locs[:, :length].to(torch.int64), 0)
    over = visible & (scores > theta[:, None])
    flag = over & (host_to_device[loc] == ABSENT)
    for b in range(batch):
        ids = loc[b][flag[b]]
        kept = ids[: stage.cap]
        entries = b * stage.cap + torch.arange(kept.numel(), device=ids.device)
        stage.ids[entries] = kept
        stage.stage_map[kept] = entries.to(stage.stage_map.dtype)
        stage.rows[entries] = host_rows[kept.to(host_rows.device)].to(stage.rows.device)
        stage.counts[b] = ids.numel()
        total += kept.numel()
