"""The picks-to-locations kernel (kernels/pick_locs.py) vs its torch reference: the
interpreter on a CPU-only machine, the compiled kernel on a GPU machine. It must return the
reference's very tensor with -1 holes, several queries per group (prefill), a pick count
that is not a multiple of the block, and strided inputs; and the indexer's selection must
not change with it."""

from __future__ import annotations

import pytest
import torch

from sglang_echo.kernels.pick_locs import BLOCK, pick_locs, pick_locs_reference

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(groups: int, queries: int, picks: int, length: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    locs = torch.randint(1, 1 << 40, (groups, length), generator=g)  # int64 ids past 2**32
    pos = torch.randint(0, length, (groups, queries, picks), generator=g)
    pos = pos.masked_fill(torch.rand(groups, queries, picks, generator=g) < 0.25, -1)
    return pos.to(DEV), locs.to(DEV)


@pytest.mark.parametrize(
    ("groups", "queries", "picks", "length"),
    [(3, 1, 64, 500), (1, 5, 48, 90), (2, 2, BLOCK + 37, 3000)],
)
def test_pick_locs_matches_the_reference(groups, queries, picks, length):
    pos, locs = _case(groups, queries, picks, length, groups * 1000 + picks)
    got = pick_locs(pos, locs)
    want = pick_locs_reference(pos, locs)
    assert got.dtype == torch.int64
    assert torch.equal(got, want)
    assert (got[pos < 0] == -1).all() and (got[pos >= 0] > 0).all()


def test_pick_locs_reads_strided_inputs_and_refuses_bad_shapes():
    pos, locs = _case(4, 1, 200, 400, 7)
    wide = torch.zeros(4, 700, dtype=torch.int64, device=DEV)
    wide[:, :400] = locs
    strided_locs = wide[:, :400]  # row stride 700
    strided_pos = torch.stack((pos, pos), dim=-1)[..., 0]  # not contiguous
    want = pick_locs_reference(pos, locs)
    assert torch.equal(pick_locs(strided_pos, strided_locs), want)
    assert pick_locs(pos[:0], locs[:0]).shape == (0, 1, 200)
    with pytest.raises(ValueError, match="groups"):
        pick_locs(pos, locs[:3])
    with pytest.raises(ValueError, match="queries, picks"):
        pick_locs(pos[:, 0], locs)


def test_indexer_locations_are_the_same_with_and_without_the_kernel():
    from sglang_echo.model.indexer import positions_to_locs

    pos, locs = _case(2, 3, 100, 250, 11)
    assert torch.equal(positions_to_locs(pos, locs, True), positions_to_locs(pos, locs, False))
