"""Decode top-k positions -> host ids -> device rows: the two ends of the SGLang plugin's
per-layer resolve (sglang/topk_resolve.py), one launch each, around EchoManager.resolve.

In torch these are two dozen small ops per layer-step (gathers, comparisons, wheres, a copy),
each its own launch inside sglang's decode graph, 61 times per step; here they are two.

``host_ids``: for row i (request i of the batch) and lane j, with p = topk[i, j]:

Each request owns one page of ``RING`` (64) device rows, its *ring* (``ring_rows[req]``,
the page's rows in order; all 0 = no ECHO state): the token at position p, decoded since
the request entered decode, is written (every layer) to row ``ring_rows[req, p % RING]``
and stays there until token p + RING overwrites it. So the ring
holds the request's newest decoded tokens, positions ``ring_lo = max(ring_start[req],
seq_len - RING)`` to ``seq_len - 1`` (the current token included), in every layer, on
the device: a selection of one of them is a row of the ring, not a host id to resolve
(the previous token, which nearly every step selects, would otherwise miss in every
layer, being on the host only).

``host_ids``: for row i (request i of the batch) and lane j, with p = topk[i, j]:

- the host id ``req_to_host[req[i], p]`` when the lane selects an earlier token: the row
  is real (i < num_real), its request holds ECHO state (ring_rows[req[i], 0] > 0), and
  0 <= p < ring_lo;
- -1 otherwise: padding lanes, positions past the sequence, ring positions, rows past
  ``num_real`` (CUDA-graph padding) and requests without ECHO state.

``rows``: the static table FlashMLA reads: ``row_base + slot`` where the resolve gave a
slot, ``ring_rows[req, p % RING]`` for ring positions, -1 elsewhere, and -1 on every row at and
past ``n`` (sglang pads the top-k to the number of q rows, which can exceed the
requests).

Fixed shapes, counts on the device: capturable in a CUDA graph. Each kernel has its torch
reference below; ``tests/test_kernel_topk_rows.py`` holds them equal.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # lanes per program (top-k 2048: two programs per row)
RING = 64  # rows of a request's ring: its newest-token page (DSA's page size)


@triton.jit
def _selection(
    row, lane, width, topk_ptr, topk_stride, req_ptr, seq_ptr, ring_ptr, ring_start_ptr,
    num_real_ptr, RING: tl.constexpr,
):  # fmt: skip
    """(position, request, selected, in_ring) of row ``row``'s lanes."""
    in_row = lane < width
    pos = tl.load(topk_ptr + row * topk_stride + lane, mask=in_row, other=-1).to(tl.int64)
    req = tl.load(req_ptr + row).to(tl.int64)
    seq = tl.load(seq_ptr + row).to(tl.int64)
    has_state = tl.load(ring_ptr + req * RING).to(tl.int64) > 0
    ring_lo = tl.maximum(tl.load(ring_start_ptr + req).to(tl.int64), seq - RING)
    live = (row < tl.load(num_real_ptr)) & has_state
    selected = in_row & live & (pos >= 0) & (pos < seq)
    return pos, req, selected, selected & (pos >= ring_lo)


@triton.jit
def _host_ids_kernel(
    topk_ptr, topk_stride, req_ptr, seq_ptr, ring_ptr, ring_start_ptr, num_real_ptr, r2h_ptr,
    r2h_stride, r2h_cols, ids_ptr, width, BLOCK: tl.constexpr, RING: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    lane = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    pos, req, selected, in_ring = _selection(
        row, lane, width, topk_ptr, topk_stride, req_ptr, seq_ptr, ring_ptr, ring_start_ptr,
        num_real_ptr, RING,
    )  # fmt: skip
    earlier = selected & ~in_ring
    col = tl.minimum(tl.maximum(pos, 0), r2h_cols - 1)
    host = tl.load(r2h_ptr + req * r2h_stride + col, mask=earlier, other=-1)
    tl.store(ids_ptr + row * width + lane, tl.where(earlier, host, -1), mask=lane < width)


@triton.jit
def _rows_kernel(
    slots_ptr, topk_ptr, topk_stride, req_ptr, seq_ptr, ring_ptr, ring_start_ptr, num_real_ptr,
    out_ptr, out_stride, width, n, row_base, BLOCK: tl.constexpr, RING: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    lane = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = lane < width
    if row < n:
        pos, req, _selected, in_ring = _selection(
            row, lane, width, topk_ptr, topk_stride, req_ptr, seq_ptr, ring_ptr,
            ring_start_ptr, num_real_ptr, RING,
        )  # fmt: skip
        slot = tl.load(slots_ptr + row * width + lane, mask=in_row, other=-1)
        rows = tl.where(slot >= 0, slot + row_base, -1)
        ring_row = tl.load(ring_ptr + req * RING + pos % RING, mask=in_ring, other=-1)
        rows = tl.where(in_ring, ring_row.to(tl.int64), rows)
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
    ring_rows: torch.Tensor,
    ring_start: torch.Tensor,
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
        topk, topk.stride(0), req_pool_indices, seq_lens, ring_rows, ring_start, num_real,
        req_to_host, req_to_host.stride(0), req_to_host.shape[1], ids, width, BLOCK=BLOCK,
        RING=RING,
    )  # fmt: skip
    return ids


def rows(
    slots: torch.Tensor | None,
    topk: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    ring_rows: torch.Tensor,
    ring_start: torch.Tensor,
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
        slots, topk, topk.stride(0), req_pool_indices, seq_lens, ring_rows, ring_start, num_real,
        out, out.stride(0), width, n, row_base, BLOCK=BLOCK, RING=RING,
    )  # fmt: skip


# ---------------------------------------------------------------------------- reference
def _selection_reference(topk, req_pool_indices, seq_lens, ring_rows, ring_start, num_real):
    n = req_pool_indices.shape[0]
    positions = topk[:n].to(torch.int64)
    req = req_pool_indices.to(torch.int64)
    seq = seq_lens[:n].to(torch.int64).unsqueeze(1)
    ring = ring_rows[req].to(torch.int64)  # [n, RING]
    ring_lo = torch.maximum(ring_start[req].to(torch.int64).unsqueeze(1), seq - RING)
    real = torch.arange(n, device=topk.device) < num_real.to(topk.device)
    live = (real & (ring[:, 0] > 0)).unsqueeze(1)
    selected = live & (positions >= 0) & (positions < seq)
    return positions, ring, selected, selected & (positions >= ring_lo)


def host_ids_reference(
    topk: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    ring_rows: torch.Tensor,
    ring_start: torch.Tensor,
    req_to_host: torch.Tensor,
    num_real: torch.Tensor,
) -> torch.Tensor:
    """Plain torch of :func:`host_ids` (fixed shapes, no host synchronisation)."""
    positions, _ring, selected, in_ring = _selection_reference(
        topk, req_pool_indices, seq_lens, ring_rows, ring_start, num_real
    )
    req = req_pool_indices.to(torch.int64)
    col = positions.clamp(min=0, max=req_to_host.shape[1] - 1)
    host = req_to_host[req.unsqueeze(1), col].to(torch.int64)
    return torch.where(selected & ~in_ring, host, torch.full_like(host, -1))


def rows_reference(
    slots: torch.Tensor | None,
    topk: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    ring_rows: torch.Tensor,
    ring_start: torch.Tensor,
    num_real: torch.Tensor,
    row_base: int,
    out: torch.Tensor,
) -> None:
    """Plain torch of :func:`rows`."""
    n = req_pool_indices.shape[0]
    out[n:].fill_(-1)
    if n == 0:
        return
    positions, ring, _s, in_ring = _selection_reference(
        topk, req_pool_indices, seq_lens, ring_rows, ring_start, num_real
    )
    table = torch.where(slots >= 0, slots + row_base, torch.full_like(slots, -1))
    ring_row = ring.gather(1, positions.remainder(RING))
    table = torch.where(in_ring, ring_row, table)
    out[:n].copy_(table)
