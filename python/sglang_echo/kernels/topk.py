"""Exact top-k per row by radix select, with ties going to the lowest position.

Scores become order-preserving 32-bit keys; four 256-bin histograms over the key's bytes
(most significant first) find the k-th largest key T and how many entries equal to T are
needed; a last pass writes, in position order, every entry above T and the
lowest-positioned entries equal to T. The set is exactly that of ``select_topk`` (the
plain-torch reference at the end of this file, also the model's CPU path); the order is
ascending position instead of descending score. Positions whose score is -inf (masked)
come back as -1.

Every pass splits each row over many programs (one per BLOCK columns), so 48 rows of
100K keys run on 48 x 49 programs: each pass adds its programs' histograms into a per-row,
per-pass histogram with atomics, and the next pass replays the digit choices of the
previous ones from those histograms (a few hundred loads) instead of a launch of its own.
Six launches, three of which read the scores:

1. the first digit's histogram (every key);
2. the split (every key): keys above the chosen top byte are picks; those at it are the
   candidates, written in position order to the block's own stretch of a buffer, with
   their count and the second digit's histogram;
3. and 4. the last two digits, over each block's candidates only (about a tenth of the
   keys on the bench's logits, ``indexer.json``'s ``topk_candidate_share``);
5. the count: per block, entries above T and equal to it (from the split's count and the
   candidates);
6. the collect (every key): each block writes its picks after the picks of the blocks
   before it.

Nsight Compute on the H200 (``benchmark/results/gpu_checks_logs/``, stage
``indexer_profile``) finds the full-row passes bound by integer issue (the ballot-based
histogram and the key arithmetic), not by DRAM, hence 32-bit keys and passes that read
only candidates. Measured on an H200 at 48 x 100K, replayed from a CUDA graph as decode
runs it (benchmark/results/indexer.json, ``topk_us``; ``topk_launch_sweep`` times other
launch shapes), against torch.topk (which breaks ties however its radix pass falls) and
the tie-stable sort that the model used before. On CUDA the model's decode and prefill
top-k run this kernel (``model.indexer.exact_topk``); the sort stays the CPU path and
reference. Every block is DEFAULT_BLOCK wide and the collect pass sums a fixed
MIN_MAX_CHUNKS block counts, so contexts up to 256K keys share one compiled variant per
kernel.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from sglang_echo.kernels.pdl import pdl_prologue, use_pdl

# One width for every batch and context: each kernel compiles once, never mid-serving.
# 2048 keys per program, 4 warps: in indexer.json's topk_launch_sweep, 4096 is as fast at
# 48 x 100K but slower at batch 1, 1024 the reverse, and 2048 is near the faster at both
# (the candidate split's first run: docs/ARCHITECTURE.md section 15, "Measured choices").
# A width chosen by batch would compile a second variant the first time serving meets the
# other width.
DEFAULT_BLOCK = 2048
DEFAULT_NUM_WARPS = 4  # Triton's default; indexer_bench's topk_launch_sweep times others
# Candidates the last two digits and the count read per piece: a block's candidates are
# usually a small share of it (those at the k-th key's top byte), and a piece's histogram
# costs its full width whatever the mask. Widths from 128 to 1024 time close to each other
# at 48 x 100K and 2048 is slower (indexer.json's topk_launch_sweep).
DEFAULT_CAND_BLOCK = 512
# Loads first (no longer an option): the split, candidate, count and collect programs
# issue every global load they need (the histograms of the digits chosen so far, the counts, the scores or the
# first candidates) before the replay of the digit choices, instead of one after another
# between its block-wide reductions. Compiled for sm_90 (PTX, compile only), the other
# order's collect issues its loads in seven groups in a row, the scores' after dozens of
# barriers; with loads first all of them precede the first barrier. On the H200
# (graph-replayed at 48 x 100K and at batch 1) loads first was faster at both, in
# indexer_bench's topk_launch_sweep and in topk_peer_bench's run (topk_peers.json,
# ours_loads_first_off; the runs: docs/ARCHITECTURE.md section 15, "Measured choices").
# The output was the same tensor either way; the other order left the package in issue 51.
# Blocks per row the collect pass sums over at compile time: 256K keys' worth (128 x 2048,
# or 256 x 1024), so every context up to that shares one compiled variant per block width
# (longer rows get a wider one). The interpreter (CPU tests) keeps 64 at any width.
MIN_MAX_KEYS = 64 * 4096
MIN_MAX_CHUNKS = 64
# Sizes that change from call to call are not value-specialized: one variant per kernel.
# Strides too: a decode width that is a multiple of 16 compiled a second variant of every
# kernel mid-serving (an H200 test: docs/ARCHITECTURE.md section 15, "Measured choices"),
# for a few vector loads.
_PER_CALL = ["n_cols", "n_rows", "k", "topk", "scores_stride", "out_stride"]


@triton.jit
def _order_key(scores):
    """float32 -> int64 in [0, 2^32) with the same order (larger score, larger key); the
    pivot's 64-bit searches (research/topk_pivot/kernel.py) use this form."""
    bits = scores.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    negative = bits >= 0x80000000
    return tl.where(negative, 0xFFFFFFFF - bits, bits + 0x80000000)


@triton.jit
def _key_score(key):
    """The inverse of ``_order_key``: int64 key -> its float32 score."""
    bits = tl.where(key >= 0x80000000, key - 0x80000000, 0xFFFFFFFF - key)
    return bits.to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _order_key32(scores):
    """float32 -> uint32 with the same order and the same values as ``_order_key``: the
    radix passes are integer-bound (Nsight Compute on the H200: the histogram passes
    stall most on a saturated math pipe), and 32-bit keys halve their integer work."""
    bits = scores.to(tl.uint32, bitcast=True)
    return bits ^ tl.where((bits >> 31) == 1, 0xFFFFFFFF, 0x80000000)


@triton.jit
def _key32_score(key):
    """The inverse of ``_order_key32``."""
    bits = key ^ tl.where((key >> 31) == 1, 0x80000000, 0xFFFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _choose(h, prefix, want, P: tl.constexpr):
    """Digit P's choice from its histogram h [256]: the bin holding the ``want``-th key
    from the top, the prefix with it, and the count still wanted at it."""
    bins = tl.arange(0, 256)
    at_or_above = tl.sum(h, 0) - tl.cumsum(h, 0) + h  # entries whose digit >= bin
    chosen = tl.sum((at_or_above >= want).to(tl.int32), 0) - 1
    want = want - tl.sum(tl.where(bins == chosen, at_or_above - h, 0), 0)
    return prefix | (chosen.to(tl.uint32) << (24 - 8 * P)), want


@triton.jit
def _hist_rows(hist_ptr, row, n_rows, PASSES: tl.constexpr):
    """The row's first PASSES histograms, loaded at once (rows past PASSES are not
    loaded), so that the replay's reductions wait on one load, not on one per digit."""
    at = hist_ptr + row * 256 + tl.arange(0, 256)
    h0 = tl.load(at)
    h1, h2, h3 = h0, h0, h0
    if PASSES > 1:
        h1 = tl.load(at + n_rows * 256)
    if PASSES > 2:
        h2 = tl.load(at + 2 * n_rows * 256)
    if PASSES > 3:
        h3 = tl.load(at + 3 * n_rows * 256)
    return h0, h1, h2, h3


@triton.jit
def _replay_rows(hists, k, PASSES: tl.constexpr):
    """The key prefix (uint32) and the count still wanted at it, after PASSES digit
    choices, from ``_hist_rows``."""
    h0, h1, h2, h3 = hists
    prefix, want = _choose(h0, tl.zeros((), dtype=tl.uint32), tl.zeros((), dtype=tl.int32) + k, 0)
    if PASSES > 1:
        prefix, want = _choose(h1, prefix, want, 1)
    if PASSES > 2:
        prefix, want = _choose(h2, prefix, want, 2)
    if PASSES > 3:
        prefix, want = _choose(h3, prefix, want, 3)
    return prefix, want


@triton.jit
def _row_scores(scores_ptr, query_pos_ptr, row, chunk, scores_stride, n_cols, BLOCK: tl.constexpr):
    """This block's columns, which exist, and their scores (-inf past the query)."""
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    inside = cols < n_cols
    s = tl.load(scores_ptr + row * scores_stride + cols, mask=inside, other=0.0)
    s = tl.where(cols <= tl.load(query_pos_ptr + row), s, float("-inf"))
    return cols, inside, s


@triton.jit
def _row_keys(scores_ptr, query_pos_ptr, row, chunk, scores_stride, n_cols, BLOCK: tl.constexpr):
    cols, inside, s = _row_scores(
        scores_ptr, query_pos_ptr, row, chunk, scores_stride, n_cols, BLOCK
    )
    return cols, inside, s, _order_key(s)


@triton.jit
def _unserved(served_ptr, row, FALLBACK: tl.constexpr):
    """Whether this row is the radix select's to serve: always, or with FALLBACK (the rows
    research/topk_pivot/kernel.py could not serve) where ``served`` holds -1 (a candidate count
    where the pivot served it)."""
    if FALLBACK:
        return tl.load(served_ptr + row) < 0
    return row >= 0


@triton.jit
def _add_hist(hist_ptr, row, n_rows, counts, PASS: tl.constexpr):
    # Relaxed: the histogram is read by the next launch only (kernels/pdl.py). Empty bins
    # are skipped: past the first digit most are.
    bins = tl.arange(0, 256)
    tl.atomic_add(
        hist_ptr + (PASS * n_rows + row) * 256 + bins, counts, mask=counts > 0, sem="relaxed"
    )


@triton.jit(do_not_specialize=_PER_CALL)
def _hist_kernel(
    scores_ptr, query_pos_ptr, hist_ptr, served_ptr, scores_stride, n_cols, n_rows,
    BLOCK: tl.constexpr, PDL: tl.constexpr, FALLBACK: tl.constexpr,
):  # fmt: skip
    """The first digit: this block's histogram of its keys' top bytes."""
    pdl_prologue(PDL)
    row, chunk = tl.program_id(0), tl.program_id(1)
    if _unserved(served_ptr, row, FALLBACK):  # a served row's programs read nothing
        _cols, inside, s = _row_scores(
            scores_ptr, query_pos_ptr, row, chunk, scores_stride, n_cols, BLOCK
        )
        # 256 bins with a mask, not a 512-bin histogram whose upper half collects the keys
        # off the prefix: the ballot-based lowering does a third less work (PTX for sm_90).
        counts = tl.histogram((_order_key32(s) >> 24).to(tl.int32), 256, mask=inside)
        _add_hist(hist_ptr, row, n_rows, counts, 0)


@triton.jit(do_not_specialize=[*_PER_CALL, "n_chunks"])
def _split_kernel(
    scores_ptr, query_pos_ptr, hist_ptr, served_ptr, split_ptr, cand_ptr, scores_stride,
    n_cols, n_rows, k, n_chunks, BLOCK: tl.constexpr, PDL: tl.constexpr,
    FALLBACK: tl.constexpr,
):  # fmt: skip
    """After the first digit: this block's keys above its chosen top byte are picks, those
    at it are the candidates. Their count, the candidates' keys in position order in the
    block's own stretch of ``cand`` (no offsets from other blocks needed), and their
    second-digit histogram. The last two digits and the count read only candidates."""
    pdl_prologue(PDL)
    row, chunk = tl.program_id(0), tl.program_id(1)
    if _unserved(served_ptr, row, FALLBACK):  # a served row's programs read nothing
        # Loads first: both loads in flight before the replay waits on one.
        hists = _hist_rows(hist_ptr, row, n_rows, 1)
        _cols, inside, s = _row_scores(
            scores_ptr, query_pos_ptr, row, chunk, scores_stride, n_cols, BLOCK
        )
        prefix, _want = _replay_rows(hists, k, 1)
        key = _order_key32(s)
        top = key >> 24
        above = inside & (top > (prefix >> 24))
        cand = inside & (top == (prefix >> 24))
        base = row * n_chunks + chunk
        tl.store(split_ptr + 2 * base, tl.sum(above.to(tl.int32), 0))
        tl.store(split_ptr + 2 * base + 1, tl.sum(cand.to(tl.int32), 0))
        rank = tl.cumsum(cand.to(tl.int32), 0) - 1
        stretch = cand_ptr + base.to(tl.int64) * BLOCK
        tl.store(stretch + rank, key.to(tl.int32, bitcast=True), mask=cand)
        counts = tl.histogram(((key >> 16) & 255).to(tl.int32), 256, mask=cand)
        _add_hist(hist_ptr, row, n_rows, counts, 1)


@triton.jit
def _piece_hist(stored, live, prefix, PASS: tl.constexpr):
    """Digit PASS's histogram over one piece of candidates (as stored: int32 bits) that
    match the prefix."""
    key = stored.to(tl.uint32, bitcast=True)
    shift: tl.constexpr = 24 - 8 * PASS
    match = live & ((key >> (shift + 8)) == (prefix >> (shift + 8)))
    return tl.histogram(((key >> shift) & 255).to(tl.int32), 256, mask=match)


@triton.jit
def _piece_counts(stored, live, threshold):
    """Per lane: whether a candidate is above the k-th key, and whether it equals it."""
    key = stored.to(tl.uint32, bitcast=True)
    return (live & (key > threshold)).to(tl.int32), (live & (key == threshold)).to(tl.int32)


@triton.jit(do_not_specialize=[*_PER_CALL, "n_chunks"])
def _cand_hist_kernel(
    hist_ptr, served_ptr, split_ptr, cand_ptr, n_rows, k, n_chunks, PASS: tl.constexpr,
    BLOCK: tl.constexpr, CAND_BLOCK: tl.constexpr, PDL: tl.constexpr, FALLBACK: tl.constexpr,
):  # fmt: skip
    """Digit PASS (2 or 3) among this block's candidates that match the prefix, in pieces
    of CAND_BLOCK: the work follows the candidate count, not the block's width."""
    pdl_prologue(PDL)
    row, chunk = tl.program_id(0), tl.program_id(1)
    if _unserved(served_ptr, row, FALLBACK):
        # Loads first: the histograms, the count and the first piece, then the replay.
        hists = _hist_rows(hist_ptr, row, n_rows, PASS)
        base = row * n_chunks + chunk
        n_cand = tl.load(split_ptr + 2 * base + 1)
        stretch = cand_ptr + base.to(tl.int64) * BLOCK
        i = tl.arange(0, CAND_BLOCK)
        first = tl.load(stretch + i, mask=i < n_cand, other=0)
        prefix, _want = _replay_rows(hists, k, PASS)
        counts = _piece_hist(first, i < n_cand, prefix, PASS)
        start = tl.zeros((), dtype=tl.int32) + CAND_BLOCK
        while start < n_cand:  # a loop bound loaded from memory: a while (the interpreter)
            i = start + tl.arange(0, CAND_BLOCK)
            live = i < n_cand
            counts += _piece_hist(tl.load(stretch + i, mask=live, other=0), live, prefix, PASS)
            start += CAND_BLOCK
        _add_hist(hist_ptr, row, n_rows, counts, PASS)


@triton.jit(do_not_specialize=[*_PER_CALL, "n_chunks"])
def _count_kernel(
    hist_ptr, served_ptr, split_ptr, cand_ptr, counts_ptr, n_rows, k, n_chunks,
    BLOCK: tl.constexpr, CAND_BLOCK: tl.constexpr, PDL: tl.constexpr, FALLBACK: tl.constexpr,
):  # fmt: skip
    """Per block: entries above the k-th key T (those above the top byte, and candidates
    above T), and entries equal to it (candidates only)."""
    pdl_prologue(PDL)
    row, chunk = tl.program_id(0), tl.program_id(1)
    if _unserved(served_ptr, row, FALLBACK):
        # Loads first: the histograms, the counts and the first piece, then the replay.
        hists = _hist_rows(hist_ptr, row, n_rows, 4)
        base = row * n_chunks + chunk
        n_cand = tl.load(split_ptr + 2 * base + 1)
        n_top = tl.load(split_ptr + 2 * base)
        stretch = cand_ptr + base.to(tl.int64) * BLOCK
        i = tl.arange(0, CAND_BLOCK)
        first = tl.load(stretch + i, mask=i < n_cand, other=0)
        threshold, _want = _replay_rows(hists, k, 4)
        above, equal = _piece_counts(first, i < n_cand, threshold)
        start = tl.zeros((), dtype=tl.int32) + CAND_BLOCK
        while start < n_cand:
            i = start + tl.arange(0, CAND_BLOCK)
            live = i < n_cand
            piece_above, piece_equal = _piece_counts(
                tl.load(stretch + i, mask=live, other=0), live, threshold
            )
            above += piece_above
            equal += piece_equal
            start += CAND_BLOCK
        n_above = n_top + tl.sum(above, 0)
        tl.store(counts_ptr + 2 * base, n_above)
        tl.store(counts_ptr + 2 * base + 1, tl.sum(equal, 0))


@triton.jit(do_not_specialize=[*_PER_CALL, "n_chunks"])
def _collect_kernel(
    scores_ptr, query_pos_ptr, hist_ptr, served_ptr, counts_ptr, out_ptr, kth_ptr,
    thresholds_ptr, rows_ptr, scores_stride, out_stride, n_cols, n_rows, k, topk, n_chunks,
    BLOCK: tl.constexpr, MAX_CHUNKS: tl.constexpr, PDL: tl.constexpr,
    FALLBACK: tl.constexpr,
):  # fmt: skip
    """Write this block's picks (keys > T, and the first ``want`` keys == T of the row in
    position order) after the picks of the blocks before it. FALLBACK: the first block of
    a row it serves also writes the k-th score, which is the row's next pivot."""
    pdl_prologue(PDL)
    row, chunk = tl.program_id(0), tl.program_id(1)
    if _unserved(served_ptr, row, FALLBACK):  # a served row's programs read nothing
        # Loads first: the histograms, the counts before and the scores, then the replay.
        hists = _hist_rows(hist_ptr, row, n_rows, 4)
        c = tl.arange(0, MAX_CHUNKS)
        earlier = c < chunk
        base = (row * n_chunks + c) * 2
        above_each = tl.load(counts_ptr + base, mask=earlier, other=0)
        equal_each = tl.load(counts_ptr + base + 1, mask=earlier, other=0)
        cols, inside, s = _row_scores(
            scores_ptr, query_pos_ptr, row, chunk, scores_stride, n_cols, BLOCK
        )
        above_before, equal_before = tl.sum(above_each, 0), tl.sum(equal_each, 0)
        threshold, want = _replay_rows(hists, k, 4)
        if FALLBACK:  # noqa: SIM102 (a constexpr branch: compiled only with the fallback)
            if chunk == 0:
                kth = tl.where(k == topk, _key32_score(threshold), float("-inf"))
                tl.store(kth_ptr + row, kth)
                # The row's next pivot (its step stays what the pivot's compact left).
                tl.store(thresholds_ptr + 2 * tl.load(rows_ptr + row), kth)
        key = _order_key32(s)
        above = inside & (key > threshold)
        equal = inside & (key == threshold)
        # One scan for both running counts (a block holds < 65536 keys): equal in the high
        # half, above in the low. Through entry i the row has taken every entry above T
        # and min(equal so far, want) of those equal to it.
        packed = tl.cumsum(above.to(tl.int32) + equal.to(tl.int32) * 65536, 0)
        above_through = above_before + (packed & 65535)
        equal_through = equal_before + (packed >> 16)
        pick = above | (equal & (equal_through <= want))
        slot = above_through + tl.minimum(equal_through, want) - 1
        value = tl.where(s == float("-inf"), -1, cols.to(tl.int64))
        tl.store(out_ptr + row * out_stride + slot, value, mask=pick)


def topk_positions(
    scores: torch.Tensor,
    query_pos: torch.Tensor,
    topk: int,
    block: int = DEFAULT_BLOCK,
    pdl: bool = False,
    num_warps: int = DEFAULT_NUM_WARPS,
    cand_block: int = DEFAULT_CAND_BLOCK,
) -> torch.Tensor:
    """scores [R, L] fp32 (column = key position), query_pos [R] -> positions [R, topk]
    (ascending; -1 for masked or missing). Same set as ``select_topk``. ``block``: keys
    per program. ``pdl``: chain the six launches
    (kernels/pdl.py; off by default: on an H200 it saved a little at 48 rows and cost more
    at one, indexer.json's ``topk_unchained`` beside ``topk``). Block, warps, ``cand_block`` and
    chaining change speed only: the output is the same tensor for every launch shape."""
    if scores.dim() != 2 or scores.dtype != torch.float32:
        raise ValueError("scores must be a float32 [rows, keys] tensor")
    rows, n_cols = scores.shape
    k = min(topk, n_cols)
    out = torch.full((rows, topk), -1, dtype=torch.int64, device=scores.device)
    if rows == 0 or n_cols == 0:
        return out
    radix_select(
        scores.contiguous(), query_pos, out, k, block, pdl, num_warps, cand_block=cand_block
    )  # fmt: skip
    return out


def radix_select(
    scores: torch.Tensor,
    query_pos: torch.Tensor,
    out: torch.Tensor,
    k: int,
    block: int = DEFAULT_BLOCK,
    pdl: bool = False,
    num_warps: int = DEFAULT_NUM_WARPS,
    fallback: tuple[torch.Tensor, ...] | None = None,
    cand_block: int = DEFAULT_CAND_BLOCK,
) -> None:
    """The six launches, writing picks into ``out`` [R, >= k] (pre-filled with -1).
    ``fallback`` (research/topk_pivot/kernel.py): (served [R], kth [R], thresholds, rows, topk):
    rows with served >= 0 are skipped, the others also get their k-th score written.
    ``cand_block``: candidates a piece of the candidate passes reads (speed only)."""
    rows, n_cols = scores.shape
    qpos = query_pos.to(torch.int64).contiguous()
    # The interpreter (CPU tests) compiles nothing and runs faster on blocks no wider than
    # a row.
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    if interpreting:
        block = min(block, max(16, triton.next_power_of_2(n_cols)))
    cand_block = min(cand_block, block)
    n_chunks = triton.cdiv(n_cols, block)
    dev = scores.device
    hist = torch.zeros(4, rows, 256, dtype=torch.int32, device=dev)
    split = torch.empty(rows, n_chunks, 2, dtype=torch.int32, device=dev)
    counts = torch.empty(rows, n_chunks, 2, dtype=torch.int32, device=dev)
    # Each block's candidates (keys at the chosen top byte) in its own stretch.
    cand = torch.empty(rows, n_chunks * block, dtype=torch.int32, device=dev)
    grid = (rows, n_chunks)
    if fallback is None:
        served, kth, thresholds, row_ix, topk = scores, scores, scores, qpos, k
    else:
        served, kth, thresholds, row_ix, topk = fallback
    chained = use_pdl(dev, pdl)
    launch = dict(
        BLOCK=block, PDL=chained, launch_pdl=chained, num_warps=num_warps,
        FALLBACK=fallback is not None,
    )  # fmt: skip
    stride = scores.stride(0)
    _hist_kernel[grid](scores, qpos, hist, served, stride, n_cols, rows, **launch)
    _split_kernel[grid](
        scores, qpos, hist, served, split, cand, stride, n_cols, rows, k, n_chunks, **launch
    )
    for p in (2, 3):
        _cand_hist_kernel[grid](
            hist, served, split, cand, rows, k, n_chunks, PASS=p, CAND_BLOCK=cand_block, **launch
        )
    _count_kernel[grid](
        hist, served, split, cand, counts, rows, k, n_chunks, CAND_BLOCK=cand_block, **launch
    )
    _collect_kernel[grid](
        scores, qpos, hist, served, counts, out, kth, thresholds, row_ix, stride,
        out.stride(0), n_cols, rows, k, topk, n_chunks,
        MAX_CHUNKS=max(
            MIN_MAX_CHUNKS if interpreting else MIN_MAX_KEYS // block,
            triton.next_power_of_2(n_chunks),
        ),
        **launch,
    )  # fmt: skip


# --------------------------------------------------------------------------- reference
# The plain-torch selection lives here, beside the kernel it defines: the model imports it
# from kernels/ (its CPU path), and kernels/ never imports the model.
def select_topk(
    scores: torch.Tensor,
    query_pos: torch.Tensor,
    topk: int,
    return_kth: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k over key positions <= each query's position; ties to the lower position.

    scores [G, Q, L] (key position = column), query_pos [G, Q] -> positions [G, Q, topk],
    -1 where a query has fewer than ``topk`` visible keys. With ``return_kth`` also the
    k-th largest visible score [G, Q] (-inf with fewer than ``topk`` visible keys), which
    decode prefetch's threshold predictor learns from. A stable descending sort: the CPU
    path's selection (CUDA runs the radix select through ``model.indexer.exact_topk``).
    """
    length = scores.shape[-1]
    key_pos = torch.arange(length, device=scores.device)
    masked = scores.masked_fill(key_pos > query_pos.unsqueeze(-1), float("-inf"))
    k = min(topk, length)
    # Ties (e.g. keys whose every head logit is clipped to 0 by relu) go to the lowest
    # position, so the selection never depends on padding or batch composition.
    values, idx = torch.sort(masked, dim=-1, descending=True, stable=True)
    values, idx = values[..., :k], idx[..., :k]
    idx = torch.where(values == float("-inf"), torch.full_like(idx, -1), idx)
    if k < topk:
        idx = F.pad(idx, (0, topk - k), value=-1)
    if not return_kth:
        return idx
    if k == topk:
        return idx, values[..., k - 1]
    return idx, values.new_full(values.shape[:-1], float("-inf"))  # rows narrower than top-k


def topk_positions_reference(
    scores: torch.Tensor, query_pos: torch.Tensor, topk: int
) -> torch.Tensor:
    """The reference set (``select_topk``), sorted ascending with -1 last."""
    pos = select_topk(scores.unsqueeze(1), query_pos.view(-1, 1), topk).squeeze(1)
    ordered = torch.where(pos < 0, torch.full_like(pos, 1 << 62), pos).sort(dim=-1).values
    return torch.where(ordered == 1 << 62, -1, ordered)
