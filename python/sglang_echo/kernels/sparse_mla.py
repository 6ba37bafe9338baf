"""Sparse MLA straight from the KV buffer: softmax over each query's selected rows, no gather.

For query t and head h, over the K rows ``buffer[rows[t, k]]`` (k where rows >= 0):

    p = softmax_k(scale * q[t, h] . row_k)   (float32)
    out[t, h] = sum_k p_k * row_k[:r]        (r = kv_lora_rank, 512 in DeepSeek-V3.2)

The torch path (``sparse_mla`` at the end of this file, which model/attention.py runs on
the CPU and under SGLANG_ECHO_SPARSE_MLA=torch) first copies the selected rows into a [Q, K, r + d] tensor and then runs two
batched matmuls; this kernel reads each row from the buffer
through the index and never materializes the copy. One program serves one query and a
block of heads, so a row read once feeds BLOCK_H heads (DeepSeek-V3.2 has 128). The row
(576 = 512 + 64, not a power of two) is split into its latent and rope parts: two dots
for the scores, and the latent part alone for the output. The softmax is the streaming
(flash) form over blocks of K, in float32, in a fixed order and without atomics: a
query's output depends only on its q and on the contents and order of its selected rows,
never on where the rows live (the lossless property: ECHO's device cache and the plain
pool present the same rows from different buffers and indices and get the same bits).

A query with no selected row gets zeros. The torch path would give NaN there (softmax
of an all -inf row); the model never produces such a query (every query selects at
least its own token), so the two paths agree on every input the model can produce.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from sglang_echo.kernels.fp8_kv import FP8_TILE as FP8_TILE_VALUES
from sglang_echo.kernels.fp8_kv import dequantize_kv_rows, fp8_row_bytes
from sglang_echo.kernels.interpreter import fix_interpreter_bf16

# Defaults for DeepSeek-V3.2 sizes (H 128, r 512, d 64, bf16), from the launch
# configurations benchmark/kernels/sparse_mla_bench.py sweeps on an H200
# (benchmark/results/sparse_mla.json; the evidence rows "sparse MLA kernel" and "sparse MLA
# kernel resources (issue 15)"): 64 heads x 64 rows, 8 warps, 2 stages (within sm_90's
# shared memory, no spills). A step of the walk over a query's rows costs nearly the same
# whatever the rows in it, so 64-row blocks, half the steps of 32, are faster than 32-row
# ones at every batch of the record's sweep ("k32"), graph-replayed. Deeper pipelines of
# 32-row blocks (index loads asynchronous, rows double-buffered) gained little: the loads'
# latency is not what a step waits for (that run: docs/ARCHITECTURE.md section 15,
# "Measured choices"). Decode splits each query's rows 4 ways: of 2, 4 and 8 splits, 4 is
# the fastest at batch 48, where a step costs the most; 8 are faster at the small batches
# and 2 slower at the smallest (the record's ``decode_b*_ours_k64_split*`` beside
# ``decode_b*_ours_default_us``). The count is fixed, not chosen by batch, so a request's
# bits do not depend on how many others share its step. Prefill runs thousands of queries,
# enough programs without splits (whose float32 partials would cost about a megabyte per
# query), so it stays unsplit.
DEFAULT_BLOCK_H = 64
DEFAULT_BLOCK_K = 64
# float32 q and rows take twice the shared memory per row: 64-row blocks need more than
# sm_90 gives a block (the H200's limit), 32-row blocks fit. One rule by dtype, the same for
# offload and no-offload.
DEFAULT_BLOCK_K_FLOAT32 = 32
DEFAULT_NUM_WARPS = 8
DEFAULT_NUM_STAGES = 2
DEFAULT_SPLITS = 1
DECODE_SPLITS = 4
# The split merge's tile (heads x latent columns) and warps: small, so it never spills
# (``_combine_kernel``), and many programs, so the merge spreads over the SMs.
COMBINE_BLOCK_H = 16
COMBINE_BLOCK_C = 128
COMBINE_NUM_WARPS = 4
_DTYPES = (torch.float32, torch.bfloat16)
FP8_TILE: tl.constexpr = tl.constexpr(FP8_TILE_VALUES)


@triton.jit
def _load_rows(
    buf_ptr, idx, buf_stride, c, d, c_live, d_live, dtype,
    LAT: tl.constexpr, FP8: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_LAT: tl.constexpr,
):  # fmt: skip
    """One block of selected rows -> (latent [BLOCK_K, BLOCK_LAT], rope, live) in ``dtype``
    (fp8 rows dequantized here, in registers); rows whose index is < 0 load as zeros."""
    live = idx >= 0
    row = buf_ptr + idx.to(tl.int64) * buf_stride
    lat_mask = live[:, None] & c_live[None, :]
    pe_mask = live[:, None] & d_live[None, :]
    if FP8:  # kernels/fp8_kv.py rows: e4m3 latent | float32 tile scales | bf16 rope
        codes = tl.load(row[:, None] + c[None, :], mask=lat_mask, other=0)
        scales = (row + LAT).to(tl.pointer_type(tl.float32))
        tile = (c // FP8_TILE)[None, :]
        tile_scale = tl.zeros((BLOCK_K, BLOCK_LAT), tl.float32)
        for j in tl.static_range(LAT // FP8_TILE):  # one scale per row and tile
            s_j = tl.load(scales + j, mask=live, other=0.0)
            tile_scale = tl.where(tile == j, s_j[:, None], tile_scale)
        dequant = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * tile_scale
        kv_lat = dequant.to(dtype)  # rounded once, as fp8_kv does
        rope = (row + LAT + 4 * (LAT // FP8_TILE)).to(tl.pointer_type(tl.bfloat16))
        kv_pe = tl.load(rope[:, None] + d[None, :], mask=pe_mask, other=0.0).to(dtype)
    else:
        kv_lat = tl.load(row[:, None] + c[None, :], mask=lat_mask, other=0.0)
        kv_pe = tl.load(row[:, None] + LAT + d[None, :], mask=pe_mask, other=0.0)
    return kv_lat, kv_pe, live


@triton.jit
def _attend_block(
    q_lat, q_pe, kv_lat, kv_pe, live, m, total, acc, scale, PRECISION: tl.constexpr
):  # fmt: skip
    """One block of rows into the streaming softmax: -> (m, total, acc)."""
    s = tl.dot(q_lat, tl.trans(kv_lat), input_precision=PRECISION)
    s = tl.dot(q_pe, tl.trans(kv_pe), acc=s, input_precision=PRECISION)
    s = tl.where(live[None, :], s * scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    # While a head has seen no live row, m_new is -inf: shift by 0 instead (p = 0).
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - shift)
    p = tl.exp(s - shift[:, None])
    total = total * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(kv_lat.dtype), kv_lat, acc=acc, input_precision=PRECISION)
    return m_new, total, acc


@triton.jit
def _sparse_mla_kernel(
    q_ptr,
    buf_ptr,
    rows_ptr,
    out_ptr,
    part_ptr,
    stats_ptr,
    scale,
    n_heads,
    q_stride_t,
    q_stride_h,
    buf_stride,
    rows_stride,
    out_stride_t,
    out_stride_h,
    LAT: tl.constexpr,
    ROPE: tl.constexpr,
    TOPK: tl.constexpr,
    BLOCK_LAT: tl.constexpr,
    BLOCK_ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLITS: tl.constexpr,
    CHUNK: tl.constexpr,
    PRECISION: tl.constexpr,
    FP8: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    split = tl.program_id(2)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_live = h < n_heads
    c = tl.arange(0, BLOCK_LAT)
    d = tl.arange(0, BLOCK_ROPE)
    c_live = c < LAT
    d_live = d < ROPE
    dtype = q_ptr.dtype.element_ty
    # The query block stays in registers for the whole walk over the selected rows.
    q_rows = q_ptr + t * q_stride_t + h[:, None] * q_stride_h
    q_lat = tl.load(q_rows + c[None, :], mask=h_live[:, None] & c_live[None, :], other=0.0)
    q_pe = tl.load(q_rows + LAT + d[None, :], mask=h_live[:, None] & d_live[None, :], other=0.0)

    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)  # running max of the scores
    total = tl.zeros((BLOCK_H,), tl.float32)  # running sum of exp(score - m)
    acc = tl.zeros((BLOCK_H, BLOCK_LAT), tl.float32)
    idx_base = rows_ptr + t * rows_stride + split * CHUNK
    lanes = tl.arange(0, BLOCK_K)
    for k0 in range(0, CHUNK, BLOCK_K):  # this split's CHUNK rows (all of them: SPLITS 1)
        k = split * CHUNK + k0 + lanes
        idx = tl.load(idx_base + k0 + lanes, mask=k < TOPK, other=-1)
        kv_lat, kv_pe, live = _load_rows(
            buf_ptr, idx, buf_stride, c, d, c_live, d_live, dtype, LAT, FP8, BLOCK_K, BLOCK_LAT
        )
        m, total, acc = _attend_block(
            q_lat, q_pe, kv_lat, kv_pe, live, m, total, acc, scale, PRECISION
        )
    if SPLITS == 1:
        out = acc / tl.where(total > 0.0, total, 1.0)[:, None]  # no live row: zeros
        o_rows = out_ptr + t * out_stride_t + h[:, None] * out_stride_h
        tl.store(
            o_rows + c[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=h_live[:, None] & c_live[None, :],
        )
    else:  # this split's unnormalized sum and its (max, total); _combine_kernel merges
        slot = (t * SPLITS + split) * n_heads + h
        mask = h_live[:, None] & c_live[None, :]
        tl.store(part_ptr + slot[:, None] * LAT + c[None, :], acc, mask=mask)
        tl.store(stats_ptr + slot * 2, m, mask=h_live)
        tl.store(stats_ptr + slot * 2 + 1, total, mask=h_live)


@triton.jit
def _combine_kernel(
    part_ptr,
    stats_ptr,
    out_ptr,
    n_heads,
    out_stride_t,
    out_stride_h,
    LAT: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_H: tl.constexpr,
    SPLITS: tl.constexpr,
):
    """Merge the SPLITS partial results of one query, for a small tile of heads x latent
    columns, in split order. The tile is small on purpose: a [64 heads x 512] float32 tile
    over 16 splits spilled registers to local memory when compiled for sm_90a (the splits'
    loads unrolled), which made split K slower than none (history/2026-12-01-study-autosplit/).
    Each element's arithmetic is the same whatever the tile, so the bits do not depend on it.
    """
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    h_live = h < n_heads
    mask = h_live[:, None] & (c[None, :] < LAT)
    top = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    for s in range(SPLITS):
        slot = (t * SPLITS + s) * n_heads + h
        top = tl.maximum(top, tl.load(stats_ptr + slot * 2, mask=h_live, other=float("-inf")))
    shift = tl.where(top == float("-inf"), 0.0, top)
    total = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_C), tl.float32)
    for s in range(SPLITS):
        slot = (t * SPLITS + s) * n_heads + h
        weight = tl.exp(tl.load(stats_ptr + slot * 2, mask=h_live, other=float("-inf")) - shift)
        total += weight * tl.load(stats_ptr + slot * 2 + 1, mask=h_live, other=0.0)
        part = tl.load(part_ptr + slot[:, None] * LAT + c[None, :], mask=mask, other=0.0)
        acc += part * weight[:, None]
    out = acc / tl.where(total > 0.0, total, 1.0)[:, None]
    o_rows = out_ptr + t * out_stride_t + h[:, None] * out_stride_h
    tl.store(o_rows + c[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def _check(q: torch.Tensor, buffer: torch.Tensor, rows: torch.Tensor, kv_lora_rank: int) -> None:
    if q.dim() != 3 or buffer.dim() != 2 or rows.dim() != 2:
        raise ValueError(
            "sparse MLA expects q [Q, H, r + d_rope], buffer [S, r + d_rope], rows [Q, K]; got "
            f"q {tuple(q.shape)}, buffer {tuple(buffer.shape)}, rows {tuple(rows.shape)}"
        )
    if not 0 < kv_lora_rank < q.shape[2]:
        raise ValueError(
            f"kv_lora_rank must be in (0, {q.shape[2]}) (the row's latent part), got {kv_lora_rank}"
        )
    if buffer.dtype == torch.uint8:  # fp8 rows (kernels/fp8_kv.py)
        want = fp8_row_bytes(kv_lora_rank, q.shape[2] - kv_lora_rank)
        if buffer.shape[1] != want:
            raise ValueError(
                f"an fp8 KV buffer holds {want}-byte rows for q's {q.shape[2]}-wide rows; got "
                f"rows of {buffer.shape[1]} bytes"
            )
    elif q.shape[2] != buffer.shape[1]:
        raise ValueError(
            f"q's last dim ({q.shape[2]}) must equal the buffer's row width ({buffer.shape[1]})"
        )
    if rows.shape[0] != q.shape[0]:
        raise ValueError(f"rows has {rows.shape[0]} queries but q has {q.shape[0]}")
    if q.dtype not in _DTYPES or buffer.dtype not in (q.dtype, torch.uint8):
        raise ValueError(
            "q and the buffer must share one dtype of float32/bfloat16, or the buffer hold fp8 "
            "rows (uint8); "
            f"got {q.dtype}, {buffer.dtype}"
        )
    if rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"rows must be int32 or int64 (-1 = none), got {rows.dtype}")
    if q.device != buffer.device or rows.device != q.device:
        raise ValueError(
            f"q, buffer and rows must be on one device; got {q.device}, {buffer.device}, "
            f"{rows.device}"
        )


def sparse_mla_from_buffer(
    q: torch.Tensor,
    buffer: torch.Tensor,
    rows: torch.Tensor,
    kv_lora_rank: int,
    scale: float,
    block_h: int = DEFAULT_BLOCK_H,
    block_k: int | None = None,
    num_warps: int = DEFAULT_NUM_WARPS,
    num_stages: int = DEFAULT_NUM_STAGES,
    splits: int = DEFAULT_SPLITS,
) -> torch.Tensor:
    """q [Q, H, r + d] (absorbed latent query | roped query), buffer [S, r + d] (KV rows),
    rows [Q, K] int32/int64 indices into the buffer (-1 = none) -> out [Q, H, r] in q's dtype.

    No host synchronisation and fixed shapes: capturable in a CUDA graph. ``block_h`` is
    capped at the head count (rounded up to 16, the smallest dot); ``block_k`` >= 16
    (None: ``DEFAULT_BLOCK_K``, or ``DEFAULT_BLOCK_K_FLOAT32`` for float32 q).
    ``splits`` > 1 divides each query's K rows among that many programs (more programs
    when queries x head blocks do not fill the GPU) and merges their partial softmaxes in
    a second launch, in split order: still deterministic, but the bits depend on
    ``splits`` (as on the block sizes), so offload and no-offload must use the same.
    """
    _check(q, buffer, rows, kv_lora_rank)
    if block_k is None:
        block_k = DEFAULT_BLOCK_K_FLOAT32 if q.dtype == torch.float32 else DEFAULT_BLOCK_K
    if q.stride(2) != 1 or buffer.stride(1) != 1:
        raise ValueError("q and buffer need unit stride along the row (call .contiguous())")
    if block_k < 16 or block_k & (block_k - 1):
        raise ValueError(f"block_k must be a power of two >= 16, got {block_k}")
    if splits < 1:
        raise ValueError(f"splits must be >= 1, got {splits}")
    n_queries, n_heads, width = q.shape
    rope = width - kv_lora_rank
    fp8 = buffer.dtype == torch.uint8
    out = torch.empty(n_queries, n_heads, kv_lora_rank, dtype=q.dtype, device=q.device)
    if n_queries == 0:
        return out
    rows = rows if rows.stride(1) == 1 else rows.contiguous()
    if os.environ.get("TRITON_INTERPRET") == "1":
        fix_interpreter_bf16()
    elif not q.is_cuda:
        raise ValueError(
            "the sparse-MLA kernel needs CUDA tensors (or TRITON_INTERPRET=1 on the CPU); "
            "use sparse_mla_reference / SGLANG_ECHO_SPARSE_MLA=torch on the CPU"
        )
    block_h = max(16, min(triton.next_power_of_2(block_h), triton.next_power_of_2(n_heads)))
    topk = rows.shape[1]
    chunk = triton.cdiv(triton.cdiv(topk, block_k), splits) * block_k
    block_lat = max(16, triton.next_power_of_2(kv_lora_rank))
    if splits > 1:  # float32 partials: [Q, splits, H, r] sums and [Q, splits, H, 2] stats
        part = torch.empty(n_queries, splits, n_heads, kv_lora_rank, device=q.device)
        stats = torch.empty(n_queries, splits, n_heads, 2, device=q.device)
    else:
        part = stats = torch.empty(1, device=q.device)  # unused
    grid = (n_queries, triton.cdiv(n_heads, block_h), splits)
    _sparse_mla_kernel[grid](
        q,
        buffer,
        rows,
        out,
        part,
        stats,
        float(scale),
        n_heads,
        q.stride(0),
        q.stride(1),
        buffer.stride(0),
        rows.stride(0),
        out.stride(0),
        out.stride(1),
        LAT=kv_lora_rank,
        ROPE=rope,
        TOPK=topk,  # the model's index_topk: one compile per model
        BLOCK_LAT=block_lat,
        BLOCK_ROPE=max(16, triton.next_power_of_2(rope)),
        BLOCK_H=block_h,
        BLOCK_K=block_k,
        SPLITS=splits,
        CHUNK=chunk,
        # float32 dots in IEEE float32 (tf32 keeps a 10-bit mantissa, far from the float32
        # reference); bf16 MMA always accumulates in float32 and ignores the choice.
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        FP8=fp8,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if splits > 1:
        block_c = min(COMBINE_BLOCK_C, block_lat)
        combine_grid = (
            n_queries,
            triton.cdiv(n_heads, COMBINE_BLOCK_H),
            triton.cdiv(kv_lora_rank, block_c),
        )
        _combine_kernel[combine_grid](
            part,
            stats,
            out,
            n_heads,
            out.stride(0),
            out.stride(1),
            LAT=kv_lora_rank,
            BLOCK_C=block_c,
            BLOCK_H=COMBINE_BLOCK_H,
            SPLITS=splits,
            num_warps=COMBINE_NUM_WARPS,
        )
    return out


# --------------------------------------------------------------------------- reference
# The plain-torch attention lives here, beside the kernel it must match: the model imports
# it from kernels/ (its CPU path and SGLANG_ECHO_SPARSE_MLA=torch), and kernels/ never
# imports the model.
def sparse_mla(
    q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor, kv_lora_rank: int, scale: float
) -> torch.Tensor:
    """Attention over gathered selected rows.

    q [Q, H, r + d_rope] (absorbed latent query | roped query), kv [Q, K, r + d_rope] (the
    selected rows), valid [Q, K] -> latent output [Q, H, r]. Softmax runs in float32.
    """
    scores = torch.matmul(q, kv.transpose(-1, -2)).float() * scale
    scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs, kv[..., :kv_lora_rank])


def sparse_mla_reference(
    q: torch.Tensor, buffer: torch.Tensor, rows: torch.Tensor, kv_lora_rank: int, scale: float
) -> torch.Tensor:
    """The torch path from the buffer: gather the selected rows, then ``sparse_mla``."""
    _check(q, buffer, rows, kv_lora_rank)
    kv = buffer[rows.clamp(min=0).long()]
    if kv.dtype == torch.uint8:  # fp8 rows: the same bf16 (or float32) values the kernel sees
        kv = dequantize_kv_rows(kv, kv_lora_rank, q.dtype)
    return sparse_mla(q, kv, rows >= 0, kv_lora_rank, scale)
