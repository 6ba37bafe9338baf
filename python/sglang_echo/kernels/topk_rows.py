"""Decode top-k positions -> host ids -> device rows: the two ends of the SGLang plugin's
per-layer resolve (sglang/topk_resolve.py), one launch each, around EchoManager.resolve.

In torch these are two dozen small ops per layer-step (gathers, comparisons, wheres, a copy),
each its own launch inside sglang's decode graph, 61 times per step; here they are two.

``host_ids``: for row i (request i of the batch) and lane j, with p = topk[i, j]:

- the host id ``req_to_host[req[i], p]`` when the lane selects an earlier token: the row
  is real (i < num_real), its request holds ECHO state (newest_row[req[i]] > 0), and
  0 <= p < seq_len[i] - 1;
- -1 otherwise: padding lanes, positions past the sequence, the current token (p =
  seq_len[i] - 1: its row is the request's newest row, not yet on the host), rows past
  ``num_real`` (CUDA-graph padding) and requests without ECHO state.

``rows``: the static table FlashMLA reads: ``row_base + slot`` where the resolve gave a
slot, the request's newest row for the current token, -1 elsewhere, and -1 on every row
at and past ``n`` (sglang pads the top-k to the number of q rows, which can exceed the
requests).

Fixed shapes, counts on the device: capturable in a CUDA graph. Each kernel has its torch
reference below; ``tests/test_kernel_topk_rows.py`` holds them equal.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # lanes per program (top-k 2048: two programs per row)


@triton.jit
def _selection(
    row, lane, width, topk_ptr, topk_stride, req_ptr, seq_ptr, newest_ptr, num_real_ptr
):  # fmt: skip
    """(position, request, newest row, selected, is_newest) of row ``row``'s lanes."""
    in_row = lane < width
    pos = tl.load(topk_ptr + row * topk_stride + lane, mask=in_row, other=-1).to(tl.int64)
    req = tl.load(req_ptr + row).to(tl.int64)
    seq = tl.load(seq_ptr + row).to(tl.int64)
    newest = tl.load(newest_ptr + req).to(tl.int64)
    live = (row < tl.load(num_real_ptr)) & (newest > 0)
    selected = in_row & live & (pos >= 0) & (pos < seq)
    return pos, req, newest, selected, selected & (pos == seq - 1)


@triton.jit
def _host_ids_kernel(
    topk_ptr, topk_stride, req_ptr, seq_ptr, newest_ptr, num_real_ptr, r2h_ptr, r2h_stride,
    r2h_cols, ids_ptr, width, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    lane = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    pos, req, _newest, selected, is_newest = _selection(
        row, lane, width, topk_ptr, topk_stride, req_ptr, seq_ptr, newest_ptr, num_real_ptr
    )
    earlier = selected & ~is_newest
    col = tl.minimum(tl.maximum(pos, 0), r2h_cols - 1)
    host = tl.load(r2h_ptr + req * r2h_stride + col, mask=earlier, other=-1)
    tl.store(ids_ptr + row * width + lane, tl.where(earlier, host, -1), mask=lane < width)


@triton.jit
def _rows_kernel(
    slots_ptr, topk_ptr, topk_stride, req_ptr, seq_ptr, newest_ptr, num_real_ptr, out_ptr,
    out_stride, width, n, row_base, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    lane = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = lane < width
    if row < n:
        _pos, _req, newest, _selected, is_newest = _selection(
            row, lane, width, topk_ptr, topk_stride, req_ptr, seq_ptr, newest_ptr,
            num_real_ptr,
        )  # fmt: skip
        slot = tl.load(slots_ptr + row * width + lane, mask=in_row, other=-1)
        rows = tl.where(slot >= 0, slot + row_base, -1)
        rows = tl.where(is_newest, newest, rows)
    else:  # past the requests: selects nothing
        rows = tl.full([BLOCK], -1, dtype=tl.int64)
    tl.store(out_ptr + row * out_stride + lane, rows.to(out_ptr.dtype.element_ty), mask=in_row)


# ---------------------------------------------------------------------------- launchers
def _grid(rows: int, width: int) -> tuple[int, int]:
    return (rows, triton.cdiv(width, BLOCK))


def host_ids(
    topk: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    newest_row: torch.Tensor,
    req_to_host: torch.Tensor,
    num_real: torch.Tensor,
) -> torch.Tensor:
    """Host ids [n, width] int64 of rows 0..n-1 of ``topk`` (n = req_pool_indices' length;
    see the module docstring). One launch."""
    n, width = req_pool_indices.shape[0], topk.shape[1]
    ids = torch.empty(n, width, dtype=torch.int64, device=topk.device)
    if n == 0 or width == 0:
        return ids
    _host_ids_kernel[_grid(n, width)](
        topk, topk.stride(0), req_pool_indices, seq_lens, newest_row, num_real, req_to_host,
        req_to_host.stride(0), req_to_host.shape[1], ids, width, BLOCK=BLOCK,
    )  # fmt: skip
    return ids


def rows(
    slots: torch.Tensor | None,
    topk: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    newest_row: torch.Tensor,
    num_real: torch.Tensor,
    row_base: int,
    out: torch.Tensor,
) -> None:
    """out[i, j] for every row of ``out`` (see the module docstring); ``slots`` [n, width]
    from the resolve of :func:`host_ids`' ids, n = req_pool_indices' length (None when
    n = 0). One launch."""
    total, width = out.shape
    if total == 0 or width == 0:
        return
    n = req_pool_indices.shape[0]
    if slots is None:
        if n:
            raise ValueError(f"slots are needed for the batch's {n} requests")
        slots = out  # never read: every row is past the requests
    _rows_kernel[_grid(total, width)](
        slots, topk, topk.stride(0), req_pool_indices, seq_lens, newest_row, num_real, out,
        out.stride(0), width, n, row_base, BLOCK=BLOCK,
    )  # fmt: skip


# ---------------------------------------------------------------------------- reference
def _selection_reference(topk, req_pool_indices, seq_lens, newest_row, num_real):
    n = req_pool_indices.shape[0]
    positions = topk[:n].to(torch.int64)
    req = req_pool_indices.to(torch.int64)
    seq = seq_lens[:n].to(torch.int64).unsqueeze(1)
    newest = newest_row[req].to(torch.int64)
    real = torch.arange(n, device=topk.device) < num_real.to(topk.device)
    live = (real & (newest > 0)).unsqueeze(1)
    selected = live & (positions >= 0) & (positions < seq)
    return positions, req, newest, selected, selected & (positions == seq - 1)


def host_ids_reference(
    topk: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    newest_row: torch.Tensor,
    req_to_host: torch.Tensor,
    num_real: torch.Tensor,
) -> torch.Tensor:
    """Plain torch of :func:`host_ids` (fixed shapes, no host synchronisation)."""
    positions, req, _newest, selected, is_newest = _selection_reference(
        topk, req_pool_indices, seq_lens, newest_row, num_real
    )
    col = positions.clamp(min=0, max=req_to_host.shape[1] - 1)
    host = req_to_host[req.unsqueeze(1), col].to(torch.int64)
    return torch.where(selected & ~is_newest, host, torch.full_like(host, -1))


def rows_reference(
    slots: torch.Tensor | None,
    topk: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    newest_row: torch.Tensor,
    num_real: torch.Tensor,
    row_base: int,
    out: torch.Tensor,
) -> None:
    """Plain torch of :func:`rows`."""
    n = req_pool_indices.shape[0]
    out[n:].fill_(-1)
    if n == 0:
        return
    _p, _r, newest, _s, is_newest = _selection_reference(
        topk, req_pool_indices, seq_lens, newest_row, num_real
    )
    table = torch.where(slots >= 0, slots + row_base, torch.full_like(slots, -1))
    table = torch.where(is_newest, newest.unsqueeze(1).expand_as(table), table)
    out[:n].copy_(table)
