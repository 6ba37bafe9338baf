"""An arriving prompt's device rows, written only where its reservation placed them; the
Triton kernel, its launcher and the torch reference.

Why: a decode node reserves a transferring prompt's device slots while the free stacks
last and never evicts for it (offload/manager.py ``reserve_prompt``), so under memory
pressure most of a 100K-token prompt's lanes get the scratch slot. Written with one
``index_copy_`` over every lane, the transfer first made all the prompt's rows from the
bank and then wrote each of them, the unplaced ones all into the one scratch row: per
layer, three passes over the prompt's rows in HBM and, per unplaced lane, one more write
to that same row, on the SMs beside the decode steps, for rows nothing reads. Here each
lane reads its slot and copies its row from the source (a window into the bank, or plain
rows) only when placed: an unplaced lane costs one 8-byte read. Fixed shapes and no host
synchronisation, so the writer thread never waits for the decode stream.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_echo.kernels.decode_write import as_words

PLACED_LANES = 32  # rows per program
PLACED_WARPS = 4


# Lengths, offsets and the slots' row (a row of a [layers, n] tensor, so its alignment follows
# n) change with every prompt: specializing on them compiled a variant per arrival shape
# while serving. The rows' pointers keep theirs (their loads and stores are vectorized).
@triton.jit(
    do_not_specialize=("n", "scratch", "period", "offset"),
    do_not_specialize_on_alignment=("slots",),
)
def _placed_rows_kernel(
    src, slots, n, dst, scratch, period, offset, src_stride, dst_stride,
    WORDS: tl.constexpr, WORD_BLOCK: tl.constexpr, LANES: tl.constexpr,
):  # fmt: skip
    lanes = tl.program_id(0) * LANES + tl.arange(0, LANES)
    in_range = lanes < n
    slot = tl.load(slots + lanes, mask=in_range, other=scratch)
    placed = in_range & (slot != scratch)
    src_row = (lanes.to(tl.int64) + offset) % period
    for w0 in range(0, WORDS, WORD_BLOCK):
        words = w0 + tl.arange(0, WORD_BLOCK)
        mask = placed[:, None] & (words[None, :] < WORDS)
        vals = tl.load(src + src_row[:, None] * src_stride + words[None, :], mask=mask)
        tl.store(dst + slot[:, None] * dst_stride + words[None, :], vals, mask=mask)


def _check(
    dst: torch.Tensor, slots: torch.Tensor, src: torch.Tensor, period: int | None
) -> tuple[int, int]:
    """(lanes, period: the source's rows by default), after the shapes the write needs (a
    clear error, not a bad write)."""
    period = int(src.shape[0]) if period is None else period
    if slots.dim() != 1:
        raise ValueError(f"expected slots [n], got {tuple(slots.shape)}")
    if dst.dim() != 2 or src.dim() != 2 or src.shape[1] != dst.shape[1] or src.dtype != dst.dtype:
        raise ValueError(
            f"rows {tuple(src.shape)} {src.dtype} do not fit device rows "
            f"{tuple(dst.shape)} {dst.dtype}"
        )
    if slots.numel() and not 1 <= period <= src.shape[0]:
        raise ValueError(f"a period of {period} over {src.shape[0]} source rows")
    return int(slots.numel()), period


def write_placed_rows_kernel(
    dst: torch.Tensor,
    slots: torch.Tensor,
    src: torch.Tensor,
    scratch: int,
    period: int | None = None,
    offset: int = 0,
) -> None:
    """Lane p's row, ``src[(p + offset) % period]`` (a window into a bank; by default
    ``src[p]``), into ``dst[slots[p]]`` for every lane whose slot is not ``scratch``; the
    others are left alone. On the current stream."""
    n, period = _check(dst, slots, src, period)
    if n == 0:
        return
    src_w, dst_w = as_words(src.contiguous()), as_words(dst)
    if src_w.dtype != dst_w.dtype:  # strides tile differently: bytes on both sides
        src_w, dst_w = src.contiguous().view(torch.uint8), dst.view(torch.uint8)
    words = src_w.shape[1]
    _placed_rows_kernel[(triton.cdiv(n, PLACED_LANES),)](
        src_w, slots.to(torch.int64).contiguous(), n, dst_w, scratch, period, offset,
        src_w.stride(0), dst_w.stride(0), WORDS=words,
        WORD_BLOCK=min(128, triton.next_power_of_2(words)), LANES=PLACED_LANES,
        num_warps=PLACED_WARPS,
    )  # fmt: skip


def write_placed_rows_reference(
    dst: torch.Tensor,
    slots: torch.Tensor,
    src: torch.Tensor,
    scratch: int,
    period: int | None = None,
    offset: int = 0,
) -> None:
    """Plain torch of :func:`write_placed_rows_kernel` (its lane selection waits for the
    device: the CPU path's)."""
    n, period = _check(dst, slots, src, period)
    if n == 0:
        return
    placed = torch.nonzero(slots != scratch).reshape(-1)
    if placed.numel() == 0:
        return
    at = (placed.to(src.device) + offset) % period
    dst.index_copy_(0, slots[placed].to(torch.int64), src.index_select(0, at))
