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

Three kernels: one accumulates each row's histogram over a (row, column span) grid with
atomics; one per column tile finds every row's threshold bin, ORs the rows' candidates,
drops resident tokens and counts the tile; one per column tile writes its ids after the
preceding tiles' counts. Few launches matter: prefill runs eagerly, and host launch cost
per query block must stay below the block's scoring time.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

ABSENT = torch.iinfo(
    torch.int32
).max  # = offload.device_cache.ABSENT (kernels do not import offload)
PREFETCH_LIMIT = 8192
NUM_BINS = 256
DEFAULT_BLOCK = 1024  # columns per histogram tile
DEFAULT_TILES = 4  # tiles per histogram program
DEFAULT_TILE = 512  # columns per flag / compaction program
DEFAULT_ROW_BLOCK = 16  # rows per step of the flag program (H200: 16 beat 4 and 8)


class PrefetchList(NamedTuple):
    """ids [cap] int64 host ids to fetch (lanes past ``count``: unspecified);
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
def _row_offset(offsets_ptr, row, row_ok, HAS_OFFSET: tl.constexpr):
    """The rows' offsets as float32; non-finite offsets count as 0 (as in the reference)."""
    if HAS_OFFSET:
        o = tl.load(offsets_ptr + row, mask=row_ok, other=0.0).to(tl.float32)
        off = tl.where(tl.abs(o) < float("inf"), o, 0.0)
    else:
        off = 0.0  # s - 0.0 is s, bit for bit
    return off


@triton.jit
def _tile_bins(
    scores_ptr, qpos_ptr, row, row_ok, off, cols, n_cols, stride, HAS_QPOS: tl.constexpr
):
    """Histogram bin (0..255) of each (row, column), and whether it counts. ``row``,
    ``row_ok`` and ``off`` broadcast against ``cols`` (a row's tile or a [rows, cols] tile).
    """
    inside = (cols < n_cols) & row_ok
    s = tl.load(scores_ptr + row * stride + cols, mask=inside, other=float("-inf"))
    s = s.to(tl.float32)
    valid = inside & (s != float("-inf"))
    if HAS_QPOS:
        valid = valid & (cols <= tl.load(qpos_ptr + row, mask=row_ok, other=0))
    d = s - off
    d = tl.where(d == 0.0, 0.0, d)  # -0.0 -> +0.0: equal scores, equal keys
    bits = d.to(tl.int32, bitcast=True)
    top = (bits >> 24) & 255
    # Order-preserving key: positives flip the sign bit, negatives flip every bit.
    b = tl.where(bits >= 0, top + 128, 255 - top)
    return b, valid


@triton.jit(do_not_specialize=("n_cols",))
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
    """Grid (rows, column spans): add one span's bin counts to the row's histogram."""
    row = tl.program_id(0).to(tl.int64)
    row_ok = row >= 0
    base = tl.program_id(1) * (BLOCK * TILES)
    off = _row_offset(offsets_ptr, row, row_ok, HAS_OFFSET)
    hist = tl.zeros((256,), dtype=tl.int32)
    for t in tl.static_range(TILES):
        cols = base + t * BLOCK + tl.arange(0, BLOCK)
        b, valid = _tile_bins(
            scores_ptr, qpos_ptr, row, row_ok, off, cols, n_cols, stride, HAS_QPOS
        )
        hist += tl.histogram(b, 256, mask=valid)
    tl.atomic_add(hist_ptr + row * 256 + tl.arange(0, 256), hist, mask=hist > 0)


@triton.jit(do_not_specialize=("n_cols", "n_rows"))
def _flag_kernel(
    scores_ptr,
    offsets_ptr,
    qpos_ptr,
    hist_ptr,
    locs_ptr,
    h2d_ptr,
    flags_ptr,
    tile_count_ptr,
    thr_ptr,
    n_cols,
    stride,
    k,
    n_rows,
    ROWS: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    ABSENT_ID: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    HAS_QPOS: tl.constexpr,
    TILE: tl.constexpr,
):
    """Grid (column tiles): OR every row's "above its threshold bin" over one tile of
    columns, ROW_BLOCK rows at a time; drop resident tokens; write the tile's 0/1 flags
    and their count."""
    tile = tl.program_id(0)
    cols = tile * TILE + tl.arange(0, TILE)
    bins = tl.arange(0, 256)
    flag = tl.zeros((TILE,), dtype=tl.int32)
    # A constexpr trip count (the interpreter needs one): ROWS is n_rows rounded up to a
    # power of two, so blocks of any size share a few compiled variants.
    for r0 in range(0, ROWS, ROW_BLOCK):
        row = r0 + tl.arange(0, ROW_BLOCK).to(tl.int64)
        row_ok = row < n_rows
        h = tl.load(hist_ptr + row[:, None] * 256 + bins[None, :], mask=row_ok[:, None], other=0)
        at_or_above = tl.sum(h, 1)[:, None] - tl.cumsum(h, 1) + h  # tokens in bins >= b
        # Highest bin whose suffix count reaches k; -1 when the row has fewer than k.
        thr = tl.sum((at_or_above >= k).to(tl.int32), 1) - 1
        tl.store(thr_ptr + row, thr, mask=row_ok & (tile == 0))
        off = _row_offset(offsets_ptr, row, row_ok, HAS_OFFSET)
        if HAS_OFFSET:
            off = off[:, None]
        b, valid = _tile_bins(
            scores_ptr,
            qpos_ptr,
            row[:, None],
            row_ok[:, None],
            off,
            cols[None, :],
            n_cols,
            stride,
            HAS_QPOS,
        )
        above = valid & (b > thr[:, None])
        flag = flag | tl.max(above.to(tl.int32), 0)
    cand = flag != 0
    loc = tl.load(locs_ptr + cols, mask=cand, other=0).to(tl.int64)
    slot = tl.load(h2d_ptr + loc, mask=cand, other=0)
    fetch = cand & (slot == ABSENT_ID)
    tl.store(flags_ptr + cols, fetch.to(tl.int8), mask=cols < n_cols)
    tl.store(tile_count_ptr + tile, tl.sum(fetch.to(tl.int32), 0))


@triton.jit(do_not_specialize=("n_cols", "n_tiles", "cap"))
def _compact_kernel(
    flags_ptr,
    tile_count_ptr,
    locs_ptr,
    budget_ptr,
    ids_ptr,
    count_ptr,
    n_cols,
    n_tiles,
    cap,
    HAS_BUDGET: tl.constexpr,
    TILE: tl.constexpr,
    MAX_TILES: tl.constexpr,
):
    """Grid (column tiles): write the flagged host ids in column order, up to the limit."""
    tile = tl.program_id(0)
    t = tl.arange(0, MAX_TILES)
    counts = tl.load(tile_count_ptr + t, mask=t < n_tiles, other=0)
    prefix = tl.sum(tl.where(t < tile, counts, 0), 0)
    total = tl.sum(counts, 0)
    limit = tl.zeros((), dtype=tl.int64) + cap
    if HAS_BUDGET:
        limit = tl.minimum(limit, tl.maximum(tl.load(budget_ptr), 0))
    cols = tile * TILE + tl.arange(0, TILE)
    f = tl.load(flags_ptr + cols, mask=cols < n_cols, other=0).to(tl.int32)
    pos = prefix + tl.cumsum(f, 0) - 1
    take = (f != 0) & (pos < limit)
    loc = tl.load(locs_ptr + cols, mask=take, other=0)
    tl.store(ids_ptr + pos, loc.to(tl.int64), mask=take)
    tl.store(count_ptr, tl.minimum(total.to(tl.int64), limit), mask=tile == 0)


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
    return torch.where(torch.isfinite(off), off, torch.zeros_like(off))


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
    tile: int = DEFAULT_TILE,
    row_block: int = DEFAULT_ROW_BLOCK,
) -> PrefetchList:
    """Host ids of history tokens certain to be in some row's top-k and not resident.

    scores [R, L] indexer scores of one query block over one request's history (column
    c = host id ``locs[c]``, distinct ids); ``host_to_device`` the layer's map; ``offsets``
    [R] per-row score offsets (None: 0); ``query_pos`` [R]: row r sees columns <= it
    (None: all); ``budget`` [1] int64: device-side allowance shared across calls, reduced
    by the count. ``ids`` lanes past ``count`` are unspecified. Three kernel launches and
    a few allocations: fixed shapes, no host sync. ``threshold_bin`` is for tests.

    ``block`` x ``tiles`` columns per histogram program, ``tile`` columns per flag and
    compaction program, ``row_block`` rows per flag step (powers of two).
    """
    _check(scores, locs, host_to_device, topk, cap, offsets, query_pos, budget)
    for name, v, least in (("block", block, 16), ("tile", tile, 16), ("row_block", row_block, 1)):
        if triton.next_power_of_2(v) != v or v < least:
            raise ValueError(f"{name} must be a power of two >= {least}, got {v}")
    if tiles < 1:
        raise ValueError(f"tiles must be >= 1, got {tiles}")
    rows, cols = scores.shape
    dev = scores.device
    if scores.stride(1) != 1:
        scores = scores.contiguous()
    locs = locs.contiguous()
    ids = torch.empty(cap, dtype=torch.int64, device=dev)
    if rows == 0 or cols == 0 or cap == 0:
        thr = torch.full((rows,), -1, dtype=torch.int32, device=dev)
        return PrefetchList(ids, torch.zeros(1, dtype=torch.int64, device=dev), thr)
    n_tiles = triton.cdiv(cols, tile)
    hist = torch.zeros(rows, NUM_BINS, dtype=torch.int32, device=dev)
    flags = torch.empty(cols, dtype=torch.int8, device=dev)
    tile_counts = torch.empty(n_tiles, dtype=torch.int32, device=dev)
    thr = torch.empty(rows, dtype=torch.int32, device=dev)
    count = torch.empty(1, dtype=torch.int64, device=dev)
    off = offsets.contiguous() if offsets is not None else scores  # dummy pointer
    qpos = query_pos.contiguous() if query_pos is not None else locs  # dummy pointer
    has = dict(HAS_OFFSET=offsets is not None, HAS_QPOS=query_pos is not None)
    stride = scores.stride(0)
    grid = (rows, triton.cdiv(cols, block * tiles))
    _hist_kernel[grid](scores, off, qpos, hist, cols, stride, BLOCK=block, TILES=tiles, **has)
    _flag_kernel[(n_tiles,)](
        scores,
        off,
        qpos,
        hist,
        locs,
        host_to_device,
        flags,
        tile_counts,
        thr,
        cols,
        stride,
        topk,
        rows,
        ROWS=triton.next_power_of_2(max(rows, row_block)),
        ROW_BLOCK=row_block,
        ABSENT_ID=ABSENT,
        TILE=tile,
        **has,
    )
    _compact_kernel[(n_tiles,)](
        flags,
        tile_counts,
        locs,
        budget if budget is not None else count,  # dummy pointer
        ids,
        count,
        cols,
        n_tiles,
        cap,
        HAS_BUDGET=budget is not None,
        TILE=tile,
        MAX_TILES=triton.next_power_of_2(n_tiles),
    )
    if budget is not None:
        budget.sub_(count)
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


# ------------------------------------------- the resolve's count of used prefetches
# Telemetry of EchoManager.prefetch (this prefetch's rows are mapped into cache slots):
# after the chunk's resolve, how many of them it selected.
@triton.jit(do_not_specialize=("lanes",))
def _prefetch_hits_kernel(
    ids_ptr, slots_ptr, count_ptr, d2h_ptr, prio_ptr, clock_ptr, hits_ptr, lanes,
    LANES: tl.constexpr,
):  # fmt: skip
    lane = tl.program_id(0) * LANES + tl.arange(0, LANES)
    live = (lane < lanes) & (lane < tl.load(count_ptr))
    ids = tl.load(ids_ptr + lane, mask=live, other=0)
    slots = tl.load(slots_ptr + lane, mask=live, other=0)
    owner = tl.load(d2h_ptr + slots, mask=live, other=-1).to(tl.int64)
    stamp = tl.load(prio_ptr + slots, mask=live, other=-1)
    hit = live & (owner == ids) & (stamp == tl.load(clock_ptr))
    tl.atomic_add(hits_ptr, tl.sum(hit.to(tl.int64), 0))


def count_prefetch_hits(
    miss_ids: torch.Tensor,
    miss_slots: torch.Tensor,
    miss_count: torch.Tensor,
    lanes: int,
    device_to_host: torch.Tensor,
    priority: torch.Tensor,
    clock: torch.Tensor,
    hits: torch.Tensor,
) -> None:
    """hits[0] += prefetched rows (the first ``miss_count`` of a prefetch's miss list,
    at most ``lanes``) that the resolve selected: still owned by their token and stamped
    with the layer's clock. One launch; :func:`count_prefetch_hits_reference` is the
    same in torch."""
    if lanes == 0:
        return
    block = 1024  # fixed: prefetch sizes vary (prefill), one compiled variant
    _prefetch_hits_kernel[(triton.cdiv(lanes, block),)](
        miss_ids, miss_slots, miss_count, device_to_host, priority, clock, hits, lanes,
        LANES=block,
    )  # fmt: skip


def count_prefetch_hits_reference(
    miss_ids: torch.Tensor,
    miss_slots: torch.Tensor,
    miss_count: torch.Tensor,
    lanes: int,
    device_to_host: torch.Tensor,
    priority: torch.Tensor,
    clock: torch.Tensor,
    hits: torch.Tensor,
) -> None:
    """Plain torch (fixed shapes, no host sync) of :func:`count_prefetch_hits`."""
    live = torch.arange(lanes, device=miss_ids.device) < miss_count
    slots = torch.where(live, miss_slots[:lanes], 0)
    owner = device_to_host[slots].to(torch.int64)
    selected = priority[slots] == clock.reshape(())
    hits += (live & (owner == miss_ids[:lanes]) & selected).sum()
