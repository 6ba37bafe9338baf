"""The batch-invariant GEMM (kernels/invariant_matmul.py) vs its torch reference, and its
point: a row's bits do not depend on the other rows or their number (interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from sglang_echo.kernels.invariant_matmul import (
    BLOCK_K,
    BLOCK_N,
    invariant_bmm,
    invariant_bmm_reference,
    invariant_grouped_mm,
    invariant_grouped_mm_reference,
    invariant_linear,
    invariant_linear_reference,
    invariant_row_sum,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# (N, K): one block each way, N and K not multiples of the blocks, several K blocks.
SHAPES = [(BLOCK_N, BLOCK_K), (70, 100), (33, 2 * BLOCK_K + 5), (130, 17)]
TOLERANCE = {torch.float32: (2e-5, 1e-5), torch.bfloat16: (2e-2, 1e-2)}


def _inputs(m: int, n: int, k: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed + n * 1000 + k)
    x = torch.randn(m, k, generator=g).to(DEV, dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(DEV, dtype)
    b = torch.randn(n, generator=g).to(DEV, dtype)
    return x, w, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_close_to_the_reference(n, k, dtype):
    x, w, b = _inputs(13, n, k, dtype)
    rtol, atol = TOLERANCE[dtype]
    for bias in (None, b):
        got = invariant_linear(x, w, bias)
        assert got.dtype == dtype and got.shape == (13, n)
        want = invariant_linear_reference(x, w, bias)
        torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_a_rows_bits_do_not_depend_on_the_batch(n, k, dtype):
    x, w, b = _inputs(13, n, k, dtype, seed=1)
    full = invariant_linear(x, w, b)
    first5 = invariant_linear(x[:5], w, b)
    for i in range(13):
        assert torch.equal(full[i], invariant_linear(x[i : i + 1], w, b)[0]), i
        if i < 5:
            assert torch.equal(full[i], first5[i]), i


def test_leading_shape_and_strided_input():
    x, w, _ = _inputs(12, 40, 24, torch.float32)
    x3 = x.view(3, 4, 24)
    got = invariant_linear(x3, w)
    assert got.shape == (3, 4, 40) and torch.equal(got.view(12, 40), invariant_linear(x, w))
    strided = torch.cat((x, x), dim=1)[:, ::2]  # a non-contiguous [12, 24] view
    torch.testing.assert_close(
        invariant_linear(strided, w), invariant_linear_reference(strided, w), rtol=2e-5, atol=1e-5
    )
    assert invariant_linear(x[:0], w).shape == (0, 40)


def test_grouped_form_is_per_group_and_batch_invariant():
    """invariant_bmm on head-major views of token-major tensors (the attention's
    absorption): close to the reference, and a token's rows equal alone or in a batch."""
    g = torch.Generator().manual_seed(3)
    tokens, heads, k, n = 9, 3, 20, 70
    x = torch.randn(tokens, heads, k, generator=g).to(DEV)
    w = torch.randn(heads, n, k, generator=g).to(DEV)
    out = x.new_empty(tokens, heads, n)
    invariant_bmm(x.transpose(0, 1), w, out=out.transpose(0, 1))
    want = invariant_bmm_reference(x.transpose(0, 1), w).transpose(0, 1)
    torch.testing.assert_close(out, want, rtol=2e-5, atol=1e-5)
    one = x.new_empty(1, heads, n)
    invariant_bmm(x[4:5].transpose(0, 1), w, out=one.transpose(0, 1))
    assert torch.equal(one[0], out[4])


def test_refuses_mixed_dtypes_and_unchained_shapes():
    x, w, _ = _inputs(2, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="share a dtype"):
        invariant_linear(x, w.to(torch.bfloat16))
    with pytest.raises(ValueError, match="do not chain"):
        invariant_linear(x, w[:, :8])


def _segments(sizes: list[int], k: int, n: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rows = sum(sizes) + 3  # three rows past the last group: no group's
    x = torch.randn(rows, k, generator=g).to(DEV, dtype)
    w = (torch.randn(len(sizes), n, k, generator=g) / k**0.5).to(DEV, dtype)
    offs = torch.tensor(sizes, device=DEV).cumsum(0).to(torch.int32)
    return x, w, offs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_segmented_groups_close_to_the_reference(dtype):
    """Empty groups, a group over one 16-row tile, rows past the last group (zero)."""
    sizes = [3, 0, 17, 1, 0, 5]
    x, w, offs = _segments(sizes, 2 * BLOCK_K + 5, 70, dtype)
    got = invariant_grouped_mm(x, w, offs, max_rows=max(sizes))
    rtol, atol = TOLERANCE[dtype]
    want = invariant_grouped_mm_reference(x, w, offs)
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)
    assert not got[sum(sizes) :].any()
    # a bound above the largest group launches idle tiles, and changes nothing
    assert torch.equal(got, invariant_grouped_mm(x, w, offs, max_rows=max(sizes) + 40))


def test_a_segmented_rows_bits_do_not_depend_on_its_group_mates():
    """A row alone in its group equals the same row among 16 others, at another position
    of another tile: what a routed MoE needs when the batch changes who shares an expert."""
    x, w, offs = _segments([4, 20], BLOCK_K + 9, 33, torch.bfloat16, seed=2)
    full = invariant_grouped_mm(x, w, offs, max_rows=20)
    for row, group in ((1, 0), (9, 1), (23, 1)):
        alone = torch.zeros(w.shape[0], dtype=torch.int32, device=DEV)
        alone[group:] = 1  # group `group` holds one row: row 0
        one = invariant_grouped_mm(x[row : row + 1], w, alone, max_rows=1)
        assert torch.equal(one[0], full[row]), row


def test_row_sum_is_batch_invariant_and_close():
    x, _, _ = _inputs(13, 8, 3 * BLOCK_K + 7, torch.float32, seed=4)
    full = invariant_row_sum(x)
    assert full.shape == (13, 1)
    torch.testing.assert_close(full, x.sum(-1, keepdim=True), rtol=1e-5, atol=1e-4)
    for i in (0, 7, 12):
        assert torch.equal(invariant_row_sum(x[i : i + 1])[0], full[i])


def test_segmented_refuses_bad_offsets():
    x, w, offs = _segments([2, 2], 16, 8, torch.float32)
    with pytest.raises(ValueError, match="offs must be"):
        invariant_grouped_mm(x, w, offs[:1], max_rows=2)
