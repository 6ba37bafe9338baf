"""The plugin's top-k -> host ids -> rows kernels (kernels/topk_rows.py) against their
torch reference, on every kind of lane: padding (-1), positions past the sequence, ring
positions (the request's newest decoded tokens, rows of its own page, the current token
included), earlier positions (host ids), rows past the real requests (graph padding), a
request without ECHO state (page 0), top-k rows past the requests, an empty batch, int32
and int64 inputs, a strided top-k and a static table wider than the top-k; and the
reference against a lane-by-lane reading of the rule. Triton runs under the interpreter
on CPU."""

from __future__ import annotations

import pytest
import torch

from sglang_echo.kernels.topk_rows import (
    RING,
    host_ids,
    host_ids_reference,
    rows,
    rows_reference,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _batch(seed: int, n: int, extra_rows: int, width: int, index_dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    pool, positions = 6, 200
    req = torch.randperm(pool, generator=g)[:n].to(index_dtype)
    seq = torch.randint(10, positions + 1, (n,), generator=g).to(index_dtype)
    # Each request's ring: the 64 rows of its page, in any order (sglang's allocator).
    ring = torch.stack(
        [RING * int(k) + torch.randperm(RING, generator=g) for k in range(2, 2 + pool)]
    )
    # Where each request's ring starts (it entered decode there): before, inside or at
    # the start of the last RING positions.
    ring_start = torch.randint(0, positions, (pool,), generator=g)
    for i in range(n):
        ring_start[int(req[i])] = min(int(ring_start[int(req[i])]), int(seq[i]) - 1)
    if n >= 3:
        ring[int(req[0])] = 0  # a request without ECHO state (the capture-time dummy)
    req_to_host = torch.randint(1, 5000, (pool, positions), generator=g)
    # Wider than the top-k and strided: sglang's top-k is a view of a padded buffer.
    raw = torch.randint(-1, positions + 5, (n + extra_rows, 2 * width), generator=g)
    topk = raw[:, ::2].to(torch.int32)
    for i in range(n):  # every row selects its current token once
        topk[i, i % width] = int(seq[i]) - 1
    # From three rows on, the last real-looking row is CUDA-graph padding.
    num_real = torch.tensor([n - 1 if n >= 3 else n])
    return tuple(t.to(DEV) for t in (topk, req, seq, ring, ring_start, req_to_host, num_real))


def _rule(topk, req, seq, ring, ring_start, req_to_host, num_real, slots, row_base):
    """Lane by lane, as the module docstring states it: (host id, table row)."""
    ids, table = [], []
    for i in range(req.shape[0]):
        r, s = int(req[i]), int(seq[i])
        lo = max(int(ring_start[r]), s - RING)
        live = i < int(num_real[0]) and int(ring[r, 0]) > 0
        row_ids, row_table = [], []
        for j, p in enumerate(topk[i].tolist()):
            if not live or p < 0 or p >= s:
                row_ids.append(-1)
                row_table.append(-1)
            elif p >= lo:
                row_ids.append(-1)
                row_table.append(int(ring[r, p % RING]))
            else:
                row_ids.append(int(req_to_host[r, p]))
                slot = int(slots[i, j])
                row_table.append(slot + row_base if slot >= 0 else -1)
        ids.append(row_ids)
        table.append(row_table)
    return ids, table


@pytest.mark.parametrize(
    ("n", "extra_rows", "width", "index_dtype"),
    [(4, 0, 16, torch.int64), (3, 2, 37, torch.int32), (1, 3, 2048, torch.int64)],
    ids=["rows-equal-requests", "padded-top-k-rows-int32", "top-k-2048"],
)
def test_kernels_match_the_reference(n, extra_rows, width, index_dtype):
    batch = _batch(n, n, extra_rows, width, index_dtype)
    topk, req, seq, ring, ring_start, _req_to_host, num_real = batch
    ids = host_ids(*batch)
    want = host_ids_reference(*batch)
    assert torch.equal(ids, want)
    assert (want >= 0).any() and (want == -1).any()  # both kinds of lane occur
    # Slots as a resolve would give them: some lanes got none.
    slots = torch.where(ids >= 0, ids % 97, torch.full_like(ids, -1))
    table = torch.full((n + extra_rows + 2, width + 5), 7, dtype=torch.int32, device=DEV)
    got, ref = table.clone(), table.clone()
    view = (slice(0, n + extra_rows), slice(0, width))
    rows(slots, topk, req, seq, ring, ring_start, num_real, 100_000, got[view])
    rows_reference(slots, topk, req, seq, ring, ring_start, num_real, 100_000, ref[view])
    assert torch.equal(got, ref)
    assert (got[view][n:] == -1).all()  # top-k rows past the requests select nothing
    assert (got[n + extra_rows :] == 7).all() and (got[:, width:] == 7).all()  # untouched
    rule_ids, rule_table = _rule(*(t.cpu() for t in batch), slots.cpu(), 100_000)
    assert want.cpu().tolist() == rule_ids
    assert got[view][:n].cpu().tolist() == rule_table
    in_ring = (got[view][:n] > 0) & (got[view][:n] < 100_000)
    assert in_ring.any(), "no lane took a row of its request's ring"


def test_an_empty_batch_writes_padding_only():
    batch = _batch(0, 0, 3, 8, torch.int64)
    topk, req, seq, ring, ring_start, _req_to_host, num_real = batch
    assert host_ids(*batch).shape == (0, 8)
    got = torch.zeros(3, 8, dtype=torch.int32, device=DEV)
    ref = got.clone()
    rows(None, topk, req, seq, ring, ring_start, num_real, 10, got)
    rows_reference(None, topk, req, seq, ring, ring_start, num_real, 10, ref)
    assert torch.equal(got, ref) and (got == -1).all()
    one = _batch(1, 1, 0, 8, torch.int64)
    with pytest.raises(ValueError, match="slots are needed"):
        rows(None, *one[:5], one[6], 10, got[:1])
