"""fp8 indexer-logits kernel vs a float64 reference, under the Triton interpreter on CPU."""

from __future__ import annotations

import pytest
import torch

from sglang_echo.kernels.indexer import fp8_index_logits, fp8_index_logits_reference
from sglang_echo.kernels.topk import select_topk

# Real kernels on a GPU machine, the Triton interpreter elsewhere (conftest sets it).
DEV = "cuda" if torch.cuda.is_available() else "cpu"
# fp8 products are exact in fp32; the CPU interpreter only reorders the sum, while Hopper's
# fp8 MMA accumulates 32-product chunks with reduced precision before promoting to fp32.
REL_TOL = 2e-4 if DEV == "cuda" else 1e-6


def _inputs(seed: int, batch: int = 3, heads: int = 16, dim: int = 32, length: int = 150):
    g = torch.Generator().manual_seed(seed)
    n_keys = batch * length + 1
    q = (torch.randn(batch, heads, dim, generator=g) * 2).to(torch.float8_e4m3fn)
    keys = (torch.randn(n_keys, dim, generator=g) * 2).to(torch.float8_e4m3fn)
    scales = torch.rand(n_keys, generator=g) + 0.5
    weights = torch.randn(batch, heads, generator=g)
    locs = torch.stack([torch.randperm(n_keys - 1, generator=g)[:length] + 1 for _ in range(batch)])
    seq_lens = torch.tensor([length, length // 2 + 3, 17][:batch], dtype=torch.int32)
    return tuple(t.to(DEV) for t in (q, weights, keys, scales, locs, seq_lens))


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
    assert rel < REL_TOL
    # Equal top-k sets (no exact ties in random data).
    k = 12
    pos = (args[5].long() - 1).view(-1, 1)
    a = select_topk(got.unsqueeze(1), pos, k).squeeze(1)
    b = select_topk(want.float().unsqueeze(1), pos, k).squeeze(1)
    for x, y in zip(a.tolist(), b.tolist(), strict=True):
        assert set(x) == set(y)


def test_fp8_logits_reject_non_fp8_inputs():
    q, w, keys, scales, locs, lens = _inputs(0)
    with pytest.raises(ValueError, match="float8"):
        fp8_index_logits(q.float(), w, keys, scales, locs, lens)


def test_fp8_logits_on_packed_rows_match_unpacked():
    from sglang_echo.model.indexer import pack_fp8_rows, unpack_fp8_rows

    q, w, keys, scales, locs, lens = _inputs(3)
    rows = pack_fp8_rows(keys, scales)
    k_view, s_view = unpack_fp8_rows(rows)
    assert k_view.data_ptr() == rows.data_ptr()  # views of the packed bytes, no copies
    assert torch.equal(s_view, scales) and torch.equal(
        k_view.view(torch.uint8), keys.view(torch.uint8)
    )
    got = fp8_index_logits(q, w, k_view, s_view, locs, lens)
    want = fp8_index_logits(q, w, keys, scales, locs, lens)
    assert torch.equal(got, want)
    # Rows padded to 144 bytes (16-byte aligned key rows): the same logits.
    padded = pack_fp8_rows(keys, scales, 144)
    assert padded.shape[-1] == 144 and int(padded[:, 132:].abs().sum()) == 0
    k_pad, s_pad = unpack_fp8_rows(padded, keys.shape[-1])
    assert torch.equal(fp8_index_logits(q, w, k_pad, s_pad, locs, lens), want)


def test_kernel_matches_the_models_torch_fp8_path():
    """The decode kernel and the model's CPU formula (fp8_index_scores) agree on top-k."""
    from sglang_echo.model.indexer import fp8_index_scores, pack_fp8_rows

    q, w, keys, scales, locs, lens = _inputs(5)
    rows = pack_fp8_rows(keys, scales)
    torch_scores = fp8_index_scores(q.unsqueeze(1), w.unsqueeze(1), rows[locs]).squeeze(1)
    pos = torch.arange(locs.shape[1], device=DEV)
    torch_scores = torch_scores.masked_fill(pos[None, :] >= lens[:, None].long(), float("-inf"))
    from sglang_echo.model.indexer import unpack_fp8_rows

    kernel = fp8_index_logits(q, w, *unpack_fp8_rows(rows), locs, lens)
    live = torch.isfinite(torch_scores)
    assert torch.equal(torch.isfinite(kernel), live)
    rel = ((kernel[live] - torch_scores[live]).norm() / torch_scores[live].norm()).item()
    assert rel < REL_TOL
    qpos = (lens.long() - 1).view(-1, 1)
    a = select_topk(kernel.unsqueeze(1), qpos, 10).squeeze(1)
    b = select_topk(torch_scores.unsqueeze(1), qpos, 10).squeeze(1)
    for r in range(a.shape[0]):
        # Sets may differ only between keys whose scores are within the kernel's rounding of
        # the k-th score (exactly equal sets on the CPU interpreter).
        kth = torch_scores[r, b[r]].min()
        scale = torch_scores[r][live[r]].abs().max()
        for key in set(a[r].tolist()) ^ set(b[r].tolist()):
            gap = (torch_scores[r, key] - kth).abs()
            assert DEV == "cuda" and gap <= 10 * REL_TOL * scale


@pytest.mark.parametrize("dim", [32, 64, 128])
def test_model_caches_16_byte_aligned_index_rows(dim):
    """The model's fp8 index rows are padded to a multiple of 16 bytes (144 for D 128), and
    the CPU scoring formula reads them exactly as it reads SGLang's unpadded rows."""
    from sglang_echo.model.config import fp8_row_bytes
    from sglang_echo.model.indexer import fp8_index_scores, pack_fp8_rows, quantize_fp8

    row_bytes = fp8_row_bytes(dim)
    assert row_bytes % 16 == 0 and dim + 4 <= row_bytes < dim + 20
    assert fp8_row_bytes(128) == 144
    g = torch.Generator().manual_seed(dim)
    keys, scales = quantize_fp8(torch.randn(30, dim, generator=g))
    q, _ = quantize_fp8(torch.randn(1, 2, 4, dim, generator=g).view(-1, dim))
    q = q.view(1, 2, 4, dim)
    w = torch.randn(1, 2, 4, generator=g)
    padded = pack_fp8_rows(keys, scales, row_bytes)
    plain = pack_fp8_rows(keys, scales)
    assert padded.shape == (30, row_bytes)
    assert torch.equal(
        fp8_index_scores(q, w, padded.unsqueeze(0)), fp8_index_scores(q, w, plain.unsqueeze(0))
    )
