"""Exact decode top-k in one pass over the scores, from the k-th score the previous step left.

Why: the radix select (kernels/topk.py) reads every score three times, because it knows
nothing about the row. A decode row is the same request's next query, so its k-th score
is a guess at where this step's top-k ends. Each request row keeps the last k-th score b,
and the top-k runs in three launches:

1. count: per block of keys, how many visible keys score >= t_j for a ladder of GRID
   thresholds around b: b + (2 - j) d, where d is the score span that held about k keys
   below the last k-th score (a step that about doubles the count), so the scores may
   shift by a few steps between queries; one read of the scores;
2. compact: the highest rung whose row count n lies in [k, CAP] (or covers every visible
   key) is the row's pivot, and its candidates (score, position) go, in position order,
   to a CAP-wide buffer; a row no rung serves is marked for the fallback;
3. select: one program per served row finds the k-th largest candidate key by a 4-way
   search over the 32-bit key space (16 block-wide counts; no histogram), then writes the
   picks in ascending position with a single prefix scan.

Rows no rung serves (a first step, a scale jump) run the radix select's six launches in
the same call, whose programs return at once for served rows. Exactness does not depend
on the ladder: with n >= k candidates all scoring >= t, the k-th largest visible score is >= t, so
every key above it and every key tied with it is a candidate, and the candidates keep
their positions, so ties still go to the lowest position. The output is
``topk_positions``'s tensor for any ladder (tests/repo/test_kernel_topk_pivot.py asserts it
for guesses that hit, miss low and miss high). Both paths return the k-th score
(``model.indexer.exact_topk``'s rule) and leave it as the row's next b (the select also
its next d): speed hints only, that nothing else reads.

Exactness also needs every launch to agree on each threshold: the compact reads the rungs
the count kernel wrote rather than recomputing them (compiled for the GPU, the same formula
rounded differently in the two kernels: on the H200 that, and a 32-bit shift by 32 in
the search, picked wrong rows until both were fixed; the GPU exactness tests pass since,
benchmark/results/PROVENANCE.md).

Opt-in: ``SGLANG_ECHO_TOPK_PIVOT=1`` (parsed by ``sglang_echo.config``, read by
``model.indexer``, which passes the thresholds in) makes decode take this top-k where the
indexer's kernels run; unset or 0, the radix select (same output either way). Off by
default: on an H200 at 48 x 100K (benchmark/results/indexer.json, ``topk_pivot``) its
settled path took 113 us against the radix select's 206, but 58 against 50 at batch 1, and
160 us when one row in 48 goes to the radix select; the end-to-end study has not run this
form (the earlier, slower one made both of its engines slower: benchmark/results/history/,
topk-pivot).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from sglang_echo.kernels.pdl import pdl_prologue, use_pdl
from sglang_echo.kernels.topk import (
    DEFAULT_BLOCK,
    MIN_MAX_CHUNKS,
    MIN_MAX_KEYS,
    _key_score,
    _order_key,
    _row_keys,
    radix_select,
    topk_positions_reference,
)

# Candidates kept per row: 4k, so a rung may land at up to four times k and still serve.
CAP_PER_TOPK = 4
GRID = 8
# The select's prefix scan packs two counts of <= CAP into one int32.
MAX_CAP = 1 << 15
MAX_TOPK = MAX_CAP // CAP_PER_TOPK
SELECT_NUM_WARPS = 16
_PER_CALL = ["n_cols", "n_rows", "k", "topk", "scores_stride", "out_stride"]  # as topk.py's


def empty_pivots(rows: int, device: torch.device | str) -> torch.Tensor:
    """A thresholds table with no guesses yet: every row's first call runs the radix
    select and learns its pivot."""
    return torch.full((rows, 2), float("-inf"), dtype=torch.float32, device=device)


def pivot_serves(topk: int) -> bool:
    """Whether the candidate window of this top-k fits the select's packed scan."""
    return pivot_cap(topk) <= MAX_CAP


def pivot_cap(topk: int) -> int:
    """Candidate buffer width per row (a power of two, one compiled variant per top-k)."""
    return triton.next_power_of_2(CAP_PER_TOPK * topk)


@triton.jit
def _rung(pivot_ptr, j):
    """Threshold j of the row's ladder: the last k-th score b plus (2 - j) steps d (the
    span that held about k keys below b: a step about doubles the count there); without a
    usable d, b x 2^((1 - j) / 2) (mirrored below zero); -inf (every key) without a b."""
    b = tl.load(pivot_ptr)
    d = tl.load(pivot_ptr + 1)
    none = b == float("-inf")
    finite = tl.where(none, 0.0, b)
    scaled = finite - tl.abs(finite) * (1.0 - tl.exp2((1 - j) * 0.5))
    stepped = finite + (2 - j) * tl.where(d > 0, d, 0.0)
    usable = (d > 0) & (d < float("inf"))
    return tl.where(none, b, tl.where(usable, stepped, scaled))


@triton.jit(do_not_specialize=["n_cols", "n_rows", "scores_stride"])
def _count_kernel(
    scores_ptr, query_pos_ptr, thresholds_ptr, rows_ptr, counts_ptr, rungs_ptr, scores_stride,
    n_cols, n_rows, BLOCK: tl.constexpr, GRID: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Per block: the keys at or above each rung. The first block also writes the row's
    rungs, which the compact reads rather than recomputes: compiled, the same formula can
    round differently in two kernels (here j is a constant, there a variable: exp2 folded
    at compile time against the approximate instruction), and a candidate count that
    disagrees with the candidates written by one key makes the select read a stale one."""
    pdl_prologue(PDL)
    row, chunk = tl.program_id(0), tl.program_id(1)
    pivot = thresholds_ptr + 2 * tl.load(rows_ptr + row)
    cols, inside, _s, key = _row_keys(
        scores_ptr, query_pos_ptr, row, chunk, scores_stride, n_cols, BLOCK
    )
    visible = inside & (cols <= tl.load(query_pos_ptr + row))
    out = counts_ptr + (row * tl.num_programs(1) + chunk) * GRID
    for j in tl.static_range(GRID):
        rung = _rung(pivot, j)
        above = visible & (key >= _order_key(rung))
        tl.store(out + j, tl.sum(above.to(tl.int32), 0))
        if chunk == 0:
            tl.store(rungs_ptr + row * GRID + j, rung)


@triton.jit
def _pivot(counts_ptr, query_pos_ptr, row, n_cols, n_chunks, k, before_chunk,
           CAP: tl.constexpr, GRID: tl.constexpr, MAX_CHUNKS: tl.constexpr):  # fmt: skip
    """The row's rung (GRID where none serves it), its candidate count, and the count in
    the blocks before ``before_chunk``."""
    c = tl.arange(0, MAX_CHUNKS)[:, None]
    j = tl.arange(0, GRID)[None, :]
    tile = tl.load(counts_ptr + (row * n_chunks + c) * GRID + j, mask=c < n_chunks, other=0)
    n = tl.sum(tile, 0)
    visible = tl.minimum(tl.load(query_pos_ptr + row) + 1, n_cols)
    serves = (n <= CAP) & ((n >= k) | (n == visible))
    rung = tl.min(tl.where(serves, tl.arange(0, GRID), GRID), 0)
    pick = tl.arange(0, GRID) == rung
    before = tl.sum(tl.sum(tl.where((c < before_chunk) & pick[None, :], tile, 0), 1), 0)
    return rung, tl.sum(tl.where(pick, n, 0), 0), before, n


@triton.jit
def _respaced_step(pivot_ptr, n, k, GRID: tl.constexpr):
    """A missed row's next step d (the radix select resets its b to the exact k-th
    score): a quarter of the gap between the two rungs whose counts jumped past the window,
    or the whole ladder's height where no rung reached k; the same spacing otherwise."""
    j = tl.arange(0, GRID)
    t = _rung(pivot_ptr, j)
    first = tl.min(tl.where(n >= k, j, GRID), 0)
    t_first = tl.sum(tl.where(j == first, t, 0.0), 0)
    t_above = tl.sum(tl.where(j == first - 1, t, 0.0), 0)
    t0 = tl.sum(tl.where(j == 0, t, 0.0), 0)
    t1 = tl.sum(tl.where(j == 1, t, 0.0), 0)
    t_last = tl.sum(tl.where(j == GRID - 1, t, 0.0), 0)
    d = tl.where(first == GRID, t0 - t_last, tl.where(first == 0, t0 - t1, (t_above - t_first) / 4))
    return tl.where((d > 0) & (d < float("inf")), d, float("-inf"))


@triton.jit(do_not_specialize=_PER_CALL)
def _compact_kernel(
    scores_ptr, query_pos_ptr, thresholds_ptr, rows_ptr, counts_ptr, rungs_ptr, served_ptr,
    cand_scores_ptr, cand_cols_ptr, scores_stride, n_cols, n_rows, k, BLOCK: tl.constexpr,
    CAP: tl.constexpr, GRID: tl.constexpr, MAX_CHUNKS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_prologue(PDL)
    row, chunk = tl.program_id(0), tl.program_id(1)
    n_chunks = tl.num_programs(1)
    rung, n, before, counts = _pivot(
        counts_ptr, query_pos_ptr, row, n_cols, n_chunks, k, chunk, CAP, GRID, MAX_CHUNKS
    )
    pivot = thresholds_ptr + 2 * tl.load(rows_ptr + row)
    if chunk == 0:  # the select and the fallback read which rows are served
        tl.store(served_ptr + row, tl.where(rung < GRID, n, -1))
        if rung == GRID:
            tl.store(pivot + 1, _respaced_step(pivot, counts, k, GRID))
    if rung < GRID:
        cols, inside, s, key = _row_keys(
            scores_ptr, query_pos_ptr, row, chunk, scores_stride, n_cols, BLOCK
        )
        visible = inside & (cols <= tl.load(query_pos_ptr + row))
        cand = visible & (key >= _order_key(tl.load(rungs_ptr + row * GRID + rung)))
        slot = before + tl.cumsum(cand.to(tl.int32), 0) - 1
        tl.store(cand_scores_ptr + row * CAP + slot, s, mask=cand)
        tl.store(cand_cols_ptr + row * CAP + slot, cols, mask=cand)


@triton.jit
def _rank_key(key, valid, rank):
    """The rank-th largest of the valid keys (rank >= 1, keys in [0, 2^32)): the largest T
    with at least ``rank`` keys >= T. A 4-way search: each of 16 rounds counts the keys
    above three cut points in one block-wide reduction (the reductions, not the compares,
    are what a round costs)."""
    lo = tl.zeros((), dtype=tl.int64)
    quarter = tl.arange(0, 4).to(tl.int64)
    for r in range(16):
        # hi - lo, shifted in 64 bits: ``1 << (32 - 2 * r)`` is 32-bit arithmetic on the GPU
        # (the loop counter is an i32), where a shift by 32 is undefined; compiled for the
        # H200 that lost the first round, so keys at or above 2^30 were never resolved.
        one = tl.zeros((), dtype=tl.int64) + 1
        width = one << (one * (32 - 2 * r))
        cuts = lo + quarter * (width // 4)  # cuts[0] = lo: at least rank keys above it
        above = (valid[None, :] & (key[None, :] >= cuts[:, None])).to(tl.int32)
        enough = tl.sum(above, 1) >= rank
        lo = tl.max(tl.where(enough, cuts, 0), 0)
    return lo


@triton.jit(do_not_specialize=_PER_CALL)
def _select_kernel(
    served_ptr, cand_scores_ptr, cand_cols_ptr, out_ptr, kth_ptr, thresholds_ptr, rows_ptr,
    out_stride, n_rows, k, topk, CAP: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_prologue(PDL)
    row = tl.program_id(0)
    n = tl.load(served_ptr + row)
    if n >= 0:
        idx = tl.arange(0, CAP)
        valid = idx < n
        s = tl.load(cand_scores_ptr + row * CAP + idx, mask=valid, other=float("-inf"))
        cols = tl.load(cand_cols_ptr + row * CAP + idx, mask=valid, other=0)
        key = _order_key(s)
        threshold = _rank_key(key, valid, tl.maximum(tl.minimum(k, n), 1))
        above = valid & (key > threshold)
        equal = valid & (key == threshold)
        want = tl.minimum(k, n) - tl.sum(above.to(tl.int32), 0)
        # One scan for both prefix counts: above in the high half, equal in the low.
        packed = above.to(tl.int32) * 65536 + equal.to(tl.int32)
        before = tl.cumsum(packed, 0) - packed
        above_before, equal_before = before // 65536, before % 65536
        pick = above | (equal & (equal_before < want))
        out_slot = above_before + tl.minimum(equal_before, want)
        value = tl.where(s == float("-inf"), -1, cols.to(tl.int64))
        tl.store(out_ptr + row * out_stride + out_slot, value, mask=pick)
        kth = tl.where((n >= k) & (k == topk), _key_score(threshold), float("-inf"))
        tl.store(kth_ptr + row, kth)
        # The next ladder: from this k-th score, in steps that hold about k more keys at
        # the density between it and the lowest candidate (so a step about doubles the
        # count). Measured over fewer than k/4 keys that density is noise: the step that
        # served is kept then, where there is one.
        pivot = thresholds_ptr + 2 * tl.load(rows_ptr + row)
        lowest = tl.min(tl.where(valid, s, float("inf")), 0)
        step = (kth - lowest) * k / tl.maximum(n - k, 1)
        old_step = tl.load(pivot + 1)
        usable = (old_step > 0) & (old_step < float("inf"))
        measured = (step > 0) & (step < float("inf"))
        renew = measured & ~(usable & (4 * (n - k) < k))
        tl.store(pivot, kth)
        tl.store(pivot + 1, tl.where(renew, step, old_step))


def topk_positions_pivot(
    scores: torch.Tensor,
    query_pos: torch.Tensor,
    topk: int,
    thresholds: torch.Tensor,
    rows: torch.Tensor,
    block: int = DEFAULT_BLOCK,
    pdl: bool = False,
    select_num_warps: int = SELECT_NUM_WARPS,
    served: torch.Tensor | None = None,
    launches: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [R, L] fp32, query_pos [R], thresholds [S, 2] fp32 (per request row: the
    last k-th score, -inf for none, and the ladder's step, -inf for none), rows [R] (each
    score row's index into ``thresholds``, distinct) -> positions [R, topk] (ascending, -1 for masked or missing:
    ``topk_positions``'s tensor) and the k-th scores [R] (-inf where fewer than ``topk``
    keys are visible), which also become ``thresholds[rows, 0]``. Fixed shapes and no host
    reads: capturable in a CUDA graph. ``served`` (tests, benchmarks): an int32 [R]
    buffer that is left holding each row's candidate count, -1 where the radix select
    served it. ``launches`` (benchmarks): run only the first of the four stages (count,
    compact, select, radix fallback), so that their times can be told apart by differences;
    below 4 the output is incomplete."""
    if not 1 <= launches <= 4:
        raise ValueError(f"launches must be 1-4 (count, compact, select, fallback), got {launches}")
    if scores.dim() != 2 or scores.dtype != torch.float32:
        raise ValueError("scores must be a float32 [rows, keys] tensor")
    if thresholds.dtype != torch.float32 or thresholds.dim() != 2 or thresholds.shape[1] != 2:
        raise ValueError("thresholds must be a float32 [request rows, 2] tensor (pivot, step)")
    if not thresholds.is_contiguous():
        raise ValueError("thresholds must be contiguous (the kernels index it by row)")
    if not pivot_serves(topk):
        raise ValueError(f"the pivot top-k serves top-k <= {MAX_TOPK}, not {topk}")
    n_rows, n_cols = scores.shape
    k = min(topk, n_cols)
    out = torch.full((n_rows, topk), -1, dtype=torch.int64, device=scores.device)
    kth = torch.full((n_rows,), float("-inf"), dtype=torch.float32, device=scores.device)
    if n_rows == 0 or n_cols == 0:
        return out, kth
    scores = scores.contiguous()
    qpos = query_pos.to(torch.int64).contiguous()
    rows = rows.to(torch.int64).contiguous()
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    width = min(block, max(16, triton.next_power_of_2(n_cols))) if interpreting else block
    n_chunks = triton.cdiv(n_cols, width)
    cap = pivot_cap(topk)
    max_chunks = max(
        MIN_MAX_CHUNKS if interpreting else MIN_MAX_KEYS // width,
        triton.next_power_of_2(n_chunks),
    )
    dev = scores.device
    counts = torch.empty(n_rows, n_chunks, GRID, dtype=torch.int32, device=dev)
    if served is None:
        served = torch.empty(n_rows, dtype=torch.int32, device=dev)
    cand_scores = torch.empty(n_rows, cap, dtype=torch.float32, device=dev)
    cand_cols = torch.empty(n_rows, cap, dtype=torch.int32, device=dev)
    chained = use_pdl(dev, pdl)
    launch = dict(PDL=chained, launch_pdl=chained)
    rungs = torch.empty(n_rows, GRID, dtype=torch.float32, device=dev)
    head = (scores, qpos, thresholds, rows, counts, rungs)
    grid = (n_rows, n_chunks)
    _count_kernel[grid](
        *head, scores.stride(0), n_cols, n_rows, BLOCK=width, GRID=GRID, **launch
    )  # fmt: skip
    if launches > 1:
        _compact_kernel[grid](
            *head, served, cand_scores, cand_cols, scores.stride(0), n_cols, n_rows, k,
            BLOCK=width, CAP=cap, GRID=GRID, MAX_CHUNKS=max_chunks, **launch,
        )  # fmt: skip
    if launches > 2:
        _select_kernel[(n_rows,)](
            served, cand_scores, cand_cols, out, kth, thresholds, rows, out.stride(0), n_rows,
            k, topk, CAP=cap, num_warps=select_num_warps, **launch,
        )  # fmt: skip
    if launches > 3:
        fallback = (served, kth, thresholds, rows, topk)
        radix_select(scores, qpos, out, k, block, pdl, fallback=fallback)
    return out, kth


# --------------------------------------------------------------------------- reference
def topk_pivot_reference(
    scores: torch.Tensor, query_pos: torch.Tensor, topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions (``topk_positions_reference``) and k-th scores (``exact_topk``'s rule:
    -inf where any position is missing), which are also the next thresholds."""
    pos = topk_positions_reference(scores, query_pos, topk)
    missing = pos < 0
    picked = torch.gather(scores, 1, pos.clamp(min=0)).masked_fill(missing, float("inf"))
    kth = picked.amin(dim=1).masked_fill(missing.any(dim=1), float("-inf"))
    return pos, kth
