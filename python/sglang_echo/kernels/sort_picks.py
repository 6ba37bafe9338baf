"""A peer top-k's picks in our form: ascending positions, -1 last, masked picks dropped.

Why a kernel: FlashInfer's top-k (kernels/topk_flashinfer.py) returns its picks in its own
order, and serving needs the radix select's very tensor. Done in torch (a gather, a mask
and ``torch.sort`` over [R, k] int64) the finish cost nearly as much at one row as at
48 x 2048 on the H200 (that run: docs/ARCHITECTURE.md section 15, "Measured choices").
One program per row sorts its k picks in registers (``tl.sort``, a bitonic network over a
power-of-two block): faster than torch's, and the same at 48 rows and at one
(benchmark/results/topk_peers.json, ``serving_adapter.finish_us``), so the network's
latency in one program, not the rows, sets its cost.

``sort_picks_reference`` is the plain-torch definition the kernel is tested against.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# sorts after every position (positions are int32); constexpr so the kernel may read it
_NOT_PICKED = tl.constexpr(2**31 - 1)
_PER_CALL = ["k", "scores_stride", "picks_stride"]


@triton.jit(do_not_specialize=_PER_CALL)
def _sort_picks_kernel(
    scores_ptr, picks_ptr, out_ptr, k, scores_stride, picks_stride,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One row: a pick is kept where it is >= 0 and its score is not -inf; kept picks come
    out ascending, then -1 for every other slot."""
    row = tl.program_id(0)
    lane = tl.arange(0, BLOCK_K)
    inside = lane < k
    pick = tl.load(picks_ptr + row * picks_stride + lane, mask=inside, other=-1).to(tl.int32)
    valid = pick >= 0
    score = tl.load(
        scores_ptr + row * scores_stride + tl.where(valid, pick, 0), mask=inside & valid,
        other=float("-inf"),
    )  # fmt: skip
    key = tl.where(valid & (score != float("-inf")), pick, _NOT_PICKED)
    ordered = tl.sort(key)
    value = tl.where(ordered == _NOT_PICKED, -1, ordered).to(tl.int64)
    tl.store(out_ptr + row * k + lane, value, mask=inside)


def sort_picks(scores: torch.Tensor, picks: torch.Tensor) -> torch.Tensor:
    """scores [R, L] fp32, picks [R, k] int32/int64 in any order (-1 = none) -> [R, k]
    int64: the kept picks ascending, -1 last (``sort_picks_reference``'s tensor)."""
    if scores.dim() != 2 or picks.dim() != 2 or picks.shape[0] != scores.shape[0]:
        raise ValueError("scores must be [rows, keys] and picks [rows, k] with the same rows")
    rows, k = picks.shape
    out = torch.empty(rows, k, dtype=torch.int64, device=picks.device)
    if rows == 0 or k == 0:
        return out
    if scores.stride(1) != 1 or picks.stride(1) != 1:
        scores, picks = scores.contiguous(), picks.contiguous()
    block = triton.next_power_of_2(k)
    warps = 4 if block <= 2048 else 8
    _sort_picks_kernel[(rows,)](
        scores, picks, out, k, scores.stride(0), picks.stride(0), BLOCK_K=block,
        num_warps=warps,
    )  # fmt: skip
    return out


# --------------------------------------------------------------------------- reference
def sort_picks_reference(scores: torch.Tensor, picks: torch.Tensor) -> torch.Tensor:
    """The definition: a pick is kept where it is >= 0 and its score is not -inf (the radix
    select never returns a masked key's position); kept picks ascending, -1 last."""
    picks = picks.to(torch.int64)
    picked = torch.gather(scores, 1, picks.clamp(min=0))
    kept = (picks >= 0) & (picked != float("-inf"))
    never = _NOT_PICKED.value
    ordered = torch.where(kept, picks, never).sort(dim=1).values
    return torch.where(ordered == never, -1, ordered)
