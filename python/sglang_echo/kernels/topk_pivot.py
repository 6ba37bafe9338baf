"""Exact decode top-k in one pass over the scores, from a threshold the previous step left.

Why: the radix select (kernels/topk.py) reads every score six times, because it knows
nothing about the row. A decode row is the same request's next query: its score at rank
2k moves little from one step to the next. So each request row keeps a threshold t, and
the top-k runs in three launches:

1. count: per block of keys, how many visible keys score >= t (one read of the scores);
2. compact: where a row's count n lies in [k, CAP] (or n covers every visible key), its
   candidates (score, position) are written in position order to a CAP-wide buffer;
3. select: one program per row runs the radix select on its <= CAP candidates in
   registers and writes the picks in ascending position. A row whose n missed the window
   (a first step, a threshold gone stale) runs the full-row radix select in the same
   program instead, looping over its keys.

Exactness does not depend on t: with n >= k candidates all scoring >= t, the k-th largest
visible score is >= t, so every key above it and every key tied with it is a candidate,
and the candidates keep their positions, so ties still go to the lowest position. The
output is the same tensor as ``topk_positions`` for any t (tests/test_kernel_topk_pivot.py
asserts it for thresholds that hit, miss low and miss high).

The select also returns the k-th score (what ``model.indexer.exact_topk`` reports to the
prefetchers, with its -inf rule) and writes the row's next threshold: the visible score at
rank AIM = 2k where the candidates reach it (or the full row ran), else t unchanged; a
count at AIM sits mid-window, so drift either way still hits. Thresholds are speed hints
only: nothing else reads them, and a stale one costs one full-row pass.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from sglang_echo.config import parse_flag
from sglang_echo.kernels.pdl import pdl_prologue, use_pdl
from sglang_echo.kernels.topk import (
    DEFAULT_BLOCK,
    MIN_MAX_CHUNKS,
    MIN_MAX_KEYS,
    _order_key,
    _row_keys,
    topk_positions_reference,
)

ENV_TOPK_PIVOT = "SGLANG_ECHO_TOPK_PIVOT"
# Candidates kept per row: 4k, so a count aimed at 2k may halve or double and still hit.
CAP_PER_TOPK = 4
AIM_PER_TOPK = 2
SELECT_NUM_WARPS = 8
_PER_CALL = ["n_cols", "n_rows", "k", "topk", "aim"]


def pivot_requested(environ: dict | None = None) -> bool:
    """``SGLANG_ECHO_TOPK_PIVOT``: unset or 1 = decode takes this top-k where the indexer's
    kernels run, 0 = the radix select (same output either way)."""
    raw = (os.environ if environ is None else environ).get(ENV_TOPK_PIVOT)
    return True if raw is None or not raw.strip() else parse_flag(ENV_TOPK_PIVOT, raw)


def pivot_cap(topk: int) -> int:
    """Candidate buffer width per row (a power of two, one compiled variant per top-k)."""
    return triton.next_power_of_2(CAP_PER_TOPK * topk)


@triton.jit
def _key_score(key):
    """The inverse of ``_order_key``: int64 key -> its float32 score."""
    bits = tl.where(key >= 0x80000000, key - 0x80000000, 0xFFFFFFFF - key)
    return bits.to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _choose_digit(h, prefix, want, shift: tl.constexpr):
    """Given the histogram of the current digit, the bin holding the want-th largest key."""
    bins = tl.arange(0, 256)
    at_or_above = tl.sum(h, 0) - tl.cumsum(h, 0) + h
    chosen = tl.sum((at_or_above >= want).to(tl.int64), 0) - 1
    want = want - tl.sum(tl.where(bins == chosen, at_or_above - h, 0), 0)
    return prefix | (chosen << shift), want


@triton.jit
def _on_prefix(key, prefix, shift: tl.constexpr):
    return (key >> (shift + 8)) == (prefix >> (shift + 8))


@triton.jit
def _rank_in_registers(key, valid, rank):
    """The rank-th largest key among ``valid`` (rank >= 1) and how many keys equal to it
    are within the top ``rank``."""
    prefix = tl.zeros((), dtype=tl.int64)
    want = tl.zeros((), dtype=tl.int64) + rank
    for p in tl.static_range(4):
        match = valid & _on_prefix(key, prefix, 24 - 8 * p)
        digit = ((key >> (24 - 8 * p)) & 255).to(tl.int32)
        h = tl.histogram(digit, 256, mask=match).to(tl.int64)
        prefix, want = _choose_digit(h, prefix, want, 24 - 8 * p)
    return prefix, want


@triton.jit
def _window(counts_ptr, query_pos_ptr, row, n_cols, n_chunks, k, CAP: tl.constexpr,
            MAX_CHUNKS: tl.constexpr):  # fmt: skip
    """The row's candidate count n, and whether the candidates hold its top-k."""
    c = tl.arange(0, MAX_CHUNKS)
    n = tl.sum(tl.load(counts_ptr + row * n_chunks + c, mask=c < n_chunks, other=0), 0)
    visible = tl.minimum(tl.load(query_pos_ptr + row) + 1, n_cols)
    hit = (n <= CAP) & ((n >= k) | (n == visible))
    return n, hit


@triton.jit(do_not_specialize=["n_cols", "n_rows"])
def _count_kernel(
    scores_ptr, query_pos_ptr, thresholds_ptr, rows_ptr, counts_ptr, scores_stride, n_cols,
    n_rows, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_prologue(PDL)
    row, chunk = tl.program_id(0), tl.program_id(1)
    t_key = _order_key(tl.load(thresholds_ptr + tl.load(rows_ptr + row)))
    cols, inside, _s, key = _row_keys(
        scores_ptr, query_pos_ptr, row, chunk, scores_stride, n_cols, BLOCK
    )
    cand = inside & (cols <= tl.load(query_pos_ptr + row)) & (key >= t_key)
    tl.store(counts_ptr + row * tl.num_programs(1) + chunk, tl.sum(cand.to(tl.int32), 0))


@triton.jit(do_not_specialize=_PER_CALL)
def _compact_kernel(
    scores_ptr, query_pos_ptr, thresholds_ptr, rows_ptr, counts_ptr, cand_scores_ptr,
    cand_cols_ptr, scores_stride, n_cols, n_rows, k, BLOCK: tl.constexpr, CAP: tl.constexpr,
    MAX_CHUNKS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_prologue(PDL)
    row, chunk = tl.program_id(0), tl.program_id(1)
    n_chunks = tl.num_programs(1)
    _n, hit = _window(counts_ptr, query_pos_ptr, row, n_cols, n_chunks, k, CAP, MAX_CHUNKS)
    if hit:
        c = tl.arange(0, MAX_CHUNKS)
        before = tl.sum(tl.load(counts_ptr + row * n_chunks + c, mask=c < chunk, other=0), 0)
        t_key = _order_key(tl.load(thresholds_ptr + tl.load(rows_ptr + row)))
        cols, inside, s, key = _row_keys(
            scores_ptr, query_pos_ptr, row, chunk, scores_stride, n_cols, BLOCK
        )
        cand = inside & (cols <= tl.load(query_pos_ptr + row)) & (key >= t_key)
        slot = before + tl.cumsum(cand.to(tl.int32), 0) - 1
        tl.store(cand_scores_ptr + row * CAP + slot, s, mask=cand)
        tl.store(cand_cols_ptr + row * CAP + slot, cols, mask=cand)


@triton.jit
def _select_candidates(
    cand_scores_ptr, cand_cols_ptr, out_ptr, kth_ptr, thresholds_ptr, slot, row, n, k, topk,
    aim, out_stride, CAP: tl.constexpr,
):  # fmt: skip
    idx = tl.arange(0, CAP)
    valid = idx < n
    s = tl.load(cand_scores_ptr + row * CAP + idx, mask=valid, other=float("-inf"))
    cols = tl.load(cand_cols_ptr + row * CAP + idx, mask=valid, other=0)
    key = _order_key(s)
    threshold, want = _rank_in_registers(key, valid, tl.maximum(tl.minimum(k, n), 1))
    equal = valid & (key == threshold)
    equal_rank = tl.cumsum(equal.to(tl.int32), 0) - 1
    pick = valid & ((key > threshold) | (equal & (equal_rank < want)))
    out_slot = tl.cumsum(pick.to(tl.int32), 0) - 1
    value = tl.where(s == float("-inf"), -1, cols.to(tl.int64))
    tl.store(out_ptr + row * out_stride + out_slot, value, mask=pick & (n > 0))
    kth = tl.where((n >= k) & (k == topk), _key_score(threshold), float("-inf"))
    tl.store(kth_ptr + row, kth)
    if n >= aim:
        aim_key, _want = _rank_in_registers(key, valid, aim)
        tl.store(thresholds_ptr + slot, _key_score(aim_key))


@triton.jit
def _select_full_row(
    scores_ptr, query_pos_ptr, out_ptr, kth_ptr, thresholds_ptr, slot, row, k, topk, aim,
    scores_stride, out_stride, n_cols, n_chunks, BLOCK: tl.constexpr, MAX_CHUNKS: tl.constexpr,
):  # fmt: skip
    """The radix select of kernels/topk.py in one program: four histogram passes (the k-th
    key over every key, masked ones at -inf, beside the AIM-th over visible keys), then a
    pass writing picks in position order."""
    qpos = tl.load(query_pos_ptr + row)
    visible = tl.minimum(qpos + 1, n_cols)
    aim_rank = tl.maximum(tl.minimum(aim, visible), 1)
    prefix = tl.zeros((), dtype=tl.int64)
    want = tl.zeros((), dtype=tl.int64) + k
    aim_prefix = tl.zeros((), dtype=tl.int64)
    aim_want = tl.zeros((), dtype=tl.int64) + aim_rank
    for p in tl.static_range(4):
        h = tl.zeros((256,), dtype=tl.int64)
        aim_h = tl.zeros((256,), dtype=tl.int64)
        for chunk in range(MAX_CHUNKS):  # a constant bound: the interpreter needs one
            if chunk < n_chunks:
                cols, inside, _s, key = _row_keys(
                    scores_ptr, query_pos_ptr, row, chunk, scores_stride, n_cols, BLOCK
                )
                digit = ((key >> (24 - 8 * p)) & 255).to(tl.int32)
                on_k = inside & _on_prefix(key, prefix, 24 - 8 * p)
                h += tl.histogram(digit, 256, mask=on_k)
                on_aim = inside & (cols <= qpos) & _on_prefix(key, aim_prefix, 24 - 8 * p)
                aim_h += tl.histogram(digit, 256, mask=on_aim)
        prefix, want = _choose_digit(h, prefix, want, 24 - 8 * p)
        aim_prefix, aim_want = _choose_digit(aim_h, aim_prefix, aim_want, 24 - 8 * p)
    taken = tl.zeros((), dtype=tl.int64)
    equal_before = tl.zeros((), dtype=tl.int64)
    for chunk in range(MAX_CHUNKS):
        if chunk < n_chunks:
            cols, inside, s, key = _row_keys(
                scores_ptr, query_pos_ptr, row, chunk, scores_stride, n_cols, BLOCK
            )
            equal = inside & (key == prefix)
            equal_rank = equal_before + tl.cumsum(equal.to(tl.int64), 0) - 1
            pick = inside & ((key > prefix) | (equal & (equal_rank < want)))
            out_slot = taken + tl.cumsum(pick.to(tl.int64), 0) - 1
            value = tl.where(s == float("-inf"), -1, cols.to(tl.int64))
            tl.store(out_ptr + row * out_stride + out_slot, value, mask=pick)
            taken += tl.sum(pick.to(tl.int64), 0)
            equal_before += tl.sum(equal.to(tl.int64), 0)
    tl.store(kth_ptr + row, tl.where(k == topk, _key_score(prefix), float("-inf")))
    aim_score = tl.where(visible > 0, _key_score(aim_prefix), float("-inf"))
    tl.store(thresholds_ptr + slot, aim_score)


@triton.jit(do_not_specialize=[*_PER_CALL, "n_chunks"])
def _select_kernel(
    scores_ptr, query_pos_ptr, thresholds_ptr, rows_ptr, counts_ptr, cand_scores_ptr,
    cand_cols_ptr, out_ptr, kth_ptr, scores_stride, out_stride, n_cols, n_rows, k, topk, aim,
    n_chunks, BLOCK: tl.constexpr, CAP: tl.constexpr, MAX_CHUNKS: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    pdl_prologue(PDL)
    row = tl.program_id(0)
    slot = tl.load(rows_ptr + row)
    n, hit = _window(counts_ptr, query_pos_ptr, row, n_cols, n_chunks, k, CAP, MAX_CHUNKS)
    if hit:
        _select_candidates(
            cand_scores_ptr, cand_cols_ptr, out_ptr, kth_ptr, thresholds_ptr, slot, row, n,
            k, topk, aim, out_stride, CAP,
        )  # fmt: skip
    else:
        _select_full_row(
            scores_ptr, query_pos_ptr, out_ptr, kth_ptr, thresholds_ptr, slot, row, k, topk,
            aim, scores_stride, out_stride, n_cols, n_chunks, BLOCK, MAX_CHUNKS,
        )  # fmt: skip


def topk_positions_pivot(
    scores: torch.Tensor,
    query_pos: torch.Tensor,
    topk: int,
    thresholds: torch.Tensor,
    rows: torch.Tensor,
    block: int = DEFAULT_BLOCK,
    pdl: bool = False,
    select_num_warps: int = SELECT_NUM_WARPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [R, L] fp32, query_pos [R], thresholds [S] fp32 (per request row; -inf: none
    yet), rows [R] (each score row's index into ``thresholds``, distinct) -> positions
    [R, topk] (ascending, -1 for masked or missing: ``topk_positions``'s tensor) and the
    k-th scores [R] (-inf where fewer than ``topk`` keys are visible). Updates
    ``thresholds[rows]`` in place for the next step. Fixed shapes and no host reads:
    capturable in a CUDA graph."""
    if scores.dim() != 2 or scores.dtype != torch.float32:
        raise ValueError("scores must be a float32 [rows, keys] tensor")
    if thresholds.dtype != torch.float32 or thresholds.dim() != 1:
        raise ValueError("thresholds must be a float32 [request rows] tensor")
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
    if interpreting:
        block = min(block, max(16, triton.next_power_of_2(n_cols)))
    n_chunks = triton.cdiv(n_cols, block)
    cap = pivot_cap(topk)
    max_chunks = max(
        MIN_MAX_CHUNKS if interpreting else MIN_MAX_KEYS // block,
        triton.next_power_of_2(n_chunks),
    )
    counts = torch.empty(n_rows, n_chunks, dtype=torch.int32, device=scores.device)
    cand_scores = torch.empty(n_rows, cap, dtype=torch.float32, device=scores.device)
    cand_cols = torch.empty(n_rows, cap, dtype=torch.int32, device=scores.device)
    chained = use_pdl(scores.device, pdl)
    launch = dict(PDL=chained, launch_pdl=chained)
    head = (scores, qpos, thresholds, rows, counts)
    grid = (n_rows, n_chunks)
    _count_kernel[grid](*head, scores.stride(0), n_cols, n_rows, BLOCK=block, **launch)
    _compact_kernel[grid](
        *head, cand_scores, cand_cols, scores.stride(0), n_cols, n_rows, k, BLOCK=block,
        CAP=cap, MAX_CHUNKS=max_chunks, **launch,
    )  # fmt: skip
    _select_kernel[(n_rows,)](
        *head, cand_scores, cand_cols, out, kth, scores.stride(0), out.stride(0), n_cols,
        n_rows, k, topk, min(AIM_PER_TOPK * topk, cap), n_chunks, BLOCK=block, CAP=cap,
        MAX_CHUNKS=max_chunks, num_warps=select_num_warps, **launch,
    )  # fmt: skip
    return out, kth


# --------------------------------------------------------------------------- reference
def next_threshold_reference(
    scores: torch.Tensor, query_pos: torch.Tensor, topk: int, thresholds: torch.Tensor
) -> torch.Tensor:
    """What the select leaves in each row's threshold (thresholds [R] as read): the
    visible score at rank AIM where the candidates reached AIM or missed the window (the
    lowest visible score when fewer keys are visible; -inf with none), else unchanged."""
    n_rows, n_cols = scores.shape
    k, cap = min(topk, n_cols), pivot_cap(topk)
    aim = min(AIM_PER_TOPK * topk, cap)
    visible_mask = torch.arange(n_cols, device=scores.device) <= query_pos.view(-1, 1)
    out = thresholds.clone()
    for r in range(n_rows):
        vis = scores[r][visible_mask[r]]
        n = int((vis >= thresholds[r]).sum()) if thresholds[r] > float("-inf") else vis.numel()
        hit = n <= cap and (n >= k or n == vis.numel())
        if hit and n < aim:
            continue
        if vis.numel() == 0:
            out[r] = float("-inf")
            continue
        out[r] = vis.sort(descending=True).values[min(aim, vis.numel()) - 1]
    return out


def topk_pivot_reference(
    scores: torch.Tensor, query_pos: torch.Tensor, topk: int, thresholds: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Positions (``topk_positions_reference``), k-th scores (``exact_topk``'s rule) and
    the next thresholds, all from plain torch."""
    pos = topk_positions_reference(scores, query_pos, topk)
    missing = pos < 0
    picked = torch.gather(scores, 1, pos.clamp(min=0)).masked_fill(missing, float("inf"))
    kth = picked.amin(dim=1).masked_fill(missing.any(dim=1), float("-inf"))
    return pos, kth, next_threshold_reference(scores, query_pos, topk, thresholds)
