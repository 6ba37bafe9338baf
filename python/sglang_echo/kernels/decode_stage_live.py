"""Live decode prefetch: the indexer's logits kernel publishes each key block's likely
misses the moment it has scored them, and a copy kernel on a bounded grid, running beside
it, moves their rows from pinned host memory into a per-request staging region while the
rest of the logits are still being computed.

Why (issue 29's overlap probe, docs/ARCHITECTURE.md section 6): a copy that starts after
the logits overlaps only the top-k; one on a bounded grid that runs *during* the logits
hid them behind a recall almost entirely. The chunked design (kernels/decode_stage.py)
gets part of the way with two logits launches and a select pass per chunk; here there is
one logits launch, no select pass, and the copy starts with the first key block.

Protocol (per layer-step; every buffer has a fixed shape, so the step stays capturable):

- *Producer* (:func:`logits_and_publish`, one program per (request lane b, key block)):
  computes the block's logits exactly as the plain kernel (the shared
  ``_fp8_logits_block``), stores them, and appends the block's candidates (logit above
  the request's threshold, token not resident) to lane b's region: ranks from an atomic
  counter ``counts[b]``, kept below ``cap``; it writes ``ids[entry]`` and
  ``stage_map[id] = entry`` (what the recall validates against, kernels/recall.py) and
  then ``queue[entry] = id`` (what the copy polls). After a CTA barrier, one atomic
  (acquire-release) counts the program in ``done[b]``.
- *Consumer* (:func:`copy_published`, a grid of a quarter of the SMs): walks lane b's
  region in chunks of ``LANES`` entries, chunk ``j = c * batch + b`` in program-strided
  order, so every request is served from its first candidates on. A chunk is copied once
  every entry below the count is written and either the chunk is full or lane b's
  producers are all done (``done[b]`` read with acquire, then the count). The copy resets
  the chunk's queue entries to -1, so the queue is empty at every step's start with no
  clearing launch. Once every producer is done and no region reaches the next chunk, the
  program stops; the last program to stop (an exit counter) publishes ``final[b] =
  min(counts[b], cap)`` for the recall (0 for regions past the batch, which hold an
  earlier step's entries) and zeroes the counters for the next step.

No program ever waits for a consumer, and the consumer's grid leaves most SMs to the
producers, so any schedule terminates (also serialised: the launcher enqueues the
producer first). The entries a full region keeps depend on the atomic order, so which
candidates are staged is not deterministic; what attention reads is: a staged row is
the host row's bytes, and the exact top-k and the allocation never look at the staging.
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

# Entries a consumer program copies per poll: 16 rows of 656 bytes are 10.5 KB in flight.
CHUNK_LANES = 16
# The copy's grid, as the chunked design's (kernels/decode_stage.py): the overlap probe hid
# the logits behind a recall on 33-66 programs and nothing at 132 or more.
CONSUMER_PROGRAMS_PER_SM = 0.25


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
        # counts, done, final per region; exited [1]
        self.counters = torch.zeros(3, regions, dtype=torch.int32, device=device)
        self.exited = torch.zeros(1, dtype=torch.int32, device=device)

    @property
    def counts(self) -> torch.Tensor:
        return self.counters[0]

    @property
    def done(self) -> torch.Tensor:
        return self.counters[1]

    @property
    def final(self) -> torch.Tensor:
        return self.counters[2]

    @property
    def nbytes(self) -> int:
        parts = (self.rows, self.ids, self.queue, self.stage_map, self.counters, self.exited)
        return sum(t.nbytes for t in parts)


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _logits_publish_kernel(
    q_ptr, w_ptr, k_ptr, k_scale_ptr, locs_ptr, lens_ptr, out_ptr,
    theta_ptr, rows_ptr, h2d_ptr, ids_ptr, queue_ptr, map_ptr, counts_ptr, done_ptr,
    length, k_stride, k_scale_stride, locs_stride, out_stride, cap,
    H: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr,
    PRECISE_ACC: tl.constexpr, KEYS_AS_M: tl.constexpr, ABSENT_ID: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    d = tl.arange(0, D)
    h = tl.arange(0, H)
    q = tl.load(q_ptr + b * H * D + h[:, None] * D + d[None, :])
    w = tl.load(w_ptr + b * H + h)
    seq_len = tl.load(lens_ptr + b)
    theta = tl.load(theta_ptr + tl.load(rows_ptr + b))
    region = b.to(tl.int64) * cap
    first = tl.program_id(1) * BLOCKS * BLOCK_N
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
    # Every thread's stores above happen before the count below (acquire-release).
    tl.debug_barrier()
    tl.atomic_add(done_ptr + b, 1)


@triton.jit
def _copy_published_kernel(
    host_ptr, rows_ptr, queue_ptr, counts_ptr, done_ptr, final_ptr, exited_ptr, total_ptr,
    batch, regions, programs, cap, host_stride, rows_stride,
    LANES: tl.constexpr, PIECES: tl.constexpr, BATCH_BLOCK: tl.constexpr,
    ROW_BYTES: tl.constexpr, VEC: tl.constexpr,
):  # fmt: skip
    per_row: tl.constexpr = ROW_BYTES // VEC
    n_programs = tl.num_programs(0)
    total_chunks = batch * tl.cdiv(cap, LANES)
    bs = tl.arange(0, BATCH_BLOCK)
    in_batch = bs < batch
    lane = tl.arange(0, LANES)
    col = tl.arange(0, PIECES)
    col_ok = col < per_row
    v = tl.arange(0, VEC)
    all_done = tl.full([], 0, tl.int32)
    j = tl.program_id(0)
    while j < total_chunks:
        c = j // batch
        b = j - c * batch
        lo = c * LANES
        lanes = lo + lane
        region = b.to(tl.int64) * cap
        ready = tl.full([], 0, tl.int32)
        need = lane < 0
        ids = tl.full([LANES], -1, tl.int64)
        most = tl.full([], 0, tl.int32)
        while ready == 0:
            # done before counts: a finished lane's count is then its last.
            done = tl.atomic_add(done_ptr + bs, 0, mask=in_batch, sem="acquire")
            counts = tl.load(counts_ptr + bs, mask=in_batch, other=0, volatile=True)
            counts = tl.minimum(counts, cap)
            finished = in_batch & (done >= programs)
            all_done = (tl.sum((in_batch & ~finished).to(tl.int32), 0) == 0).to(tl.int32)
            most = tl.max(tl.where(in_batch, counts, 0), 0)
            mine = bs == b
            fin = tl.sum((mine & finished).to(tl.int32), 0) > 0
            cnt = tl.sum(tl.where(mine, counts, 0), 0)
            need = lanes < cnt
            ids = tl.load(queue_ptr + region + lanes, mask=need, other=-1, volatile=True)
            unwritten = tl.sum((need & (ids < 0)).to(tl.int32), 0)
            full = cnt >= tl.minimum(lo + LANES, cap)
            ready = ((unwritten == 0) & (fin | full)).to(tl.int32)
        ok = need[:, None] & col_ok[None, :]
        src = (ids[:, None] * host_stride + col[None, :] * VEC)[:, :, None] + v[None, None, :]
        dst = ((region + lanes)[:, None] * rows_stride + col[None, :] * VEC)[:, :, None]
        dst = dst + v[None, None, :]
        tl.store(rows_ptr + dst, tl.load(host_ptr + src, mask=ok[:, :, None]), mask=ok[:, :, None])
        tl.store(queue_ptr + region + lanes, tl.full([LANES], -1, tl.int64), mask=need)
        # Chunks after this one start at or past ``lo``: once every lane is done and no
        # region reaches past ``lo``, they are all empty.
        j = tl.where((all_done != 0) & (most <= lo), total_chunks, j + n_programs)
    # Stop only once every producer is done: the last program zeroes their counters.
    while all_done == 0:
        done = tl.atomic_add(done_ptr + bs, 0, mask=in_batch, sem="acquire")
        all_done = (tl.sum((in_batch & (done < programs)).to(tl.int32), 0) == 0).to(tl.int32)
    tl.debug_barrier()
    last = tl.atomic_add(exited_ptr, 1) == n_programs - 1
    mask = in_batch & last
    kept = tl.minimum(tl.load(counts_ptr + bs, mask=mask, other=0, volatile=True), cap)
    # Regions past the batch hold an earlier step's entries: final 0 keeps them out.
    tl.store(final_ptr + bs, kept, mask=(bs < regions) & last)
    tl.store(counts_ptr + bs, tl.zeros([BATCH_BLOCK], tl.int32), mask=mask)
    tl.store(done_ptr + bs, tl.zeros([BATCH_BLOCK], tl.int32), mask=mask)
    tl.store(exited_ptr, 0, mask=last)
    tl.atomic_add(total_ptr, tl.sum(kept, 0).to(tl.int64), mask=last)


# --------------------------------------------------------------------------- launchers
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
) -> tuple[torch.Tensor, int]:
    """The fp8 indexer logits [B, L] (bit-identical to kernels/indexer.fp8_index_logits
    with the same block parameters) and, per request lane b, its candidates published into
    ``staging`` (threshold ``theta_table[request_rows[b]]``, residency ``host_to_device``
    of the layer). Returns (logits, producer programs per lane) for :func:`copy_published`.
    """
    if keys.stride(1) != 1:
        raise ValueError("keys need unit stride along D")
    _check(q, weights, keys, key_scales, locs, seq_lens)
    batch, heads, dim = q.shape
    if batch > staging.regions:
        raise ValueError(f"batch of {batch} exceeds the staging's {staging.regions} regions")
    length = locs.shape[1]
    span = program_span(block_n, blocks_per_program)
    out = torch.empty(batch, length, dtype=torch.float32, device=q.device)
    programs = triton.cdiv(length, span)
    if batch == 0 or length == 0:
        return out, 0
    _logits_publish_kernel[(batch, programs)](
        q.contiguous(), weights.contiguous().float(), keys, key_scales, locs, seq_lens, out,
        theta_table, request_rows, host_to_device, staging.ids, staging.queue,
        staging.stage_map, staging.counts, staging.done,
        length, keys.stride(0), key_scales.stride(0), locs.stride(0), out.stride(0), staging.cap,
        H=heads, D=dim, BLOCK_N=block_n, BLOCKS=blocks_per_program, PRECISE_ACC=32,
        KEYS_AS_M=True, ABSENT_ID=ABSENT, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out, programs


def consumer_programs(device: torch.device) -> int:
    """A quarter of the SMs, and never all of them: the producers must always find room."""
    if device.type != "cuda":
        return 3  # the interpreter: programs share the chunks in tests
    sms = sm_count(device.index)
    return max(1, min(sms - 1, int(CONSUMER_PROGRAMS_PER_SM * sms)))


def copy_published(
    host_rows: torch.Tensor,
    staging: LiveStaging,
    batch: int,
    programs: int,
    total: torch.Tensor,
    grid: int | None = None,
) -> None:
    """Copy every row the producers of :func:`logits_and_publish` (``programs`` per lane,
    ``batch`` lanes) publish into ``staging.rows``, then set ``staging.final`` and add the
    staged rows to ``total`` (int64 [1]). Launch it after the producer (on a side stream
    on CUDA: it runs beside them). ``host_rows`` must be addressable by the kernel (the
    pinned pool's CUDA alias; any tensor when interpreted)."""
    host_b, rows_b = byte_rows(host_rows, "staging"), byte_rows(staging.rows, "staging")
    if host_b.shape[1] != rows_b.shape[1]:
        raise ValueError("host and staging rows must have the same width")
    if batch == 0:
        return
    row_bytes = host_b.shape[1]
    vec = byte_vector(row_bytes)
    _copy_published_kernel[(grid or consumer_programs(rows_b.device),)](
        host_b, rows_b, staging.queue, staging.counts, staging.done, staging.final,
        staging.exited, total, batch, staging.regions, programs, staging.cap, host_b.stride(0), rows_b.stride(0),
        LANES=CHUNK_LANES, PIECES=triton.next_power_of_2(row_bytes // vec),
        BATCH_BLOCK=triton.next_power_of_2(staging.regions), ROW_BYTES=row_bytes, VEC=vec,
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
