"""The plugin's top-k -> host ids -> rows kernels (kernels/topk_rows.py) against their
torch reference, on every kind of lane: padding (-1), positions past the sequence, the
current token (the newest row), rows past the real requests (graph padding), a request
without ECHO state (newest row 0), top-k rows past the requests, an empty batch, int32 and
int64 inputs, a strided top-k and a static table wider than the top-k. Triton runs under
the interpreter on CPU."""

from __future__ import annotations

import pytest
import torch

from sglang_echo.kernels.topk_rows import host_ids, host_ids_reference, rows, rows_reference

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _batch(seed: int, n: int, extra_rows: int, width: int, index_dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    pool, positions = 6, 40
    req = torch.randperm(pool, generator=g)[:n].to(index_dtype)
    seq = torch.randint(10, positions + 1, (n,), generator=g).to(index_dtype)
    newest = torch.randint(100, 200, (pool,), generator=g)
    if n >= 3:
        newest[int(req[0])] = 0  # a request without ECHO state (the capture-time dummy)
    req_to_host = torch.randint(1, 5000, (pool, positions), generator=g)
    # Wider than the top-k and strided: sglang's top-k is a view of a padded buffer.
    raw = torch.randint(-1, positions + 5, (n + extra_rows, 2 * width), generator=g)
    topk = raw[:, ::2].to(torch.int32)
    for i in range(n):  # every row selects its current token once
        topk[i, i % width] = int(seq[i]) - 1
    # From three rows on, the last real-looking row is CUDA-graph padding.
    num_real = torch.tensor([n - 1 if n >= 3 else n])
    return tuple(t.to(DEV) for t in (topk, req, seq, newest, req_to_host, num_real))


@pytest.mark.parametrize(
    ("n", "extra_rows", "width", "index_dtype"),
    [(4, 0, 16, torch.int64), (3, 2, 37, torch.int32), (1, 3, 2048, torch.int64)],
    ids=["rows-equal-requests", "padded-top-k-rows-int32", "top-k-2048"],
)
def test_kernels_match_the_reference(n, extra_rows, width, index_dtype):
    topk, req, seq, newest, req_to_host, num_real = _batch(n, n, extra_rows, width, index_dtype)
    ids = host_ids(topk, req, seq, newest, req_to_host, num_real)
    want = host_ids_reference(topk, req, seq, newest, req_to_host, num_real)
    assert torch.equal(ids, want)
    assert (want >= 0).any() and (want == -1).any()  # both kinds of lane occur
    # Slots as a resolve would give them: some lanes got none.
    slots = torch.where(ids >= 0, ids % 97, torch.full_like(ids, -1))
    table = torch.full((n + extra_rows + 2, width + 5), 7, dtype=torch.int32, device=DEV)
    got, ref = table.clone(), table.clone()
    view = (slice(0, n + extra_rows), slice(0, width))
    rows(slots, topk, req, seq, newest, num_real, 1000, got[view])
    rows_reference(slots, topk, req, seq, newest, num_real, 1000, ref[view])
    assert torch.equal(got, ref)
    assert (got[view][n:] == -1).all()  # top-k rows past the requests select nothing
    assert (got[n + extra_rows :] == 7).all() and (got[:, width:] == 7).all()  # untouched
    is_newest = (got[view][:n] >= 100) & (got[view][:n] < 200)
    assert is_newest.any(), "no lane took its request's newest row"


def test_an_empty_batch_writes_padding_only():
    topk, req, seq, newest, req_to_host, num_real = _batch(0, 0, 3, 8, torch.int64)
    assert host_ids(topk, req, seq, newest, req_to_host, num_real).shape == (0, 8)
    got = torch.zeros(3, 8, dtype=torch.int32, device=DEV)
    ref = got.clone()
    rows(None, topk, req, seq, newest, num_real, 10, got)
    rows_reference(None, topk, req, seq, newest, num_real, 10, ref)
    assert torch.equal(got, ref) and (got == -1).all()
    one = _batch(1, 1, 0, 8, torch.int64)
    with pytest.raises(ValueError, match="slots are needed"):
        rows(None, *one[:4], one[5], 10, got[:1])
