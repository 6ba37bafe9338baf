"""Decode prefetch into a staging buffer (ECHO's design): while the indexer scores a
request's keys, copy the misses its exact top-k will probably select from pinned host
memory into a staging buffer, with no cache allocation; the resolve then takes a staged
miss's row from the buffer (a device-to-device copy) instead of over PCIe.

Why it is built this way (docs/ARCHITECTURE.md section 6): a copy that starts after the
logits overlaps only the top-k, and one that allocates cache slots pays a second
allocation pass. Here the indexer's logits run in a few chunks of key positions on the
main stream; after each chunk a side stream

1. *selects* the chunk's candidates (:func:`stage_select`): positions whose logit beats
   the request's predicted threshold and whose token is not resident, appended densely
   to the chunk's region (``ids[region : region + cap]``, count ``counts[chunk]``, one
   atomic counter for the chunk's requests), and marks ``stage_map[host id] = entry``;
   one short program per (request, tile);
2. *copies* their rows into ``rows[entry]`` (:func:`stage_copy`) on a bounded grid that
   loops over the staged rows only, so the next chunk's logits keep most of the SMs and a
   chunk with nothing staged costs a launch.

A region holds ``cap`` rows for all the batch's requests (the prefetcher sizes it as
request rows x rows per request); a request with a poor threshold can take more than its
share of a chunk, never more than the region. An entry is valid for a host id when
``ids[entry] == id`` and the entry lies below its region's count: both written in this
layer-step, so a stale ``stage_map`` value (an earlier layer's, or another request's) is
never mistaken for a staged row, and the map needs no clearing. Which candidates fill a
full region depends on the order of the atomic counter, so it is not deterministic; what
attention reads is: a staged row is the host row's bytes, and the exact top-k and the
allocation never look at the staging.

After the exact top-k, :func:`update_thresholds_from_topk` folds each request's k-th
score into its threshold (DecodeThresholdPredictor.update's rule) in one launch.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from sglang_echo.kernels.cache_layout import ABSENT, byte_rows, byte_vector
from sglang_echo.kernels.device_info import sm_count

# Positions per select program. On an H200 (batch 16 x 64K-position chunks) 1024 kept each
# chunk's select short and slowed the top-k beside it less than 4096 did (the run that
# reverted 4096: docs/ARCHITECTURE.md section 15, "Measured choices").
STAGE_TILE = 1024
# The copy's grid: a quarter of the SMs' worth of programs. The overlap probe (issue 29)
# hid the logits behind a recall on 33-66 programs and nothing at 132 or more.
COPY_PROGRAMS_PER_SM = 0.25
COPY_CHUNKS = 512  # 16-byte pieces per copy program and iteration (kernels/recall.py)


class StagedRows(NamedTuple):
    """One layer-step's staging as the recall reads it (entries = chunks x cap).

    rows [entries, row_dim] (the cache rows' dtype); stage_map [host tokens + 2] int32
    (host id -> entry, validated, never cleared); ids [entries] int64; counts [chunks]
    int32 (may exceed limit); cap: entries per chunk (the regions' stride); limit: the
    entries of a region this step may fill (<= cap); hits [1] int64, += staged rows
    recalled."""

    rows: torch.Tensor
    stage_map: torch.Tensor
    ids: torch.Tensor
    counts: torch.Tensor
    cap: int
    limit: int
    hits: torch.Tensor


@triton.jit
def _select_kernel(
    scores_ptr, locs_ptr, lens_ptr, theta_ptr, h2d_ptr, ids_ptr, counts_ptr, map_ptr,
    start, end, scores_stride, locs_stride, cap, region,
    TILE: tl.constexpr, ABSENT_ID: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    n = start + tl.program_id(1) * TILE + tl.arange(0, TILE)
    live = (n < end) & (n < tl.load(lens_ptr + b))
    s = tl.load(scores_ptr + b * scores_stride + n, mask=live, other=float("-inf"))
    over = live & (s > tl.load(theta_ptr + b))
    loc = tl.load(locs_ptr + b * locs_stride + n, mask=over, other=0).to(tl.int64)
    slot = tl.load(h2d_ptr + loc, mask=over, other=0)
    flag = over & (slot == ABSENT_ID)
    flags = flag.to(tl.int32)
    n_flags = tl.sum(flags, 0)
    base = tl.atomic_add(counts_ptr, n_flags)  # this tile's ranks in the region
    rank = base + tl.cumsum(flags, 0) - 1
    take = flag & (rank < cap)
    entry = region + rank
    tl.store(ids_ptr + entry, loc, mask=take)
    tl.store(map_ptr + loc, entry.to(tl.int32), mask=take)


@triton.jit
def _copy_pieces(
    host_ptr, rows_ptr, ids_ptr, e, col, ok, host_stride, rows_stride, VEC: tl.constexpr
):  # fmt: skip
    """rows[e] = host[ids[e]] for the VEC-byte pieces at byte ``col`` of the lanes ``ok``."""
    v = tl.arange(0, VEC)
    ids = tl.load(ids_ptr + e, mask=ok, other=0).to(tl.int64)
    src = host_ptr + (ids * host_stride + col)[:, None] + v[None, :]
    dst = rows_ptr + (e * rows_stride + col)[:, None] + v[None, :]
    tl.store(dst, tl.load(src, mask=ok[:, None]), mask=ok[:, None])


@triton.jit
def _copy_kernel(
    host_ptr, rows_ptr, ids_ptr, count_ptr, total_ptr, region, cap, host_stride, rows_stride,
    ROW_BYTES: tl.constexpr, VEC: tl.constexpr, CHUNKS: tl.constexpr,
):  # fmt: skip
    """rows[region + lane] = host[ids[region + lane]] for lanes below the region's count
    (at most cap); a grid-stride loop over (lane, VEC-byte piece), as the recall.
    Program 0 adds the staged rows to ``total`` (telemetry, no extra launch)."""
    per_row: tl.constexpr = ROW_BYTES // VEC
    staged = tl.minimum(tl.load(count_ptr), cap)
    tl.atomic_add(total_ptr, staged.to(tl.int64), mask=tl.program_id(0) == 0)
    total = staged.to(tl.int64) * per_row
    base = tl.program_id(0).to(tl.int64) * CHUNKS
    while base < total:
        piece = base + tl.arange(0, CHUNKS)
        col = (piece % per_row) * VEC
        _copy_pieces(
            host_ptr, rows_ptr, ids_ptr, region + piece // per_row, col, piece < total,
            host_stride, rows_stride, VEC=VEC,
        )  # fmt: skip
        base += tl.num_programs(0) * CHUNKS


# --------------------------------------------------------------------------- launchers
def stage_select(
    scores: torch.Tensor,
    locs: torch.Tensor,
    seq_lens: torch.Tensor,
    theta: torch.Tensor,
    host_to_device: torch.Tensor,
    start: int,
    end: int,
    ids: torch.Tensor,
    count: torch.Tensor,
    stage_map: torch.Tensor,
    region: int,
    cap: int,
) -> None:
    """Append the candidates among positions [start, end) (scores [B, L] float32, locs
    [B, >= L] host ids, seq_lens [B], theta [B] float32) of every request to the chunk's
    region ``ids[region : region + cap]`` (int64), counted in ``count`` (a 1-element int32
    tensor zeroed by the caller; it may exceed ``cap``: only ranks below ``cap`` are
    kept), and mark ``stage_map[id] = entry`` (int32). One launch."""
    batch = scores.shape[0]
    if batch == 0 or end <= start:
        return
    grid = (batch, triton.cdiv(end - start, STAGE_TILE))
    _select_kernel[grid](
        scores, locs, seq_lens, theta, host_to_device, ids, count, stage_map,
        start, end, scores.stride(0), locs.stride(0), cap, region,
        TILE=STAGE_TILE, ABSENT_ID=ABSENT,
    )  # fmt: skip


def copy_programs(device: torch.device) -> int:
    if device.type != "cuda":
        return 2  # the interpreter: the loop runs more than once in tests
    return max(1, int(COPY_PROGRAMS_PER_SM * sm_count(device.index)))


def stage_copy(
    host_rows: torch.Tensor,
    rows: torch.Tensor,
    ids: torch.Tensor,
    count: torch.Tensor,
    total: torch.Tensor,
    region: int,
    cap: int,
    programs: int | None = None,
) -> None:
    """Copy the staged rows of one region: ``rows[region + i] = host_rows[ids[region +
    i]]`` for i < min(count, cap), and add that number to ``total`` (int64 [1]).
    ``host_rows`` must be addressable by the kernel (the pinned pool's CUDA alias; any
    tensor when interpreted). A bounded grid (``programs``, default a quarter of the
    SMs)."""
    host_b, rows_b = byte_rows(host_rows, "staging"), byte_rows(rows, "staging")
    if host_b.shape[1] != rows_b.shape[1]:
        raise ValueError("host and staging rows must have the same width")
    if cap == 0:
        return
    row_bytes = host_b.shape[1]
    vec = byte_vector(row_bytes)
    grid = (programs or copy_programs(rows_b.device),)
    _copy_kernel[grid](
        host_b, rows_b, ids, count, total, region, cap, host_b.stride(0), rows_b.stride(0),
        ROW_BYTES=row_bytes, VEC=vec, CHUNKS=COPY_CHUNKS,
    )  # fmt: skip


# --------------------------------------------------------------------------- references
def stage_select_reference(
    scores: torch.Tensor,
    locs: torch.Tensor,
    seq_lens: torch.Tensor,
    theta: torch.Tensor,
    host_to_device: torch.Tensor,
    start: int,
    end: int,
    ids: torch.Tensor,
    count: torch.Tensor,
    stage_map: torch.Tensor,
    region: int,
    cap: int,
) -> None:
    """:func:`stage_select` in torch, candidates in (request, position) order (the
    kernel's order within a region may differ; its set may too when a region overflows)."""
    batch = scores.shape[0]
    if batch == 0 or end <= start:
        return
    pos = torch.arange(start, end, device=scores.device)
    visible = pos[None, :] < seq_lens.to(torch.int64)[:, None]
    loc = torch.where(visible, locs[:, start:end].to(torch.int64), 0)
    over = visible & (scores[:, start:end] > theta[:, None])
    flag = (over & (host_to_device[loc] == ABSENT)).reshape(-1)
    loc = loc.reshape(-1)
    rank = count.to(torch.int64) + torch.cumsum(flag.to(torch.int64), 0) - 1
    take = flag & (rank < cap)
    entry = region + rank
    ids[entry[take]] = loc[take]
    stage_map[loc[take]] = entry[take].to(stage_map.dtype)
    count += flag.sum().to(count.dtype)


def stage_copy_reference(
    host_rows: torch.Tensor,
    rows: torch.Tensor,
    ids: torch.Tensor,
    count: torch.Tensor,
    total: torch.Tensor,
    region: int,
    cap: int,
) -> None:
    """:func:`stage_copy` in torch (reads the count on the host)."""
    n = min(int(count), cap)
    total += n
    entries = torch.arange(region, region + n, device=rows.device)
    rows[entries] = host_rows[ids[entries].to(host_rows.device)].to(rows.device)


def staged_entries(ids: torch.Tensor, staged: StagedRows) -> torch.Tensor:
    """The staging entry holding each host id's row this layer-step, -1 where none: the
    validity rule the recall kernel applies (module docstring)."""
    stage_ids = staged.ids
    entry = staged.stage_map[ids.clamp(min=0)].to(torch.int64).clamp(0, stage_ids.numel() - 1)
    lane = entry % staged.cap
    count = staged.counts.to(torch.int64)[entry // staged.cap].clamp(max=staged.limit)
    valid = (ids >= 0) & (stage_ids[entry] == ids) & (lane < count)
    return torch.where(valid, entry, -1)


# ------------------------------------------------ step epilogue: the thresholds
# One launch instead of a dozen tiny torch ops on the main stream: when every selection
# hits, this sits on the critical path of every layer's decode step.
@triton.jit
def _ema_store(theta_ptr, finite_ptr, row, new, alpha, live):
    """DecodeThresholdPredictor.update's rule for the lanes' rows and new k-th scores."""
    old = tl.load(theta_ptr + row, mask=live, other=0.0)
    was_finite = tl.load(finite_ptr + row, mask=live, other=0) != 0
    new_finite = tl.abs(new) < float("inf")
    blend = was_finite & new_finite
    # Zeros where a value is infinite: no inf - inf on lanes that keep ``new`` anyway.
    a = tl.where(blend, new, 0.0)
    b = tl.where(blend, old, 0.0)
    value = tl.where(blend, alpha * a + (1.0 - alpha) * b, new)
    tl.store(theta_ptr + row, value, mask=live)
    tl.store(finite_ptr + row, new_finite, mask=live)


@triton.jit
def _topk_threshold_kernel(
    theta_ptr, finite_ptr, scores_ptr, pos_ptr, rows_ptr, scores_stride, pos_stride, topk,
    alpha, K: tl.constexpr,
):  # fmt: skip
    """One program per request: its k-th score (the smallest picked score; -inf where the
    top-k has empty lanes) straight from the scores and positions, then the EMA."""
    b = tl.program_id(0)
    lane = tl.arange(0, K)
    inside = lane < topk
    pos = tl.load(pos_ptr + b * pos_stride + lane, mask=inside, other=0)
    picked = tl.load(scores_ptr + b * scores_stride + pos, mask=inside & (pos >= 0), other=0.0)
    picked = tl.where(inside & (pos >= 0), picked, float("inf"))
    kth = tl.min(picked, 0)
    missing = tl.sum((inside & (pos < 0)).to(tl.int32), 0) > 0
    kth = tl.where(missing, float("-inf"), kth)
    row = tl.load(rows_ptr + b).to(tl.int64)
    _ema_store(theta_ptr, finite_ptr, row, kth, alpha, row >= 0)


def update_thresholds_from_topk(
    theta: torch.Tensor,
    finite: torch.Tensor,
    scores: torch.Tensor,
    positions: torch.Tensor,
    rows: torch.Tensor,
    alpha: float,
) -> None:
    """DecodeThresholdPredictor.update (its reference) with the k-th scores taken from the
    top-k itself (scores [B, L] float32, positions [B, topk], -1 = none), in one launch in
    place of the gather, the two reductions and the fills that ``exact_topk`` would run on
    the main stream: for distinct request rows, theta[row] = EMA(alpha) of the new k-th
    score where both are finite, else the new score; finite[row] = whether the new score
    is finite. The k-th score is the smallest picked score, -inf where a lane is empty
    (exact_topk's rule). Floating-point contraction is off, so the thresholds match
    exact_topk + the predictor's torch ops bit for bit."""
    if theta.dtype != torch.float32 or finite.dtype != torch.bool:
        raise ValueError("theta must be float32 and finite bool (DecodeThresholdPredictor)")
    batch, topk = positions.shape
    if scores.shape[0] != batch or rows.shape != (batch,) or scores.dtype != torch.float32:
        raise ValueError("expected scores [B, L] float32, positions [B, topk], rows [B]")
    if batch == 0 or topk == 0:
        return
    _topk_threshold_kernel[(batch,)](
        theta, finite, scores, positions, rows, scores.stride(0), positions.stride(0), topk,
        float(alpha), K=triton.next_power_of_2(topk), enable_fp_fusion=False,
    )  # fmt: skip
