"""fp8 indexer-logits kernel vs a float64 reference, under the Triton interpreter on CPU."""

from __future__ import annotations

import pytest
import torch

from sglang_echo.kernels.indexer import fp8_index_logits, fp8_index_logits_reference
from sglang_echo.model.indexer import select_topk


def _inputs(seed: int, batch: int = 3, heads: int = 16, dim: int = 32, length: int = 150):
    g = torch.Generator().manual_seed(seed)
    n_keys = batch * length + 1
    q = (torch.randn(batch, heads, dim, generator=g) * 2).to(torch.float8_e4m3fn)
    keys = (torch.randn(n_keys, dim, generator=g) * 2).to(torch.float8_e4m3fn)
    scales = torch.rand(n_keys, generator=g) + 0.5
    weights = torch.randn(batch, heads, generator=g)
    locs = torch.stack([torch.randperm(n_keys - 1, generator=g)[:length] + 1 for _ in range(batch)])
    seq_lens = torch.tensor([length, length // 2 + 3, 17][:batch], dtype=torch.int32)
    return q, weights, keys, scales, locs, seq_lens


@pytest.mark.parametrize(
    ("block_n", "blocks", "keys_as_m"),
    [(16, 1, False), (64, 1, True), (16, 4, True), (32, 2, False)],
)
def test_fp8_logits_match_float64_reference(block_n, blocks, keys_as_m):
    args = _inputs(block_n + blocks)
    got = fp8_index_logits(*args, block_n=block_n, blocks_per_program=blocks, keys_as_m=keys_as_m)
    want = fp8_index_logits_reference(*args)
    live = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), live)  # -inf exactly beyond each seq_len
    rel = ((got[live].double() - want[live]).norm() / want[live].norm()).item()
    assert rel < 1e-6  # fp8 products are exact in fp32; only the summation order differs
    # Equal top-k sets (no exact ties in random data).
    k = 12
    pos = torch.stack([torch.tensor(int(n) - 1) for n in args[5]]).view(-1, 1)
    a = select_topk(got.unsqueeze(1), pos, k).squeeze(1)
    b = select_topk(want.float().unsqueeze(1), pos, k).squeeze(1)
    for x, y in zip(a.tolist(), b.tolist(), strict=True):
        assert set(x) == set(y)


def test_fp8_logits_reject_non_fp8_inputs():
    q, w, keys, scales, locs, lens = _inputs(0)
    with pytest.raises(ValueError, match="float8"):
        fp8_index_logits(q.float(), w, keys, scales, locs, lens)
