"""Prefill inter-query prefetch: history tokens certain to be in a query block's top-k.

Per query row, a one-round 256-bin histogram over the top 8 bits of an order-preserving
32-bit key of d = score - offset (sign and 7 exponent bits). The threshold bin T is the
highest bin whose suffix count (tokens in bins >= T) reaches k. Tokens in bins strictly
above T are certain members of the row's exact top-k, whatever the tie-break:

    fl(s - o) is monotone non-decreasing in s, and so is the key of d (-0.0 is folded
    into +0.0 first, so equal scores get equal keys). Every token scoring >= s(t) thus
    sits in a bin >= bin(t) > T, and there are fewer than k tokens above T. So fewer than
    k tokens score >= s(t): the k-th largest score is < s(t), and t is selected.

The threshold bin itself is ambiguous and is not fetched. Rows with fewer than k visible
tokens have no threshold bin (T = -1): all their visible tokens are selected. Positions
scoring -inf (masked) or beyond ``query_pos`` are not counted, as in the exact top-k.

Candidates are OR-ed over the block's rows per history column, those already resident
(``host_to_device != ABSENT``) are dropped, and the rest are compacted in column order
into a fixed-size list of host ids with a device-side count, capped at ``cap`` (callers
use ``prefetch_cap``: min(8192, N_G - 1 - Q)) and optionally at a device-side ``budget``
shared by several calls. No host synchronisation: the recall kernel
(``kernels.recall.recall_rows``) can consume the list and count directly.

The offset only decides how narrow the ambiguous bin is (its width scales with
|k-th score - offset|); any finite offset is lossless. Non-finite offsets are treated
as 0. Scores must not be NaN. ``offload.predictor.PrefillOffsetPredictor`` supplies
offsets.

Two kernels over a [rows, columns] score tile grid: one accumulates each row's histogram
(atomics per program), one finds each row's threshold bin and flags candidate columns;
the compaction is a device-side cumsum and scatter.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

ABSENT = torch.iinfo(torch.int32).max  # offload.device_cache.ABSENT (not imported: no cycle)
PREFETCH_LIMIT = 8192
NUM_BINS = 256
DEFAULT_BLOCK = 1024
DEFAULT_TILES = 4


class PrefetchList(NamedTuple):
    """ids [cap] int64 host ids to fetch (lanes past ``count`` hold 0, the sink);
    count [1] int64; threshold_bin [R] int32 (-1: fewer than k visible tokens)."""

    ids: torch.Tensor
    count: torch.Tensor
    threshold_bin: torch.Tensor


def prefetch_cap(num_slots: int, num_queries: int, limit: int = PREFETCH_LIMIT) -> int:
    """min(limit, N_G - 1 - Q): prefetched rows must leave room for the sink and the Q
    new tokens of the chunk. 0 (prefetch nothing) when the cache has no such room."""
    if num_slots < 1 or num_queries < 0 or limit < 0:
        raise ValueError(
            f"prefetch_cap needs num_slots >= 1, num_queries >= 0, limit >= 0; got "
            f"{num_slots}, {num_queries}, {limit}"
        )
    return max(0, min(limit, num_slots - 1 - num_queries))


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _tile_bins(
    scores_ptr,
    offsets_ptr,
    qpos_ptr,
    row,
    cols,
    n_cols,
    stride,
    HAS_OFFSET: tl.constexpr,
    HAS_QPOS: tl.constexpr,
):
    """Histogram bin (0..255) of each column of one row's tile, and whether it counts."""
    inside = cols < n_cols
    s = tl.load(scores_ptr + row * stride + cols, mask=inside, other=float("-inf"))
    s = s.to(tl.float32)
    valid = inside & (s != float("-inf"))
    if HAS_QPOS:
        valid = valid & (cols <= tl.load(qpos_ptr + row))
    if HAS_OFFSET:
        s = s - tl.load(offsets_ptr + row)
    s = tl.where(s == 0.0, 0.0, s)  # -0.0 -> +0.0: equal scores, equal keys
    bits = s.to(tl.int32, bitcast=True)
    top = (bits >> 24) & 255
    # Order-preserving key: positives flip the sign bit, negatives flip every bit.
    b = tl.where(bits >= 0, top + 128, 255 - top)
    return b, valid


@triton.jit
def _hist_kernel(
    scores_ptr,
    offsets_ptr,
    qpos_ptr,
    hist_ptr,
    n_cols,
    stride,
    HAS_OFFSET: tl.constexpr,
    HAS_QPOS: tl.constexpr,
    BLOCK: tl.constexpr,
    TILES: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = tl.program_id(1) * (BLOCK * TILES)
    hist = tl.zeros((512,), dtype=tl.int32)
    for t in tl.static_range(TILES):
        cols = base + t * BLOCK + tl.arange(0, BLOCK)
        b, valid = _tile_bins(
            scores_ptr, offsets_ptr, qpos_ptr, row, cols, n_cols, stride, HAS_OFFSET, HAS_QPOS
        )
        # Uncounted lanes go to bin 256 of a 512-bin histogram and are dropped below.
        hist += tl.histogram(tl.where(valid, b, 256), 512)
    bins = tl.arange(0, 512)
    tl.atomic_add(hist_ptr + row * 256 + bins, hist, mask=(bins < 256) & (hist > 0))


@triton.jit
def _flag_kernel(
    scores_ptr,
    offsets_ptr,
    qpos_ptr,
    hist_ptr,
    locs_ptr,
    h2d_ptr,
    flags_ptr,
    thr_ptr,
    n_cols,
    stride,
    k,
    ABSENT_ID: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    HAS_QPOS: tl.constexpr,
    BLOCK: tl.constexpr,
    TILES: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    bins = tl.arange(0, 256)
    h = tl.load(hist_ptr + row * 256 + bins)
    at_or_above = tl.sum(h, 0) - tl.cumsum(h, 0) + h  # tokens in bins >= b
    # Highest bin whose suffix count reaches k; -1 when the row has fewer than k tokens.
    thr = tl.sum((at_or_above >= k).to(tl.int32), 0) - 1
    tl.store(thr_ptr + row, thr, mask=tl.program_id(1) == 0)
    base = tl.program_id(1) * (BLOCK * TILES)
    for t in tl.static_range(TILES):
        cols = base + t * BLOCK + tl.arange(0, BLOCK)
        b, valid = _tile_bins(
            scores_ptr, offsets_ptr, qpos_ptr, row, cols, n_cols, stride, HAS_OFFSET, HAS_QPOS
        )
        cand = valid & (b > thr)
        loc = tl.load(locs_ptr + cols, mask=cand, other=0).to(tl.int64)
        slot = tl.load(h2d_ptr + loc, mask=cand, other=0)
        fetch = cand & (slot == ABSENT_ID)
        # Several rows may flag one column: they all store the same 1.
        tl.store(flags_ptr + cols, tl.full((BLOCK,), 1, tl.int8), mask=fetch)


# ----------------------------------------------------------------------------- launcher
def _check(scores, locs, host_to_device, topk, cap, offsets, query_pos, budget) -> None:
    if scores.dim() != 2:
        raise ValueError(f"scores must be [rows, history], got shape {tuple(scores.shape)}")
    if not scores.is_floating_point():
        raise ValueError(f"scores must be floating point, got {scores.dtype}")
    rows, cols = scores.shape
    if locs.shape != (cols,):
        raise ValueError(
            f"locs must be [history] = [{cols}] host ids (one request's history), "
            f"got {tuple(locs.shape)}"
        )
    if host_to_device.dim() != 1 or host_to_device.dtype != torch.int32:
        raise ValueError("host_to_device must be the layer's 1-D int32 map (DeviceCache)")
    if topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk}")
    if cap < 0:
        raise ValueError(f"cap must be >= 0 (see prefetch_cap), got {cap}")
    if offsets is not None and offsets.shape != (rows,):
        raise ValueError(f"offsets must be [rows] = [{rows}], got {tuple(offsets.shape)}")
    if query_pos is not None and query_pos.shape != (rows,):
        raise ValueError(f"query_pos must be [rows] = [{rows}], got {tuple(query_pos.shape)}")
    if budget is not None and (budget.shape != (1,) or budget.dtype != torch.int64):
        raise ValueError("budget must be a [1] int64 device tensor (rows still allowed)")
    for name, t in (("locs", locs), ("host_to_device", host_to_device)):
        if t.device != scores.device:
            raise ValueError(f"{name} is on {t.device}, scores on {scores.device}")


def _finite_offsets(offsets: torch.Tensor) -> torch.Tensor:
    off = offsets.to(torch.float32)
    return torch.where(torch.isfinite(off), off, torch.zeros_like(off)).contiguous()


def _compact(
    flags: torch.Tensor, locs: torch.Tensor, cap: int, budget: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flagged columns' host ids, in column order, into a [cap] list + [1] count."""
    rank = torch.cumsum(flags, 0, dtype=torch.int64) - 1
    total = (
        (rank[-1:] + 1) if rank.numel() else torch.zeros(1, dtype=torch.int64, device=flags.device)
    )
    limit = torch.full_like(total, cap)
    if budget is not None:
        limit = torch.minimum(limit, budget.clamp(min=0))
    take = (flags != 0) & (rank < limit)
    dest = torch.where(take, rank, torch.full_like(rank, cap))
    ids = torch.zeros(cap + 1, dtype=torch.int64, device=flags.device)
    ids.scatter_(0, dest, locs.to(torch.int64))
    count = torch.minimum(total, limit)
    if budget is not None:
        budget.sub_(count)
    return ids[:cap], count


def prefill_prefetch(
    scores: torch.Tensor,
    locs: torch.Tensor,
    host_to_device: torch.Tensor,
    topk: int,
    cap: int,
    offsets: torch.Tensor | None = None,
    query_pos: torch.Tensor | None = None,
    budget: torch.Tensor | None = None,
    block: int = DEFAULT_BLOCK,
    tiles: int = DEFAULT_TILES,
) -> PrefetchList:
    """Host ids of history tokens certain to be in some row's top-k and not resident.

    scores [R, L] indexer scores of one query block over one request's history (column
    c = host id ``locs[c]``, distinct ids); ``host_to_device`` the layer's map; ``offsets``
    [R] per-row score offsets (None: 0); ``query_pos`` [R]: row r sees columns <= it
    (None: all); ``budget`` [1] int64: device-side allowance shared across calls, reduced
    by the count. Fixed shapes, no host sync; ``threshold_bin`` is returned for tests.
    """
    _check(scores, locs, host_to_device, topk, cap, offsets, query_pos, budget)
    if triton.next_power_of_2(block) != block or block < 16 or tiles < 1:
        raise ValueError(f"block must be a power of two >= 16 and tiles >= 1, got {block}, {tiles}")
    rows, cols = scores.shape
    dev = scores.device
    if scores.stride(1) != 1:
        scores = scores.contiguous()
    locs = locs.contiguous()
    hist = torch.zeros(rows, NUM_BINS, dtype=torch.int32, device=dev)
    flags = torch.zeros(cols, dtype=torch.int8, device=dev)
    thr = torch.full((rows,), -1, dtype=torch.int32, device=dev)
    off = _finite_offsets(offsets) if offsets is not None else scores  # dummy pointer
    qpos = query_pos.contiguous() if query_pos is not None else locs  # dummy pointer
    if rows and cols:
        grid = (rows, triton.cdiv(cols, block * tiles))
        flags_on = dict(HAS_OFFSET=offsets is not None, HAS_QPOS=query_pos is not None)
        _hist_kernel[grid](
            scores, off, qpos, hist, cols, scores.stride(0), BLOCK=block, TILES=tiles, **flags_on
        )
        _flag_kernel[grid](
            scores,
            off,
            qpos,
            hist,
            locs,
            host_to_device,
            flags,
            thr,
            cols,
            scores.stride(0),
            topk,
            ABSENT_ID=ABSENT,
            BLOCK=block,
            TILES=tiles,
            **flags_on,
        )
    ids, count = _compact(flags, locs, cap, budget)
    return PrefetchList(ids, count, thr)


# ---------------------------------------------------------------------------- reference
def order_key_bins(d: torch.Tensor) -> torch.Tensor:
    """Top 8 bits of the order-preserving 32-bit key of float32 ``d`` (-0.0 as +0.0)."""
    d = torch.where(d == 0, torch.zeros_like(d), d.to(torch.float32))
    bits = d.view(torch.int32).to(torch.int64)
    top = (bits >> 24) & 255
    return torch.where(bits >= 0, top + 128, 255 - top)


def histogram_census(
    scores: torch.Tensor,
    topk: int,
    offsets: torch.Tensor | None = None,
    query_pos: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Plain torch, per row: bins [R, L], valid [R, L], threshold bin [R], tokens above
    it (certain) [R] and in it (ambiguous) [R]. The reference's core; also used to
    measure how offsets shrink the ambiguous bin."""
    s = scores.to(torch.float32)
    rows, cols = s.shape
    valid = s != float("-inf")
    if query_pos is not None:
        pos = torch.arange(cols, device=s.device)
        valid &= pos[None, :] <= query_pos.to(s.device)[:, None]
    if offsets is not None:
        s = s - _finite_offsets(offsets)[:, None]
    bins = order_key_bins(s)
    hist = torch.zeros(rows, NUM_BINS, dtype=torch.int64, device=s.device)
    hist.scatter_add_(1, bins, valid.to(torch.int64))
    at_or_above = hist.flip(1).cumsum(1).flip(1)
    thr = (at_or_above >= topk).sum(1) - 1
    above = (valid & (bins > thr[:, None])).sum(1)
    in_bin = (valid & (bins == thr[:, None])).sum(1)
    return {"bins": bins, "valid": valid, "threshold_bin": thr, "above": above, "in_bin": in_bin}


def prefill_prefetch_reference(
    scores: torch.Tensor,
    locs: torch.Tensor,
    host_to_device: torch.Tensor,
    topk: int,
    cap: int,
    offsets: torch.Tensor | None = None,
    query_pos: torch.Tensor | None = None,
    budget: torch.Tensor | None = None,
) -> PrefetchList:
    """Plain torch (reads counts on the host): the semantics the kernels must match."""
    _check(scores, locs, host_to_device, topk, cap, offsets, query_pos, budget)
    c = histogram_census(scores, topk, offsets, query_pos)
    cand = (c["valid"] & (c["bins"] > c["threshold_bin"][:, None])).any(0)
    cand &= host_to_device[locs.long()] == ABSENT
    picked = locs[cand].to(torch.int64)
    limit = cap if budget is None else max(0, min(cap, int(budget.item())))
    n = min(picked.numel(), limit)
    ids = torch.zeros(cap, dtype=torch.int64, device=scores.device)
    ids[:n] = picked[:n]
    count = torch.tensor([n], dtype=torch.int64, device=scores.device)
    if budget is not None:
        budget.sub_(n)
    return PrefetchList(ids, count, c["threshold_bin"].to(torch.int32))
