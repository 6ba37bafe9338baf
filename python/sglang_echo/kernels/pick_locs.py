"""The top-k's picked positions as token locations, in one launch.

Why a kernel: the torch form (a clamp, an expanded gather, a compare, a fill and a where)
is five launches on every layer's selection. On an H200 at batch 16 x 128K they were a
visible part of a decode layer-step alone, and longer beside the decode prefetch's copies,
whose traffic slows each small launch (the profile: docs/ARCHITECTURE.md section 15,
"Measured choices"). One program per
(row, block of picks) reads each position once and gathers its location.

``pick_locs_reference`` is the plain-torch definition the kernel is tested against.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # picks per program: a top-k of 2048 in two programs a row
_PER_CALL = ["picks", "queries", "pos_stride", "locs_stride"]


# ``locs_ptr`` is a row of the request table's context view, 16-byte aligned or not by the
# row's offset (odd rows of an odd width are not): its loads are per-lane gathers, so its
# alignment gains nothing, and specializing on it compiled a second kernel at the first
# prefill chunk of several requests.
@triton.jit(do_not_specialize=_PER_CALL, do_not_specialize_on_alignment=("locs_ptr",))
def _pick_locs_kernel(
    pos_ptr, locs_ptr, out_ptr, picks, queries, pos_stride, locs_stride,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """Row ``r`` (query ``r % queries`` of group ``r // queries``): out = locs[group, pos]
    where pos >= 0, else -1."""
    row = tl.program_id(0)
    lane = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = lane < picks
    pos = tl.load(pos_ptr + row.to(tl.int64) * pos_stride + lane, mask=inside, other=-1)
    picked = inside & (pos >= 0)
    group = (row // queries).to(tl.int64)
    loc = tl.load(locs_ptr + group * locs_stride + pos, mask=picked, other=-1)
    tl.store(out_ptr + row.to(tl.int64) * picks + lane, loc.to(tl.int64), mask=inside)


def pick_locs(positions: torch.Tensor, context_locs: torch.Tensor) -> torch.Tensor:
    """positions [G, Q, K] (-1 none, each < L), context_locs [G, L] -> int64 [G, Q, K]
    token locations, -1 kept (``pick_locs_reference``'s tensor)."""
    if positions.dim() != 3 or context_locs.dim() != 2:
        raise ValueError("positions must be [groups, queries, picks] and context_locs [groups, L]")
    if positions.shape[0] != context_locs.shape[0]:
        raise ValueError(
            f"positions has {positions.shape[0]} groups, context_locs {context_locs.shape[0]}"
        )
    groups, queries, picks = positions.shape
    out = torch.empty(groups, queries, picks, dtype=torch.int64, device=positions.device)
    if out.numel() == 0:
        return out
    pos = positions.reshape(groups * queries, picks)
    if pos.stride(1) != 1:
        pos = pos.contiguous()
    locs = context_locs if context_locs.stride(1) == 1 else context_locs.contiguous()
    _pick_locs_kernel[(groups * queries, triton.cdiv(picks, BLOCK))](
        pos, locs, out, picks, queries, pos.stride(0), locs.stride(0), BLOCK=BLOCK,
        num_warps=4,
    )  # fmt: skip
    return out


# --------------------------------------------------------------------------- reference
def pick_locs_reference(positions: torch.Tensor, context_locs: torch.Tensor) -> torch.Tensor:
    """The definition: positions [G, Q, K] (-1 none), context_locs [G, L] -> token
    locations, -1 kept."""
    gathered = torch.gather(
        context_locs.unsqueeze(1).expand(-1, positions.shape[1], -1), 2, positions.clamp(min=0)
    )
    return torch.where(positions >= 0, gathered, torch.full_like(gathered, -1))
