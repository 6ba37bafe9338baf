"""Exact top-k per row by radix select, with ties going to the lowest position.

One program per row. Scores become order-preserving 32-bit keys; four passes of a 256-bin
histogram over the key's bytes (most significant first) find the k-th largest key T and
how many entries equal to T are needed; a last pass writes, in position order, every
entry above T and the lowest-positioned entries equal to T. The set is exactly that of
``model.indexer.select_topk`` (the reference); the order is ascending position instead of
descending score. Positions whose score is -inf (masked) come back as -1.

Status (benchmark/results/indexer.json, H200, 48 x 100K): exact, but 1.3 ms against
torch.topk's 0.15 ms: 48 programs cannot fill the GPU. Next: split each row's passes over
many programs (per-program histograms, then a combine), so it is not yet used by the model.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_echo.model.indexer import select_topk

DEFAULT_BLOCK = 4096


@triton.jit
def _order_key(scores):
    """float32 -> int64 in [0, 2^32) with the same order (larger score, larger key)."""
    bits = scores.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    negative = bits >= 0x80000000
    return tl.where(negative, 0xFFFFFFFF - bits, bits + 0x80000000)


@triton.jit
def _topk_kernel(
    scores_ptr,
    out_ptr,
    query_pos_ptr,
    scores_stride,
    out_stride,
    n_cols,
    k,
    MAX_COLS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    qpos = tl.load(query_pos_ptr + row)
    bins = tl.arange(0, 512)
    prefix = tl.zeros((), dtype=tl.int64)
    want = tl.zeros((), dtype=tl.int64) + k  # how many still to take at or below the prefix
    for p in tl.static_range(4):
        shift = 24 - 8 * p
        hist = tl.zeros((512,), dtype=tl.int32)
        for start in range(0, MAX_COLS, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            s = tl.load(scores_ptr + row * scores_stride + cols, mask=cols < n_cols, other=0.0)
            s = tl.where(cols <= qpos, s, float("-inf"))
            key = _order_key(s)
            match = (cols < n_cols) & ((key >> (shift + 8)) == (prefix >> (shift + 8)))
            digit = tl.where(match, (key >> shift) & 255, 256)
            hist += tl.histogram(digit.to(tl.int32), 512)
        hist = tl.where(bins < 256, hist, 0).to(tl.int64)
        at_or_above = tl.sum(hist) - tl.cumsum(hist, 0) + hist  # count of digits >= bin
        chosen = tl.sum(((at_or_above >= want) & (bins < 256)).to(tl.int64)) - 1
        above = tl.sum(tl.where(bins == chosen, at_or_above - hist, 0))
        want = want - above
        prefix = prefix | (chosen << shift)
    # prefix is the k-th largest key T; take every key > T and the first `want` keys == T.
    taken = tl.zeros((), dtype=tl.int64)
    equal_seen = tl.zeros((), dtype=tl.int64)
    for start in range(0, MAX_COLS, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < n_cols
        s = tl.load(scores_ptr + row * scores_stride + cols, mask=inside, other=0.0)
        s = tl.where(cols <= qpos, s, float("-inf"))
        key = _order_key(s)
        equal = inside & (key == prefix)
        equal_rank = equal_seen + tl.cumsum(equal.to(tl.int64), 0) - 1
        pick = inside & ((key > prefix) | (equal & (equal_rank < want)))
        slot = taken + tl.cumsum(pick.to(tl.int64), 0) - 1
        value = tl.where(s == float("-inf"), -1, cols.to(tl.int64))
        tl.store(out_ptr + row * out_stride + slot, value, mask=pick)
        taken += tl.sum(pick.to(tl.int64))
        equal_seen += tl.sum(equal.to(tl.int64))


def topk_positions(
    scores: torch.Tensor, query_pos: torch.Tensor, topk: int, block: int = DEFAULT_BLOCK
) -> torch.Tensor:
    """scores [R, L] fp32 (column = key position), query_pos [R] -> positions [R, topk]
    (ascending; -1 for masked or missing). Same set as ``select_topk``."""
    if scores.dim() != 2 or scores.dtype != torch.float32:
        raise ValueError("scores must be a float32 [rows, keys] tensor")
    rows, n_cols = scores.shape
    k = min(topk, n_cols)
    # Compiled per power-of-two width, so a decode context that grows each step
    # does not recompile every step.
    max_cols = triton.next_power_of_2(n_cols)
    out = torch.full((rows, topk), -1, dtype=torch.int64, device=scores.device)
    scores = scores.contiguous()
    _topk_kernel[(rows,)](
        scores,
        out,
        query_pos.to(torch.int64).contiguous(),
        scores.stride(0),
        out.stride(0),
        n_cols,
        k,
        MAX_COLS=max_cols,
        BLOCK=min(block, max_cols),
    )
    return out


def topk_positions_reference(
    scores: torch.Tensor, query_pos: torch.Tensor, topk: int
) -> torch.Tensor:
    """The reference set (model.indexer.select_topk), sorted ascending with -1 last."""
    pos = select_topk(scores.unsqueeze(1), query_pos.view(-1, 1), topk).squeeze(1)
    ordered = torch.where(pos < 0, torch.full_like(pos, 1 << 62), pos).sort(dim=-1).values
    return torch.where(ordered == 1 << 62, -1, ordered)
