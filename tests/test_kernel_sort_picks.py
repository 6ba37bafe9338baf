"""The picks-sorting kernel (kernels/sort_picks.py) vs its torch reference: the interpreter
on a CPU-only machine, the compiled kernel on a GPU machine. It must return the reference's
very tensor for picks in any order, with -1 holes, masked (-inf) picks, a k that is not a
power of two, and strided inputs."""

from __future__ import annotations

import pytest
import torch

from sglang_echo.kernels.sort_picks import sort_picks, sort_picks_reference

# Real kernels on a GPU machine, the Triton interpreter elsewhere (conftest sets it).
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(("rows", "n", "k"), [(5, 400, 64), (3, 90, 40), (2, 30, 48)])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_sort_picks_matches_the_reference(rows, n, k, dtype):
    g = torch.Generator().manual_seed(rows * n + k)
    scores = torch.randn(rows, n, generator=g)
    scores[:, ::7] = float("-inf")  # masked keys a peer may still return
    picks = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(rows)])
    if k > n - 5:
        picks = torch.stack([torch.randperm(k, generator=g) for _ in range(rows)]) % n
    holes = torch.rand(rows, k, generator=g) < 0.2
    picks = picks.masked_fill(holes, -1).to(dtype)
    scores, picks = scores.to(DEV), picks.to(DEV)
    got = sort_picks(scores, picks)
    want = sort_picks_reference(scores, picks)
    assert got.dtype == torch.int64
    assert torch.equal(got, want)
    assert (got[:, :-1] <= got[:, 1:]).logical_or(got[:, 1:] == -1).all()


def test_sort_picks_reads_strided_rows_and_refuses_bad_shapes():
    g = torch.Generator().manual_seed(9)
    wide = torch.randn(4, 300, generator=g).to(DEV)
    scores = wide[:, :200]  # row stride 300
    picks_wide = torch.randint(0, 200, (4, 100), generator=g).to(DEV)
    picks = picks_wide[:, ::2]  # not contiguous
    assert torch.equal(sort_picks(scores, picks), sort_picks_reference(scores, picks))
    with pytest.raises(ValueError, match="same rows"):
        sort_picks(scores, picks[:3])
