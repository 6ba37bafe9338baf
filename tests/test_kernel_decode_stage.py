"""Staged decode prefetch (kernels/decode_stage.py, the staged recall in kernels/recall.py,
DecodePrefetcher's staged design): chunked logits equal whole ones bit for bit; the select
kernel stages exactly the reference's candidates (as a set: its order within a region
follows an atomic counter); the copy moves exactly the staged rows; the recall takes a
miss from the staging only when the entry is this layer-step's, and what it writes equals
the host rows either way. Triton runs under the interpreter on CPU."""

from __future__ import annotations

import pytest
import torch

from sglang_echo.kernels.cache_layout import ABSENT
from sglang_echo.kernels.decode_stage import (
    StagedRows,
    stage_copy,
    stage_copy_reference,
    stage_select,
    stage_select_reference,
    staged_entries,
)
from sglang_echo.kernels.indexer import fp8_index_logits
from sglang_echo.kernels.recall import recall_rows, recall_rows_reference

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _logit_inputs(seed: int, batch: int = 3, heads: int = 16, dim: int = 32, length: int = 150):
    g = torch.Generator().manual_seed(seed)
    n_keys = batch * length + 2
    q = (torch.randn(batch, heads, dim, generator=g) * 2).to(torch.float8_e4m3fn)
    keys = (torch.randn(n_keys, dim, generator=g) * 2).to(torch.float8_e4m3fn)
    scales = torch.rand(n_keys, generator=g) + 0.5
    weights = torch.randn(batch, heads, generator=g)
    locs = torch.stack([torch.randperm(n_keys - 2, generator=g)[:length] + 1 for _ in range(batch)])
    seq_lens = torch.tensor([length, length // 2 + 3, 17][:batch], dtype=torch.int32)
    return tuple(t.to(DEV) for t in (q, weights, keys, scales, locs, seq_lens))


@pytest.mark.parametrize(("block_n", "blocks"), [(16, 1), (16, 2)])
def test_chunked_logits_equal_whole_logits(block_n, blocks):
    q, w, keys, scales, locs, lens = _logit_inputs(block_n + blocks)
    params = dict(block_n=block_n, blocks_per_program=blocks)
    whole = fp8_index_logits(q, w, keys, scales, locs, lens, **params)
    out = torch.full_like(whole, float("nan"))
    span = block_n * blocks
    bounds = [(0, 2 * span), (2 * span, 3 * span), (3 * span, whole.shape[1])]
    for start, end in bounds:
        fp8_index_logits(q, w, keys, scales, locs, lens, out=out, start=start, end=end, **params)
    assert torch.equal(out, whole)  # every position written once, same bits
    with pytest.raises(ValueError, match="multiples"):
        fp8_index_logits(q, w, keys, scales, locs, lens, out=out, start=span + 1, **params)


def _stage_inputs(seed: int, batch: int = 3, length: int = 300, tokens: int = 1000):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(batch, length, generator=g)
    locs = torch.stack([torch.randperm(tokens, generator=g)[:length] + 1 for _ in range(batch)])
    lens = torch.tensor([length, length // 2, 7][:batch])
    theta = torch.tensor([0.5, -float("inf"), float("inf")][:batch], dtype=torch.float32)
    resident = torch.rand(tokens + 2, generator=g) < 0.4
    h2d = torch.where(resident, torch.arange(tokens + 2, dtype=torch.int32), ABSENT)
    return tuple(t.to(DEV) for t in (scores, locs, lens, theta, h2d.to(torch.int32)))


def _buffers(chunks: int, rows: int, cap: int, tokens: int = 1000):
    entries = chunks * rows * cap
    return (
        torch.full((entries,), -1, dtype=torch.int64, device=DEV),
        torch.zeros(chunks * rows, dtype=torch.int32, device=DEV),
        torch.full((tokens + 2,), 7, dtype=torch.int32, device=DEV),  # stale everywhere
    )


def _candidates(scores, locs, lens, theta, h2d, start, end, b) -> list[int]:
    return [
        int(locs[b, n])
        for n in range(start, min(end, int(lens[b])))
        if scores[b, n] > theta[b] and int(h2d[int(locs[b, n])]) == ABSENT
    ]


@pytest.mark.parametrize("cap", [400, 40], ids=["room", "overflow"])
def test_select_stages_the_reference_candidates(cap):
    scores, locs, lens, theta, h2d = _stage_inputs(1)
    chunks, rows = 2, 4  # more request rows than the batch, as in the runtime
    ker, ref = _buffers(chunks, rows, cap), _buffers(chunks, rows, cap)
    bounds = [(0, 160), (160, 300)]
    for chunk, (start, end) in enumerate(bounds):
        region = chunk * rows * cap
        for fn, (ids, counts, smap) in ((stage_select, ker), (stage_select_reference, ref)):
            view = counts[chunk * rows : (chunk + 1) * rows]
            fn(scores, locs, lens, theta, h2d, start, end, ids, view, smap, region, cap)
    assert torch.equal(ker[1], ref[1])  # counts (uncapped)
    for chunk, (start, end) in enumerate(bounds):
        for b in range(3):
            want = _candidates(scores, locs, lens, theta, h2d, start, end, b)
            assert int(ker[1][chunk * rows + b]) == len(want)
            first = chunk * rows * cap + b * cap
            got = ker[0][first : first + min(len(want), cap)].tolist()
            assert ref[0][first : first + min(len(want), cap)].tolist() == want[:cap]
            assert len(set(got)) == len(got) and set(got) <= set(want)
            if len(want) <= cap:
                assert sorted(got) == sorted(want)
            for token in got:  # the map points at a valid entry holding the token (an
                # id in two requests' contexts: either request's entry)
                assert int(ker[0][int(ker[2][token])]) == token
    assert int(ker[1][1]) > 0 and int(ker[1][2]) == 0  # row 1 stages, row 2 (+inf) not


def test_copy_moves_exactly_the_staged_rows():
    g = torch.Generator().manual_seed(2)
    chunks, rows, cap = 2, 3, 5
    host = torch.randint(0, 256, (50, 40), generator=g, dtype=torch.uint8).to(DEV)
    ids = torch.randint(1, 50, (chunks * rows * cap,), generator=g).to(DEV)
    counts = torch.tensor([5, 0, 9, 2, 1, 0], dtype=torch.int32, device=DEV)  # 9: > cap
    ker = torch.zeros(chunks * rows * cap, 40, dtype=torch.uint8, device=DEV)
    ref = ker.clone()
    for chunk in range(chunks):
        view = counts[chunk * rows : (chunk + 1) * rows]
        region = chunk * rows * cap
        stage_copy(host, ker, ids, view, region, batch=2, cap=cap)  # row 2 not in batch
        stage_copy_reference(host, ref, ids, view, region, batch=2, cap=cap)
    assert torch.equal(ker, ref)
    copied = [*range(0, 5), 15, 16, 20]  # chunk 0 row 0; chunk 1 rows 0 and 1 (row 2: no batch)
    assert torch.equal(ker[copied], host[ids[copied]])
    others = [i for i in range(ker.shape[0]) if i not in copied]
    assert (ker[others] == 0).all()


def test_recall_takes_only_valid_staged_rows():
    """Misses 3..8: 3 and 4 validly staged; 5's map entry names another token; 6's entry
    lies past its region's count; 7 is staged but its map entry is stale (-> host); 8's
    entry is out of range. Staged rows are poisoned copies, so the source shows."""
    g = torch.Generator().manual_seed(3)
    host = torch.randint(0, 200, (12, 24), generator=g, dtype=torch.uint8).to(DEV)
    cap, rows = 4, 2
    stage_rows = torch.full((2 * rows * cap, 24), 255, dtype=torch.uint8, device=DEV)
    stage_ids = torch.full((2 * rows * cap,), -1, dtype=torch.int64, device=DEV)
    counts = torch.tensor([2, 1, 0, 0], dtype=torch.int32, device=DEV)
    smap = torch.zeros(14, dtype=torch.int32, device=DEV)
    stage_ids[0], stage_ids[1], stage_ids[4] = 3, 7, 4  # region 0: row 0 lanes 0-1, row 1
    stage_ids[2] = 6  # lane 2 of row 0: past its count
    smap[3], smap[4], smap[5], smap[6], smap[7], smap[8] = 0, 4, 1, 2, 4, 99
    stage_rows[0], stage_rows[4] = host[3], host[4]  # what a real copy would hold
    miss_ids = torch.tensor([3, 4, 5, 6, 7, 8, 0, 0], device=DEV)
    miss_slots = torch.tensor([1, 2, 3, 4, 5, 6, 0, 0], device=DEV)
    count = torch.tensor([6], device=DEV)
    want = staged_entries(miss_ids[:6], smap, stage_ids, counts, cap)
    assert want.tolist() == [0, 4, -1, -1, -1, -1]
    results = []
    for recall in (recall_rows, recall_rows_reference):
        dev = torch.zeros(8, 24, dtype=torch.uint8, device=DEV)
        hits = torch.zeros(1, dtype=torch.int64, device=DEV)
        staged = StagedRows(stage_rows, smap, stage_ids, counts, cap, hits)
        recall(host, dev, miss_ids, miss_slots, count, staged=staged)
        assert int(hits) == 2
        assert torch.equal(dev[1:7], host[3:9])
        results.append(dev)
    assert torch.equal(*results)
    stage_rows[0] = 0  # a staged row is read from the staging, not the host
    dev = torch.zeros(8, 24, dtype=torch.uint8, device=DEV)
    hits = torch.zeros(1, dtype=torch.int64, device=DEV)
    staged = StagedRows(stage_rows, smap, stage_ids, counts, cap, hits)
    recall_rows(host, dev, miss_ids, miss_slots, count, staged=staged)
    assert (dev[1] == 0).all() and torch.equal(dev[2:7], host[4:9])
