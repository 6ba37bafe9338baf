"""Recall: copy the rows of missed tokens from pinned host memory into their device slots.

The kernel reads host rows through their device-mapped (UVA) address, so one launch moves
every miss of a layer with no staging copy and no host synchronisation. It is driven by a
compacted miss list and a device-side count, with a grid fixed by the worst case (a fixed
shape, capturable in a CUDA graph): the kernel loops over (row, 16-byte piece) up to the
count on a few programs per SM, so a step with few misses costs little more than a
launch. Rows are copied as bytes, so bf16 rows (1152 B) and SGLang's fp8 layout (656 B) share one kernel;
with row strides that are multiples of 16 B, loads and stores are 16 B wide.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_echo.kernels.cache_layout import byte_rows, byte_vector
from sglang_echo.kernels.decode_stage import StagedRows, staged_entries
from sglang_echo.kernels.device_info import sm_count
from sglang_echo.kernels.pdl import pdl_prologue, use_pdl

# Measured on an H200 (benchmark/results/recall.json, the flat kernel's grid-stride loop;
# the evidence row "recall bandwidth"): 512 16-byte chunks per program and 4 warps are near
# the best of the record's configurations for 656 B and 1152 B rows (``best_config_*``
# beside ``default_GBps_656``); when they were chosen, 8 warps and the row-tiled variant (a
# program per block of rows, an option until issue 51) were slower at both.
DEFAULT_FLAT_CHUNKS = 512
DEFAULT_NUM_WARPS = 4
# Programs per SM of the flat kernel's grid-stride loop: enough loads in flight for the
# H2D link (the loop, not the grid, covers the misses).
PROGRAMS_PER_SM = 4


@triton.jit
def _recall_flat_kernel(
    host_ptr,
    dev_ptr,
    ids_ptr,
    slots_ptr,
    count_ptr,
    host_stride,
    dev_stride,
    stage_ptr,
    stage_map_ptr,
    stage_ids_ptr,
    stage_counts_ptr,
    stage_hits_ptr,
    stage_stride,
    stage_cap,
    stage_limit,
    stage_entries,
    ROW_BYTES: tl.constexpr,
    VEC: tl.constexpr,
    CHUNKS: tl.constexpr,
    PDL: tl.constexpr,
    STAGED: tl.constexpr,
):
    """The copy over the flat (row, VEC-byte chunk) space: no masked-off lanes for rows
    that are not a power of two wide (656 B = 41 x 16 B). A grid-stride loop up to the
    count: the grid is a few programs per SM whatever the worst case, so a step with few
    misses does not pay for launching one program per chunk of the worst case.

    ``STAGED``: a miss whose row the decode prefetch staged this layer-step
    (kernels/decode_stage.py, validity rule in ``staged_entries``) is copied from the
    staging buffer instead of the host, and counted in ``stage_hits``."""
    pdl_prologue(PDL)
    per_row: tl.constexpr = ROW_BYTES // VEC
    total = tl.load(count_ptr).to(tl.int64) * per_row
    v = tl.arange(0, VEC)
    base = tl.program_id(0).to(tl.int64) * CHUNKS
    while base < total:  # a while, not a range: the interpreter cannot range over tensors
        chunk = base + tl.arange(0, CHUNKS)
        lane = chunk // per_row
        col = (chunk % per_row) * VEC
        live = chunk < total
        ids = tl.load(ids_ptr + lane, mask=live, other=0).to(tl.int64)
        slots = tl.load(slots_ptr + lane, mask=live, other=0).to(tl.int64)
        dst = dev_ptr + (slots * dev_stride + col)[:, None] + v[None, :]
        src = host_ptr + (ids * host_stride + col)[:, None] + v[None, :]
        if STAGED:
            entry = tl.load(stage_map_ptr + ids, mask=live, other=0).to(tl.int64)
            entry = tl.minimum(tl.maximum(entry, 0), stage_entries - 1)
            count = tl.load(stage_counts_ptr + entry // stage_cap, mask=live, other=0)
            owner = tl.load(stage_ids_ptr + entry, mask=live, other=-1)
            staged = live & (owner == ids) & (entry % stage_cap < tl.minimum(count, stage_limit))
            near = stage_ptr + (entry * stage_stride + col)[:, None] + v[None, :]
            from_stage = tl.load(near, mask=staged[:, None])
            from_host = tl.load(src, mask=(live & ~staged)[:, None])
            values = tl.where(staged[:, None], from_stage, from_host)
            tl.atomic_add(stage_hits_ptr, tl.sum((staged & (col == 0)).to(tl.int64), 0))
        else:
            values = tl.load(src, mask=live[:, None])
        tl.store(dst, values, mask=live[:, None])
        base += tl.num_programs(0) * CHUNKS


def flat_programs(device: torch.device, worst_chunks: int, chunks: int) -> int:
    """The flat kernel's grid: enough programs for the worst case, at most
    ``PROGRAMS_PER_SM`` per SM (the rest is the loop's), and a few on the interpreter
    so that its loop runs more than once in tests."""
    need = max(1, triton.cdiv(worst_chunks, chunks))
    if device.type != "cuda":
        return min(need, 2)
    return min(need, PROGRAMS_PER_SM * sm_count(device.index))


def recall_rows(
    host_rows: torch.Tensor,
    dev_rows: torch.Tensor,
    miss_ids: torch.Tensor,
    miss_slots: torch.Tensor,
    miss_count: torch.Tensor,
    pdl: bool = True,
    staged: StagedRows | None = None,
) -> None:
    """dev_rows[miss_slots[i]] = host_rows[miss_ids[i]] for i < miss_count (a 1-element tensor).

    ``staged``: the decode prefetch's staging of this layer-step (kernels/decode_stage.py):
    misses staged there are copied device to device and counted in ``staged.hits``.

    ``host_rows`` must be addressable by the kernel's device: a CUDA alias of pinned memory
    on GPU (see offload.host_pool), any tensor under TRITON_INTERPRET=1. ``pdl``: chain the
    launch to the previous kernel where supported (kernels/pdl.py; the offload layer passes
    SGLANG_ECHO_PDL, on by default).
    """
    if host_rows.shape[1] != dev_rows.shape[1] or host_rows.dtype != dev_rows.dtype:
        raise ValueError("host and device rows must have the same width and dtype")
    host_b, dev_b = byte_rows(host_rows, "recall"), byte_rows(dev_rows, "recall")
    lanes = miss_ids.numel()
    if lanes == 0:
        return
    row_bytes = host_b.shape[1]
    chained = use_pdl(dev_b.device, pdl)
    launch = dict(PDL=chained, launch_pdl=chained, num_warps=DEFAULT_NUM_WARPS)
    args = (host_b, dev_b, miss_ids, miss_slots, miss_count, host_b.stride(0), dev_b.stride(0))
    vec = byte_vector(row_bytes)
    if staged is None:
        stage = (dev_b, miss_ids, miss_ids, miss_ids, miss_count, 0, 1, 1, 1)  # unread
    else:
        stage_b = byte_rows(staged.rows, "recall")
        if stage_b.shape[1] != row_bytes:
            raise ValueError("staging rows must be as wide as the cache rows")
        stage = (
            stage_b, staged.stage_map, staged.ids, staged.counts, staged.hits,
            stage_b.stride(0), staged.cap, staged.limit, staged.ids.numel(),
        )  # fmt: skip
    chunks = DEFAULT_FLAT_CHUNKS
    grid = (flat_programs(dev_b.device, lanes * (row_bytes // vec), chunks),)
    _recall_flat_kernel[grid](
        *args, *stage, ROW_BYTES=row_bytes, VEC=vec, CHUNKS=chunks,
        STAGED=staged is not None, **launch,
    )  # fmt: skip


def recall_rows_reference(
    host_rows: torch.Tensor,
    dev_rows: torch.Tensor,
    miss_ids: torch.Tensor,
    miss_slots: torch.Tensor,
    miss_count: torch.Tensor,
    staged: StagedRows | None = None,
) -> None:
    """Plain torch: the semantics the kernel must reproduce (reads the count on the host)."""
    n = int(miss_count.item())
    ids = miss_ids[:n].long()
    slots = miss_slots[:n].long()
    dev_rows[slots] = host_rows[ids.to(host_rows.device)].to(dev_rows.device)
    if staged is None:
        return
    entry = staged_entries(ids, staged)
    hit = entry >= 0
    dev_rows[slots[hit]] = staged.rows[entry[hit]].to(dev_rows.device)
    staged.hits.add_(hit.sum())
