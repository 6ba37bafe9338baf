"""Published decode prefetch: the indexer's logits launch also selects. Each program
publishes its key block's likely misses (logit above the request's predicted threshold,
token not resident) the moment it has scored them, into a per-request region; a copy on a
bounded grid, on a side stream beside the top-k, then moves their rows from pinned host
memory into the staging, and the resolve takes them device to device.

Why (docs/ARCHITECTURE.md section 6): the chunked design (kernels/decode_stage.py) splits
the logits into launches and adds a select pass per chunk, a fixed cost that made it
slower where few selections miss. Here the logits stay one launch, their programs
select as they go (the residency map is read only for keys above the threshold), and
there is no select pass; benchmark/kernels/decode_prefetch_bench.py times both designs.

What was tried and is not here: copying *during* the logits. A copy kernel on another
stream that polls the logits' progress hung an H200 (nothing guarantees two kernels, in
a graph or on two streams, run at the same time); copier programs inside the logits
launch, placed first, wrote wrong rows and then faulted on the H200 at 656-byte rows,
for a reason not found (the same copy code after the launch is right).

Protocol (per layer-step; every buffer has a fixed shape, so the step stays capturable):

- *Publish* (:func:`logits_and_publish`, one program per (request lane b, key block)):
  computes the block's logits exactly as the plain kernel (the shared
  ``_fp8_logits_block``), stores them, and appends the block's candidates to lane b's
  region: ranks from an atomic counter ``counts[b]``, kept below ``cap``; it writes
  ``ids[entry]`` and ``stage_map[id] = entry`` (what the recall validates against,
  kernels/recall.py) and ``queue[entry] = id``.
- *Copy* (:func:`copy_published`, after the logits): copies the entries below each
  lane's count and resets them in the queue, so the queue is empty at every step's start
  with no clearing launch; its last program (an exit counter) publishes ``final[b] =
  min(counts[b], cap)`` for the recall (0 for regions past the batch, which hold an
  earlier step's entries) and zeroes the counters for the next step.

The entries a full region keeps depend on the atomic order, so which candidates are
staged is not deterministic; what attention reads is: a staged row is the host row's
bytes, and the exact top-k and the allocation never look at the staging.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_echo.kernels.cache_layout import ABSENT, byte_rows, byte_vector
from sglang_echo.kernels.device_info import sm_count
from sglang_echo.kernels.indexer import (
    DEFAULT_BLOCK_N,
    DEFAULT_BLOCKS_PER_PROGRAM,
    DEFAULT_NUM_STAGES,
    _check,
    _fp8_logits_block,
    program_span,
)

# Entries a copy program moves at once: 16 rows of 656 bytes are 10.5 KB in flight.
CHUNK_LANES = 16
# The copy's grid, as the chunked design's (kernels/decode_stage.py): with the recall's
# full grid the copy held the top-k beside it back.
COPY_PROGRAMS_PER_SM = 0.25


class LiveStaging:
    """The buffers of one prefetcher (shared by its layers: a layer's staging is consumed
    by its resolve before the next layer's logits start). ``regions`` request lanes of
    ``cap`` entries each; rows in the cache rows' dtype."""

    def __init__(
        self, regions: int, cap: int, row_dim: int, dtype: torch.dtype, host_tokens: int,
        device: torch.device,
    ) -> None:  # fmt: skip
        if regions < 1 or cap < 1:
            raise ValueError(f"live staging needs >= 1 region and cap, got {regions}, {cap}")
        entries = regions * cap
        self.regions, self.cap = regions, cap
        self.rows = torch.zeros(entries, row_dim, dtype=dtype, device=device)
        self.ids = torch.full((entries,), -1, dtype=torch.int64, device=device)
        self.queue = torch.full((entries,), -1, dtype=torch.int64, device=device)
        self.stage_map = torch.zeros(host_tokens + 2, dtype=torch.int32, device=device)
        # counts, final per region; exited [1]
        self.counters = torch.zeros(2, regions, dtype=torch.int32, device=device)
        self.exited = torch.zeros(1, dtype=torch.int32, device=device)

    @property
    def counts(self) -> torch.Tensor:
        return self.counters[0]

    @property
    def final(self) -> torch.Tensor:
        return self.counters[1]

    @property
    def nbytes(self) -> int:
        parts = (self.rows, self.ids, self.queue, self.stage_map, self.counters, self.exited)
        return sum(t.nbytes for t in parts)


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _copy_chunk(
    host_ptr, rows_ptr, queue_ptr, ids, ok, region, lanes, host_stride, rows_stride,
    LANES: tl.constexpr, PIECES: tl.constexpr, ROW_BYTES: tl.constexpr, VEC: tl.constexpr,
):  # fmt: skip
    """rows[region + lane] = host[ids[lane]] where ``ok``; those queue entries back to -1."""
    per_row: tl.constexpr = ROW_BYTES // VEC
    col = tl.arange(0, PIECES)
    v = tl.arange(0, VEC)
    mask = (ok[:, None] & (col < per_row)[None, :])[:, :, None]
    src = (ids[:, None] * host_stride + col[None, :] * VEC)[:, :, None] + v[None, None, :]
    dst = ((region + lanes)[:, None] * rows_stride + col[None, :] * VEC)[:, :, None]
    tl.store(rows_ptr + dst + v[None, None, :], tl.load(host_ptr + src, mask=mask), mask=mask)
    tl.store(queue_ptr + region + lanes, tl.full([LANES], -1, tl.int64), mask=ok)


@triton.jit
def _publish(
    q_ptr, w_ptr, k_ptr, k_scale_ptr, locs_ptr, lens_ptr, out_ptr,
    theta_ptr, rows_ptr, h2d_ptr, ids_ptr, queue_ptr, map_ptr, counts_ptr,
    b, block, length, k_stride, k_scale_stride, locs_stride, out_stride, cap,
    H: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr,
    PRECISE_ACC: tl.constexpr, KEYS_AS_M: tl.constexpr, ABSENT_ID: tl.constexpr,
):  # fmt: skip
    """Lane ``b``'s key blocks from ``block``: logits, and the candidates published."""
    d = tl.arange(0, D)
    h = tl.arange(0, H)
    q = tl.load(q_ptr + b * H * D + h[:, None] * D + d[None, :])
    w = tl.load(w_ptr + b * H + h)
    seq_len = tl.load(lens_ptr + b)
    theta = tl.load(theta_ptr + tl.load(rows_ptr + b))
    region = b.to(tl.int64) * cap
    first = block * BLOCKS * BLOCK_N
    for i in range(BLOCKS):
        n = first + i * BLOCK_N + tl.arange(0, BLOCK_N)
        logits, loc, live = _fp8_logits_block(
            q, w, k_ptr, k_scale_ptr, locs_ptr, b, n, seq_len, k_stride, k_scale_stride,
            locs_stride, D=D, PRECISE_ACC=PRECISE_ACC, KEYS_AS_M=KEYS_AS_M,
        )  # fmt: skip
        tl.store(out_ptr + b * out_stride + n, logits, mask=n < length)
        # The residency map is read only for keys above theta: a few per block.
        over = live & (logits > theta)
        slot = tl.load(h2d_ptr + loc, mask=over, other=0)
        flag = over & (slot == ABSENT_ID)
        flags = flag.to(tl.int32)
        n_flags = tl.sum(flags, 0)
        base = tl.atomic_add(counts_ptr + b, n_flags, mask=n_flags > 0)
        rank = base + tl.cumsum(flags, 0) - 1
        take = flag & (rank < cap)
        entry = region + rank
        tl.store(ids_ptr + entry, loc, mask=take)
        tl.store(map_ptr + loc, entry.to(tl.int32), mask=take)
        tl.store(queue_ptr + entry, loc, mask=take)


@triton.jit
def _logits_publish_kernel(
    q_ptr, w_ptr, k_ptr, k_scale_ptr, locs_ptr, lens_ptr, out_ptr,
    theta_ptr, rows_ptr, h2d_ptr, ids_ptr, queue_ptr, map_ptr, counts_ptr,
    length, k_stride, k_scale_stride, locs_stride, out_stride, cap,
    H: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr,
    PRECISE_ACC: tl.constexpr, KEYS_AS_M: tl.constexpr, ABSENT_ID: tl.constexpr,
):  # fmt: skip
    _publish(
        q_ptr, w_ptr, k_ptr, k_scale_ptr, locs_ptr, lens_ptr, out_ptr,
        theta_ptr, rows_ptr, h2d_ptr, ids_ptr, queue_ptr, map_ptr, counts_ptr,
        tl.program_id(0), tl.program_id(1), length, k_stride, k_scale_stride, locs_stride,
        out_stride, cap, H=H, D=D, BLOCK_N=BLOCK_N, BLOCKS=BLOCKS,
        PRECISE_ACC=PRECISE_ACC, KEYS_AS_M=KEYS_AS_M, ABSENT_ID=ABSENT_ID,
    )  # fmt: skip


@triton.jit
def _copy_kernel(
    host_ptr, rows_ptr, queue_ptr, counts_ptr, final_ptr, exited_ptr, total_ptr,
    batch, regions, cap, host_stride, rows_stride,
    LANES: tl.constexpr, PIECES: tl.constexpr, BATCH_BLOCK: tl.constexpr,
    ROW_BYTES: tl.constexpr, VEC: tl.constexpr,
):  # fmt: skip
    """After the logits (stream order, nothing to wait for): copy every entry below a
    lane's count, reset it in the queue; the last program to finish publishes ``final``
    and zeroes the counters for the next step."""
    n_programs = tl.num_programs(0)
    total_chunks = batch * tl.cdiv(cap, LANES)
    bs = tl.arange(0, BATCH_BLOCK)
    in_batch = bs < batch
    lane = tl.arange(0, LANES)
    counts = tl.minimum(tl.load(counts_ptr + bs, mask=in_batch, other=0), cap)
    most = tl.max(counts, 0)
    j = tl.program_id(0)
    # Chunk j starts at (j // batch) x LANES: past the longest lane, all are empty.
    while (j < total_chunks) & ((j // batch) * LANES < most):
        c = j // batch
        b = j - c * batch
        lanes = c * LANES + lane
        region = b.to(tl.int64) * cap
        cnt = tl.sum(tl.where(bs == b, counts, 0), 0)
        ids = tl.load(queue_ptr + region + lanes, mask=lanes < cnt, other=-1)
        _copy_chunk(
            host_ptr, rows_ptr, queue_ptr, ids, ids >= 0, region, lanes, host_stride,
            rows_stride, LANES=LANES, PIECES=PIECES, ROW_BYTES=ROW_BYTES, VEC=VEC,
        )  # fmt: skip
        j += n_programs
    tl.debug_barrier()
    last = tl.atomic_add(exited_ptr, 1) == n_programs - 1
    # Regions past the batch hold an earlier step's entries: final 0 keeps them out.
    tl.store(final_ptr + bs, counts, mask=(bs < regions) & last)
    tl.store(counts_ptr + bs, tl.zeros([BATCH_BLOCK], tl.int32), mask=in_batch & last)
    tl.store(exited_ptr, 0, mask=last)
    tl.atomic_add(total_ptr, tl.sum(counts, 0).to(tl.int64), mask=last)


# --------------------------------------------------------------------------- launchers
def copy_programs(device: torch.device) -> int:
    """A quarter of the SMs: the top-k beside the copy keeps the rest."""
    if device.type != "cuda":
        return 2  # the interpreter: programs share the chunks in tests
    return max(1, int(COPY_PROGRAMS_PER_SM * sm_count(device.index)))


def _copy_constants(host_rows: torch.Tensor, staging: LiveStaging) -> tuple:
    host_b, rows_b = byte_rows(host_rows, "staging"), byte_rows(staging.rows, "staging")
    if host_b.shape[1] != rows_b.shape[1]:
        raise ValueError("host and staging rows must have the same width")
    row_bytes = host_b.shape[1]
    vec = byte_vector(row_bytes)
    constants = dict(
        LANES=CHUNK_LANES, PIECES=triton.next_power_of_2(row_bytes // vec),
        BATCH_BLOCK=triton.next_power_of_2(staging.regions), ROW_BYTES=row_bytes, VEC=vec,
    )  # fmt: skip
    return host_b, rows_b, constants


def logits_and_publish(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    key_scales: torch.Tensor,
    locs: torch.Tensor,
    seq_lens: torch.Tensor,
    theta_table: torch.Tensor,
    request_rows: torch.Tensor,
    host_to_device: torch.Tensor,
    staging: LiveStaging,
    block_n: int = DEFAULT_BLOCK_N,
    blocks_per_program: int = DEFAULT_BLOCKS_PER_PROGRAM,
    num_warps: int = 4,
    num_stages: int = DEFAULT_NUM_STAGES,
) -> torch.Tensor:
    """The fp8 indexer logits [B, L] (bit-identical to kernels/indexer.fp8_index_logits
    with the same block parameters) and, per request lane b, its candidates published into
    ``staging`` (threshold ``theta_table[request_rows[b]]``, residency ``host_to_device``
    of the layer). Follow it with :func:`copy_published`."""
    if keys.stride(1) != 1:
        raise ValueError("keys need unit stride along D")
    _check(q, weights, keys, key_scales, locs, seq_lens)
    batch, heads, dim = q.shape
    if batch > staging.regions:
        raise ValueError(f"batch of {batch} exceeds the staging's {staging.regions} regions")
    length = locs.shape[1]
    out = torch.empty(batch, length, dtype=torch.float32, device=q.device)
    if batch == 0 or length == 0:
        return out
    grid = (batch, triton.cdiv(length, program_span(block_n, blocks_per_program)))
    _logits_publish_kernel[grid](
        q.contiguous(), weights.contiguous().float(), keys, key_scales, locs, seq_lens, out,
        theta_table, request_rows, host_to_device, staging.ids, staging.queue,
        staging.stage_map, staging.counts,
        length, keys.stride(0), key_scales.stride(0), locs.stride(0), out.stride(0), staging.cap,
        H=heads, D=dim, BLOCK_N=block_n, BLOCKS=blocks_per_program, PRECISE_ACC=32,
        KEYS_AS_M=True, ABSENT_ID=ABSENT, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


def copy_published(
    host_rows: torch.Tensor,
    staging: LiveStaging,
    batch: int,
    total: torch.Tensor,
    grid: int | None = None,
) -> None:
    """After :func:`logits_and_publish` (stream order): copy the published rows into
    ``staging.rows``, set ``staging.final`` and add the staged rows to ``total`` (int64
    [1]). On a bounded grid (default a quarter of the SMs), so on a side stream it runs
    beside the top-k. ``host_rows`` must be addressable by the kernel (the pinned pool's
    CUDA alias; any tensor when interpreted)."""
    host_b, rows_b, constants = _copy_constants(host_rows, staging)
    if batch == 0:
        return
    _copy_kernel[(grid or copy_programs(rows_b.device),)](
        host_b, rows_b, staging.queue, staging.counts, staging.final,
        staging.exited, total, batch, staging.regions, staging.cap, host_b.stride(0),
        rows_b.stride(0), **constants,
    )  # fmt: skip


# --------------------------------------------------------------------------- reference
def publish_and_copy_reference(
    scores: torch.Tensor,
    locs: torch.Tensor,
    seq_lens: torch.Tensor,
    theta: torch.Tensor,
    host_to_device: torch.Tensor,
    host_rows: torch.Tensor,
    staging: LiveStaging,
    total: torch.Tensor,
) -> None:
    """Both kernels' effect in torch, from computed scores [B, L] and thresholds [B]: each
    lane's first ``cap`` candidates in position order staged (the kernels keep some
    ``cap`` of them when a lane has more), ``final`` set (0 past the batch), the working
    counters left zero."""
    batch, length = scores.shape
    cap = staging.cap
    pos = torch.arange(length, device=scores.device)
    visible = pos[None, :] < seq_lens.to(torch.int64)[:, None]
    loc = torch.where(visible, locs[:, :length].to(torch.int64), 0)
    flag = visible & (scores > theta[:, None]) & (host_to_device[loc] == ABSENT)
    rank = torch.cumsum(flag.to(torch.int64), 1) - 1
    take = flag & (rank < cap)
    lane = torch.arange(batch, device=scores.device)[:, None].expand_as(rank)
    entry = (lane * cap + rank)[take]
    ids = loc[take]
    staging.ids[entry] = ids
    staging.stage_map[ids] = entry.to(staging.stage_map.dtype)
    staging.rows[entry] = host_rows[ids.to(host_rows.device)].to(staging.rows.device)
    kept = take.sum(dim=1).to(staging.final.dtype)
    staging.final.zero_()  # regions past the batch hold an earlier step's entries
    staging.final[:batch] = kept
    total += kept.sum().to(total.dtype)
