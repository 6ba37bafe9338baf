"""A batch-invariant GEMM, ``y = x @ w.T``: a row's result never depends on the batch size.

Why: served ECHO and served no-offload must give the same greedy tokens for every request,
but they run different batches (ECHO decodes more requests per step). cuBLAS on the GPU
and MKL/oneDNN on the CPU choose their tiling, split-K and reduction order by the row count
M, so a row's bits depend on how many other rows share its matmul (tests/test_batch_invariant.py
shows the tiny model's decode logits change with the batch when the mode is off). Under
SGLANG_ECHO_BATCH_INVARIANT=1 every matmul of the model's forward runs this kernel
instead (model/layers.py ``Linear``, ``ModelKernels.batch_invariant``).

What makes it invariant: one compiled kernel for every M (``M`` is not specialized and the
block sizes are fixed, no autotune), no split-K, and a row's output tile accumulates its K
blocks in one fixed order, in float32, from the same instructions whatever row of its tile
it is in and however many rows the tile holds (rows past M are masked to zero and never
mix into others). So row i's bits are a function of row i and the weight alone. The price
is speed at large M (one 16-row tile re-reads the weight tile per 16 rows): the mode is
opt-in, for runs that must compare tokens across batch sizes.

A leading group axis (``invariant_bmm``) serves the attention's per-head absorption
(``einsum("thd,hdr->thr")``) with the same kernel: group g multiplies x[g] by w[g].T, with
arbitrary strides, so head-major views need no copy. Segmented groups
(``invariant_grouped_mm``) serve a routed MoE: rows sorted by expert, group g's rows
``[offs[g-1], offs[g])`` times w[g].T, the offsets read on the device (graph-capturable,
as ``torch._grouped_mm``, whose tiling follows the group sizes and so the batch). Row
sums (``invariant_row_sum``, an RMSNorm's) are the same kernel against a row of ones: a
CUDA reduction picks its threads per row by the number of rows, so ``x.pow(2).mean(-1)``
rounds a row by its batch. The plain-torch reference (``invariant_linear_reference``) is
``F.linear`` in float32, cast to x's dtype.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from sglang_echo.kernels.interpreter import fix_interpreter_bf16, row_independent_dots

# Fixed for every shape and batch: a different block (or an autotuned one) would sum a
# row's K products in another order. 16 rows is the smallest tile a dot takes and about a
# decode batch; 64 x 64 keeps the weight tile's loads wide.
BLOCK_M = 16
BLOCK_N = 64
BLOCK_K = 64
NUM_WARPS = 4


@triton.jit(do_not_specialize=("M",))
def _invariant_matmul_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, offs_ptr, M, N,
    sx_g, sx_m, sx_k, sw_g, sw_n, sw_k, sy_g, sy_m, sy_n,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, SEGMENTED: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One program: a BLOCK_M x BLOCK_N tile of group g's output, K walked from 0 upward.
    SEGMENTED: group g's rows are rows [offs[g-1], offs[g]) of x and y (sx_g = sy_g = 0);
    a tile past the group's last row returns at once."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    g = tl.program_id(2).to(tl.int64)
    if SEGMENTED:
        first = tl.load(offs_ptr + g - 1, mask=g > 0, other=0).to(tl.int64)
        end = tl.load(offs_ptr + g).to(tl.int64)
        if first + pid_m * BLOCK_M >= end:
            return
    else:
        first = 0
        end = M
    rm = first + pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rm < end
    col_ok = rn < N
    x_base = x_ptr + g * sx_g + rm[:, None] * sx_m
    w_base = w_ptr + g * sw_g + rn[None, :] * sw_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # one order for every row: no split-K
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(x_base + rk[None, :] * sx_k, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + rk[:, None] * sw_k, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + g * sy_g + rm[:, None] * sy_m + rn[None, :] * sy_n
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _launch(
    x: torch.Tensor,
    w: torch.Tensor,
    y: torch.Tensor,
    bias: torch.Tensor | None,
    offs: torch.Tensor | None = None,
    max_rows: int = 0,
) -> None:
    """x [G, M, K], w [G, N, K] (any strides), y [G, M, N] written in place. With ``offs``
    (segmented): x [1, C, K] and y [1, C, N] hold every group's rows, w [G, N, K], and no
    group has more than ``max_rows`` rows."""
    groups, m, k = (w.shape[0], max_rows, x.shape[2]) if offs is not None else x.shape
    n = w.shape[1]
    if m == 0 or n == 0 or groups == 0:
        return
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if interpreted:
        fix_interpreter_bf16()
    elif not x.is_cuda:
        raise ValueError(
            "the batch-invariant GEMM needs CUDA tensors (or TRITON_INTERPRET=1 on the CPU); "
            "invariant_linear_reference is its torch form"
        )
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N), groups)
    # The interpreter's dots made per row, as the GPU's MMA (kernels/interpreter.py).
    rows_apart = row_independent_dots() if interpreted else contextlib.nullcontext()
    with rows_apart:
        segmented = offs is not None
        _invariant_matmul_kernel[grid](
            x, w, bias if bias is not None else y, y, offs if segmented else y, m, n,
            0 if segmented else x.stride(0), x.stride(1), x.stride(2),
            w.stride(0), w.stride(1), w.stride(2),
            0 if segmented else y.stride(0), y.stride(1), y.stride(2),
            K=k,  # a layer's width: one compile per weight shape, none per batch
            HAS_BIAS=bias is not None,
            SEGMENTED=segmented,
            # float32 in IEEE float32 (tf32 keeps a 10-bit mantissa, far from F.linear's
            # float32); a bf16 MMA accumulates in float32 and ignores the choice.
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
            num_warps=NUM_WARPS,
        )  # fmt: skip


def _check_dtypes(x: torch.Tensor, w: torch.Tensor) -> None:
    if x.dtype != w.dtype:
        raise ValueError(f"x ({x.dtype}) and weight ({w.dtype}) must share a dtype, as F.linear's")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"the batch-invariant GEMM takes float32/bf16/fp16, got {x.dtype}")


def invariant_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` by the batch-invariant kernel: x [..., K], weight
    [N, K], bias [N] -> [..., N] in x's dtype, float32 accumulation. Row r of the result
    has the same bits whatever the other rows of x are and however many there are.

    No host synchronisation and no shape-dependent choice: capturable in a CUDA graph."""
    _check_dtypes(x, weight)
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} do not chain")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])  # a view when it can be; strides go to the kernel as is
    y = torch.empty(x2.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    if bias is not None:
        bias = bias.contiguous()
    _launch(x2.unsqueeze(0), weight.unsqueeze(0), y.unsqueeze(0), bias)
    return y.view(*lead, weight.shape[0])


def invariant_bmm(
    x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Per group g: ``x[g] @ weight[g].T`` by the batch-invariant kernel. x [G, M, K],
    weight [G, N, K], any strides (head-major views of token-major tensors need no copy);
    ``out`` [G, M, N] (any strides, e.g. a permuted view of a token-major result) or a new
    tensor. Row (g, m) depends only on x[g, m] and weight[g]."""
    _check_dtypes(x, weight)
    if (
        x.dim() != 3
        or weight.dim() != 3
        or x.shape[0] != weight.shape[0]
        or (x.shape[2] != weight.shape[2])
    ):
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} do not chain")
    if out is None:
        out = torch.empty(x.shape[0], x.shape[1], weight.shape[1], dtype=x.dtype, device=x.device)
    _launch(x, weight, out, None)
    return out


def invariant_grouped_mm(
    x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, max_rows: int
) -> torch.Tensor:
    """Rows of ``x`` [C, K] sorted by group, group g = rows [offs[g-1], offs[g]) -> their
    rows of ``x @ weight[g].T`` ([C, N]; weight [G, N, K], offs [G] int32 cumulative, on
    the device). ``max_rows`` bounds any group's rows (a routed MoE: the tokens, as a token
    picks an expert once): the launch's tiles per group, fixed by the batch's shape, never
    by the offsets, so no host sync. Rows past offs[-1] belong to no group and are zero. A
    row's bits depend on that row and its group's weight only."""
    _check_dtypes(x, weight)
    if x.dim() != 2 or weight.dim() != 3 or x.shape[1] != weight.shape[2]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} do not chain")
    if offs.shape != (weight.shape[0],) or offs.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"offs must be [{weight.shape[0]}] int32/int64, got {tuple(offs.shape)}")
    y = torch.zeros(x.shape[0], weight.shape[1], dtype=x.dtype, device=x.device)
    if x.shape[0]:
        _launch(x.unsqueeze(0), weight, y.unsqueeze(0), None, offs, max(0, max_rows))
    return y


def invariant_row_sum(x: torch.Tensor) -> torch.Tensor:
    """``x.sum(-1, keepdim=True)`` with a row's bits independent of the batch: the GEMM
    against a row of ones (each product exact, K added in one fixed order)."""
    return invariant_linear(x, torch.ones(1, x.shape[-1], dtype=x.dtype, device=x.device))


# --------------------------------------------------------------------------- reference
def invariant_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The kernel's value in plain torch: float32 ``F.linear``, cast to x's dtype (its
    bits may depend on the batch; the kernel's equal it to rounding)."""
    b = None if bias is None else bias.float()
    return F.linear(x.float(), weight.float(), b).to(x.dtype)


def invariant_bmm_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``invariant_bmm`` in plain torch (float32, cast to x's dtype)."""
    return torch.matmul(x.float(), weight.float().transpose(1, 2)).to(x.dtype)


def invariant_grouped_mm_reference(
    x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor
) -> torch.Tensor:
    """``invariant_grouped_mm`` in plain torch (float32 per group, cast to x's dtype)."""
    y = torch.zeros(x.shape[0], weight.shape[1], dtype=x.dtype, device=x.device)
    first = 0
    for g, end in enumerate(offs.tolist()):
        if end > first:
            y[first:end] = (x[first:end].float() @ weight[g].float().T).to(x.dtype)
        first = end
    return y
