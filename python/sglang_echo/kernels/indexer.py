"""Lightning-indexer logits in fp8 (e4m3) over the per-token indexer-key cache, for decode.

logits[b, n] = k_scale[loc] * sum_h w[b, h] * relu(q[b, h] . k[loc]),  loc = locs[b, n],
for positions n < seq_len[b]; -inf beyond. The query's own fp8 scale and the softmax scale
are folded into ``w`` by the caller (relu commutes with positive scales), as in DeepSeek's
deployed indexer. One program scores BLOCK_N keys of one request: it gathers their fp8 rows
once (132 B per key incl. the scale), runs one [H, D] x [D, BLOCK_N] fp8 dot, applies
relu and the head weights in registers, and writes BLOCK_N floats; a program walks several
key blocks so the query is loaded once. The keys are read once: the memory floor of this op.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Fastest config whose top-k matched float64 on an H200 (benchmark/results/indexer.json).
DEFAULT_BLOCK_N = 128
DEFAULT_BLOCKS_PER_PROGRAM = 1
DEFAULT_NUM_STAGES = 3


@triton.jit
def _request_query(q_ptr, w_ptr, lens_ptr, b, H: tl.constexpr, D: tl.constexpr):
    """Request ``b``'s query [H, D], head weights [H] and length: every logits kernel's
    prologue (they stay in registers across the program's key blocks)."""
    d = tl.arange(0, D)
    h = tl.arange(0, H)
    q = tl.load(q_ptr + b * H * D + h[:, None] * D + d[None, :])
    return q, tl.load(w_ptr + b * H + h), tl.load(lens_ptr + b)


@triton.jit
def _fp8_logits_block(
    q,
    w,
    k_ptr,
    k_scale_ptr,
    locs_ptr,
    b,
    n,
    seq_len,
    k_stride,
    k_scale_stride,
    locs_stride,
    D: tl.constexpr,
    PRECISE_ACC: tl.constexpr,
    KEYS_AS_M: tl.constexpr,
):
    """Logits of request ``b``'s keys at positions ``n`` (-inf at and past ``seq_len``),
    their host ids and which positions are live."""
    d = tl.arange(0, D)
    live = n < seq_len
    loc = tl.load(locs_ptr + b * locs_stride + n, mask=live, other=0).to(tl.int64)
    k = tl.load(k_ptr + loc[:, None] * k_stride + d[None, :], mask=live[:, None], other=0.0)
    # Hopper's fp8 MMA accumulates with reduced precision; promoting to fp32 every 32
    # products keeps logits within fp32 rounding of the exact value (top-k stays exact).
    if KEYS_AS_M:  # [BLOCK_N, H]: keys fill the MMA's M dimension
        scores = tl.dot(k, tl.trans(q), max_num_imprecise_acc=PRECISE_ACC)
        logits = tl.sum(tl.maximum(scores, 0.0) * w[None, :], axis=1)
    else:  # [H, BLOCK_N]
        scores = tl.dot(q, tl.trans(k), max_num_imprecise_acc=PRECISE_ACC)
        logits = tl.sum(tl.maximum(scores, 0.0) * w[:, None], axis=0)
    logits = logits * tl.load(k_scale_ptr + loc * k_scale_stride, mask=live, other=0.0)
    logits = tl.where(live, logits, float("-inf"))
    return logits, loc, live


@triton.jit
def _fp8_index_logits_kernel(
    q_ptr,
    w_ptr,
    k_ptr,
    k_scale_ptr,
    locs_ptr,
    lens_ptr,
    out_ptr,
    length,
    k_stride,
    k_scale_stride,
    locs_stride,
    out_stride,
    first_program,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCKS: tl.constexpr,
    PRECISE_ACC: tl.constexpr,
    KEYS_AS_M: tl.constexpr,
):
    b = tl.program_id(0)
    q, w, seq_len = _request_query(q_ptr, w_ptr, lens_ptr, b, H=H, D=D)
    first = (first_program + tl.program_id(1)) * BLOCKS * BLOCK_N
    for i in range(BLOCKS):
        n = first + i * BLOCK_N + tl.arange(0, BLOCK_N)
        logits, _loc, _live = _fp8_logits_block(
            q, w, k_ptr, k_scale_ptr, locs_ptr, b, n, seq_len, k_stride, k_scale_stride,
            locs_stride, D=D, PRECISE_ACC=PRECISE_ACC, KEYS_AS_M=KEYS_AS_M,
        )  # fmt: skip
        tl.store(out_ptr + b * out_stride + n, logits, mask=n < length)


def program_span(
    block_n: int = DEFAULT_BLOCK_N, blocks_per_program: int = DEFAULT_BLOCKS_PER_PROGRAM
) -> int:
    """Key positions one program of :func:`fp8_index_logits` scores: ranges of positions
    start at multiples of it."""
    return block_n * blocks_per_program


def _check(q, weights, keys, key_scales, locs, seq_lens) -> None:
    if q.dtype != torch.float8_e4m3fn or keys.dtype != torch.float8_e4m3fn:
        raise ValueError("q and keys must be float8_e4m3fn")
    if q.dim() != 3 or weights.shape != q.shape[:2] or keys.shape[1] != q.shape[2]:
        raise ValueError("expected q [B, H, D], weights [B, H], keys [N, D]")
    if (
        key_scales.shape != keys.shape[:1]
        or locs.shape[0] != q.shape[0]
        or seq_lens.shape != q.shape[:1]
    ):
        raise ValueError("expected key_scales [N], locs [B, L], seq_lens [B]")


def fp8_index_logits(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    key_scales: torch.Tensor,
    locs: torch.Tensor,
    seq_lens: torch.Tensor,
    block_n: int = DEFAULT_BLOCK_N,
    num_warps: int = 4,
    num_stages: int = DEFAULT_NUM_STAGES,
    blocks_per_program: int = DEFAULT_BLOCKS_PER_PROGRAM,
    keys_as_m: bool = True,
    precise_acc: int = 32,
    out: torch.Tensor | None = None,
    start: int = 0,
    end: int | None = None,
) -> torch.Tensor:
    """q [B, H, D] e4m3, weights [B, H] fp32, keys [N, D] e4m3, key_scales [N] fp32,
    locs [B, L] key rows per position, seq_lens [B] -> logits [B, L] fp32.

    ``keys`` and ``key_scales`` may be strided views into packed [N, D + 4] byte rows
    (unit stride along D). ``out`` [B, L] float32, ``start``/``end``: score only positions
    [start, end) into ``out`` (the decode prefetch's chunks, kernels/decode_stage.py);
    ``start`` a multiple of ``program_span(...)``. Every key block is computed by the same
    code whatever the range, so chunked logits equal whole ones bit for bit."""
    if keys.stride(1) != 1:
        raise ValueError("keys need unit stride along D")
    _check(q, weights, keys, key_scales, locs, seq_lens)
    batch, heads, dim = q.shape
    length = locs.shape[1]
    span = program_span(block_n, blocks_per_program)
    end = length if end is None else min(end, length)
    if start % span or start < 0 or (end < length and end % span):
        raise ValueError(f"start and end (short of L) must be multiples of {span} positions")
    if out is None:
        out = torch.empty(batch, length, dtype=torch.float32, device=q.device)
    elif out.shape != (batch, length) or out.dtype != torch.float32 or out.stride(1) != 1:
        raise ValueError(f"out must be [B, L] = [{batch}, {length}] float32, unit stride")
    if end <= start or batch == 0:
        return out
    grid = (batch, triton.cdiv(end - start, span))
    _fp8_index_logits_kernel[grid](
        q.contiguous(),
        weights.contiguous().float(),
        keys,
        key_scales,
        locs,
        seq_lens,
        out,
        length,
        keys.stride(0),
        key_scales.stride(0),
        locs.stride(0),
        out.stride(0),
        start // span,
        H=heads,
        D=dim,
        BLOCK_N=block_n,
        BLOCKS=blocks_per_program,
        PRECISE_ACC=precise_acc,
        KEYS_AS_M=keys_as_m,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def fp8_index_logits_reference(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    key_scales: torch.Tensor,
    locs: torch.Tensor,
    seq_lens: torch.Tensor,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Plain torch in ``dtype`` (float64 by default): the semantics the kernel must meet."""
    _check(q, weights, keys, key_scales, locs, seq_lens)
    k = keys.to(dtype)[locs.long()]  # [B, L, D]
    scores = torch.relu(torch.einsum("bhd,bld->bhl", q.to(dtype), k))
    logits = (
        torch.einsum("bh,bhl->bl", weights.to(dtype), scores) * key_scales.to(dtype)[locs.long()]
    )
    pos = torch.arange(locs.shape[1], device=locs.device)
    return logits.masked_fill(pos[None, :] >= seq_lens[:, None], float("-inf"))
