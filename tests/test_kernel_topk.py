"""Radix-select top-k kernel vs the exact tie-stable reference (interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from sglang_echo.kernels.topk import select_topk, topk_positions, topk_positions_reference

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _sorted(pos: torch.Tensor) -> torch.Tensor:
    ordered = torch.where(pos < 0, torch.full_like(pos, 1 << 62), pos).sort(dim=-1).values
    return torch.where(ordered == 1 << 62, -1, ordered)


@pytest.mark.parametrize(
    ("kind", "n_cols", "topk", "block"),
    [
        ("random", 300, 17, 64),
        ("ties", 300, 40, 128),  # small integers: many exact ties at the k-th value
        ("negative", 257, 9, 64),  # signs exercise the order-preserving key
        ("short", 50, 64, 64),  # fewer keys than k: -1 padding
    ],
)
def test_topk_kernel_matches_reference(kind, n_cols, topk, block):
    g = torch.Generator().manual_seed(n_cols + topk)
    rows = 5
    if kind == "ties":
        scores = torch.randint(0, 4, (rows, n_cols), generator=g).float()
    elif kind == "negative":
        scores = torch.randn(rows, n_cols, generator=g) * 1e3
    else:
        scores = torch.rand(rows, n_cols, generator=g)
    scores[1, 10:20] = float("-inf")
    qpos = torch.tensor([n_cols - 1, n_cols // 2, 5, 0, n_cols - 1])
    scores, qpos = scores.to(DEV), qpos.to(DEV)
    got = topk_positions(scores, qpos, topk, block=block)
    want = topk_positions_reference(scores, qpos, topk)
    assert torch.equal(_sorted(got), want)
    assert (got[3, :1] == 0).all() and (got[3, 1:] == -1).all()  # query at position 0


def test_topk_rejects_non_float32():
    with pytest.raises(ValueError, match="float32"):
        topk_positions(torch.zeros(2, 8, dtype=torch.float64), torch.zeros(2), 4)


@pytest.mark.parametrize("cand_block", [512, 32])
def test_topk_kernel_many_blocks_ties_across_blocks(cand_block):
    """20 blocks per row: the k-th value's ties spread over many blocks, so the offsets
    each block takes from the blocks before it decide which tied positions are kept.
    Every key shares one top byte, so each block's candidates are all of it: with
    ``cand_block`` 32 the candidate passes read them in eight pieces."""
    g = torch.Generator().manual_seed(7)
    rows, n_cols, topk = 3, 5000, 300
    scores = torch.randint(0, 50, (rows, n_cols), generator=g).float()
    qpos = torch.tensor([n_cols - 1, 3999, 2500])
    scores, qpos = scores.to(DEV), qpos.to(DEV)
    got = topk_positions(scores, qpos, topk, block=256, cand_block=cand_block)
    assert torch.equal(got, topk_positions_reference(scores, qpos, topk))


def test_topk_kernel_candidates_uneven_across_blocks():
    """Blocks whose candidates (keys at the k-th key's top byte) number none, a few, or
    more than one piece: each block's stretch is read to its own count, and the picks
    above the top byte come from the full row."""
    g = torch.Generator().manual_seed(11)
    rows, n_cols, topk = 2, 2048, 100
    scores = torch.rand(rows, n_cols, generator=g) * 0.001  # top byte below the picks'
    scores[:, 256:512] = 1.0 + torch.rand(rows, 256, generator=g)  # one block: all candidates
    scores[:, 600:640] = 1.5 + torch.rand(rows, 40, generator=g) * 0.1  # a few
    scores[:, 1900:1910] = 100.0  # above the k-th key's top byte
    scores[1, 700] = float("-inf")
    qpos = torch.tensor([n_cols - 1, 1999])
    scores, qpos = scores.to(DEV), qpos.to(DEV)
    got = topk_positions(scores, qpos, topk, block=256, cand_block=64)
    assert torch.equal(got, topk_positions_reference(scores, qpos, topk))


@pytest.mark.parametrize("kind", ["random", "ties", "short"])
def test_exact_topk_kernel_matches_sort_path(kind, monkeypatch):
    """The model's top-k entry point: kernel and sort pick the same set and report the
    same k-th score (the decode prefetcher's EMA input), ties and short rows included."""
    from sglang_echo.model.indexer import exact_topk

    g = torch.Generator().manual_seed(7)
    n_cols, topk = (40, 64) if kind == "short" else (500, 48)
    if kind == "ties":
        scores = torch.randint(0, 3, (4, n_cols), generator=g).float()
    else:
        scores = torch.randn(4, n_cols, generator=g)
    qpos = torch.tensor([n_cols - 1, 30, n_cols // 2, 60]).clamp(max=n_cols - 1)
    scores, qpos = scores.to(DEV), qpos.to(DEV)
    pos_k, kth_k = exact_topk(scores, qpos, topk, use_kernel=True)
    pos_s, kth_s = exact_topk(scores, qpos, topk, use_kernel=False)
    assert torch.equal(_sorted(pos_k), _sorted(pos_s))
    assert torch.equal(kth_k, kth_s)
    if kind == "short":
        assert bool((kth_k == float("-inf")).all())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="counts compiled GPU variants")
def test_contexts_and_row_counts_of_any_size_reuse_one_compiled_variant() -> None:
    """Decode widths grow and prefill query blocks come in every size: neither may compile
    a new top-k kernel variant mid-serving."""
    from sglang_echo.kernels import topk as topk_module

    kernels = (topk_module._hist_kernel, topk_module._count_kernel)
    kernels += (topk_module._collect_kernel,)
    device = torch.cuda.current_device()
    before = None
    for step, (rows, n_cols) in enumerate(((3, 5000), (17, 9000), (1, 70000), (48, 100_003))):
        scores = torch.randn(rows, n_cols, device=DEV)
        qpos = torch.full((rows,), n_cols - 1, device=DEV)
        got = topk_positions(scores, qpos, 2048)
        assert torch.equal(_sorted(got), topk_positions_reference(scores, qpos, 2048))
        torch.cuda.synchronize()
        counts = [len(k.device_caches[device][0]) for k in kernels]  # hist: one per PASS
        if step == 0:
            before = counts
    assert counts == before, f"variants per kernel grew from {before} to {counts}"


@pytest.mark.parametrize("seed", range(12))
def test_topk_kernel_random_shapes_masks_and_launch_shapes(seed):
    """Random widths, k, query positions, -inf runs and score scales (a few ties, wide
    ranges, all one sign, all zero), at random block and candidate-piece widths: every
    draw must give the reference's positions exactly, with the loads issued first in the
    second half of the draws."""
    g = torch.Generator().manual_seed(100 + seed)
    rows = int(torch.randint(1, 5, (1,), generator=g))
    n_cols = int(torch.randint(20, 700, (1,), generator=g))
    topk = int(torch.randint(1, 90, (1,), generator=g))
    block = [16, 64, 128, 256][seed % 4]
    cand_block = [16, 32, 512][seed % 3]
    scale = [1e-3, 1.0, 1e4][seed % 3]
    scores = torch.randn(rows, n_cols, generator=g) * scale
    if seed % 2:
        scores = scores.abs().round()  # non-negative, many ties
    for r in range(rows):
        start = int(torch.randint(0, n_cols, (1,), generator=g))
        scores[r, start : start + int(torch.randint(0, 30, (1,), generator=g))] = float("-inf")
    qpos = torch.randint(0, n_cols, (rows,), generator=g)
    scores, qpos = scores.to(DEV), qpos.to(DEV)
    got = topk_positions(scores, qpos, topk, block=block, cand_block=cand_block)
    # Picks of masked keys (rows with fewer than k visible) are -1 where they fall; the
    # reference puts its -1s last.
    assert torch.equal(_sorted(got), topk_positions_reference(scores, qpos, topk))


def test_select_topk_reports_the_kth_score():
    scores = torch.tensor([[[5.0, 1.0, 3.0, 2.0, 4.0]], [[1.0, 2.0, 0.0, 0.0, 0.0]]])
    qpos = torch.tensor([[4], [1]])  # row 1 sees two keys: fewer than k
    idx, kth = select_topk(scores, qpos, 3, return_kth=True)
    assert idx[0, 0].tolist() == [0, 4, 2] and kth[0, 0].item() == 3.0
    assert idx[1, 0].tolist() == [1, 0, -1] and kth[1, 0].item() == float("-inf")
    assert torch.equal(select_topk(scores, qpos, 3), idx)
    _, short = select_topk(scores, qpos, 9, return_kth=True)  # top-k beyond the width
    assert short.tolist() == [[float("-inf")], [float("-inf")]]
