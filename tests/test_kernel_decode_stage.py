"""Staged decode prefetch (kernels/decode_stage.py, the staged recall in kernels/recall.py,
DecodePrefetcher): chunked logits equal whole ones bit for bit; the select
kernel stages exactly the reference's candidates (as a set: its order within a region
follows an atomic counter); the copy moves exactly the staged rows; the recall takes a
miss from the staging only when the entry is this layer-step's, and what it writes equals
the host rows either way. Triton runs under the interpreter on CPU."""

from __future__ import annotations

import itertools

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
from sglang_echo.offload.decode_prefetcher import DecodePrefetcher
from sglang_echo.offload.device_cache import DeviceCache
from sglang_echo.offload.host_pool import HostKVPool
from sglang_echo.offload.manager import EchoManager
from sglang_echo.offload.predictor import DecodeThresholdPredictor

STATE = ("host_to_device", "device_to_host", "priority", "free_stack", "free_count", "clock")

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(seed: int, batch: int = 3, heads: int = 16, dim: int = 32, length: int = 150):
    g = torch.Generator().manual_seed(seed)
    n_keys = batch * length + 2
    q = (torch.randn(batch, heads, dim, generator=g) * 2).to(torch.float8_e4m3fn)
    keys = (torch.randn(n_keys, dim, generator=g) * 2).to(torch.float8_e4m3fn)
    scales = torch.rand(n_keys, generator=g) + 0.5
    weights = torch.randn(batch, heads, generator=g)
    locs = torch.stack([torch.randperm(n_keys - 2, generator=g)[:length] + 1 for _ in range(batch)])
    seq_lens = torch.tensor([length, length // 2 + 3, 17][:batch], dtype=torch.int32)
    resident = torch.rand(n_keys, generator=g) < 0.4
    h2d = torch.where(resident, torch.arange(n_keys, dtype=torch.int32), ABSENT).to(torch.int32)
    return tuple(t.to(DEV) for t in (q, weights, keys, scales, locs, seq_lens, h2d))


@pytest.mark.parametrize(("block_n", "blocks"), [(16, 1), (16, 2)])
def test_chunked_logits_equal_whole_logits(block_n, blocks):
    q, w, keys, scales, locs, lens = _inputs(block_n + blocks)[:6]
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


def _buffers(chunks: int, cap: int, tokens: int = 1000):
    return (
        torch.full((chunks * cap,), -1, dtype=torch.int64, device=DEV),
        torch.zeros(chunks, dtype=torch.int32, device=DEV),
        torch.full((tokens + 2,), 7, dtype=torch.int32, device=DEV),  # stale everywhere
    )


def _candidates(scores, locs, lens, theta, h2d, start, end) -> list[int]:
    """The chunk's candidates of every request, in (request, position) order."""
    return [
        int(locs[b, n])
        for b in range(scores.shape[0])
        for n in range(start, min(end, int(lens[b])))
        if scores[b, n] > theta[b] and int(h2d[int(locs[b, n])]) == ABSENT
    ]


@pytest.mark.parametrize("cap", [400, 40], ids=["room", "overflow"])
def test_select_stages_the_reference_candidates(cap):
    scores, locs, lens, theta, h2d = _stage_inputs(1)
    chunks = 2
    ker, ref = _buffers(chunks, cap), _buffers(chunks, cap)
    bounds = [(0, 160), (160, 300)]
    for chunk, (start, end) in enumerate(bounds):
        for fn, (ids, counts, smap) in ((stage_select, ker), (stage_select_reference, ref)):
            count = counts[chunk : chunk + 1]
            fn(scores, locs, lens, theta, h2d, start, end, ids, count, smap, chunk * cap, cap)
    assert torch.equal(ker[1], ref[1])  # counts (uncapped)
    for chunk, (start, end) in enumerate(bounds):
        want = _candidates(scores, locs, lens, theta, h2d, start, end)
        assert int(ker[1][chunk]) == len(want) > 0
        kept = min(len(want), cap)
        got = ker[0][chunk * cap : chunk * cap + kept].tolist()
        assert ref[0][chunk * cap : chunk * cap + kept].tolist() == want[:cap]
        pool = list(want)  # got is a sub-multiset of want (a token in two requests twice)
        for token in got:
            pool.remove(token)
        if len(want) <= cap:
            assert not pool
        for token in got:  # the map points at an entry holding the token
            assert int(ker[0][int(ker[2][token])]) == token


def test_copy_moves_exactly_the_staged_rows():
    g = torch.Generator().manual_seed(2)
    chunks, cap = 3, 5
    host = torch.randint(0, 256, (50, 40), generator=g, dtype=torch.uint8).to(DEV)
    ids = torch.randint(1, 50, (chunks * cap,), generator=g).to(DEV)
    counts = torch.tensor([3, 0, 9], dtype=torch.int32, device=DEV)  # 9: > cap
    ker = torch.zeros(chunks * cap, 40, dtype=torch.uint8, device=DEV)
    ref = ker.clone()
    totals = torch.zeros(2, dtype=torch.int64, device=DEV)
    for chunk in range(chunks):
        count = counts[chunk : chunk + 1]
        stage_copy(host, ker, ids, count, totals[0:1], chunk * cap, cap)
        stage_copy_reference(host, ref, ids, count, totals[1:2], chunk * cap, cap)
    assert torch.equal(ker, ref)
    copied = [0, 1, 2, *range(10, 15)]  # chunk 0's three rows; chunk 2 up to the cap
    assert torch.equal(ker[copied], host[ids[copied]])
    others = [i for i in range(ker.shape[0]) if i not in copied]
    assert (ker[others] == 0).all()
    assert totals.tolist() == [8, 8]


def test_recall_takes_only_valid_staged_rows():
    """Misses 3..8: 3 and 4 validly staged; 5's map entry holds another token; 6's entry
    lies past its chunk's count; 7 is staged but its map entry is stale (-> host); 8's
    entry is out of range; a stale entry inside the region but past this step's limit
    (token 9) is not taken either. Staged rows are poisoned copies, so the source shows."""
    g = torch.Generator().manual_seed(3)
    host = torch.randint(0, 200, (12, 24), generator=g, dtype=torch.uint8).to(DEV)
    cap, limit = 4, 3  # entries per chunk, of which this step may fill 3
    stage_rows = torch.full((2 * cap, 24), 255, dtype=torch.uint8, device=DEV)
    stage_ids = torch.full((2 * cap,), -1, dtype=torch.int64, device=DEV)
    counts = torch.tensor([2, 9], dtype=torch.int32, device=DEV)
    smap = torch.zeros(14, dtype=torch.int32, device=DEV)
    stage_ids[0], stage_ids[1], stage_ids[4] = 3, 7, 4  # chunk 0: 3 and 7; chunk 1: 4
    stage_ids[2] = 6  # chunk 0 lane 2: past its count
    stage_ids[7] = 9  # chunk 1 lane 3: past the limit (an earlier step's entry)
    smap[3], smap[4], smap[5], smap[6], smap[7], smap[8], smap[9] = 0, 4, 1, 2, 4, 99, 7
    stage_rows[0], stage_rows[4] = host[3], host[4]  # what a real copy would hold
    miss_ids = torch.tensor([3, 4, 5, 6, 7, 8, 9, 0], device=DEV)
    miss_slots = torch.tensor([1, 2, 3, 4, 5, 6, 7, 0], device=DEV)
    count = torch.tensor([7], device=DEV)

    def staging(hits):
        return StagedRows(stage_rows, smap, stage_ids, counts, cap, limit, hits)

    want = staged_entries(miss_ids[:7], staging(None))
    assert want.tolist() == [0, 4, -1, -1, -1, -1, -1]
    results = []
    for recall in (recall_rows, recall_rows_reference):
        dev = torch.zeros(8, 24, dtype=torch.uint8, device=DEV)
        hits = torch.zeros(1, dtype=torch.int64, device=DEV)
        recall(host, dev, miss_ids, miss_slots, count, staged=staging(hits))
        assert int(hits) == 2
        assert torch.equal(dev[1:8], host[3:10])
        results.append(dev)
    assert torch.equal(*results)
    stage_rows[0] = 0  # a staged row is read from the staging, not the host
    dev = torch.zeros(8, 24, dtype=torch.uint8, device=DEV)
    hits = torch.zeros(1, dtype=torch.int64, device=DEV)
    recall_rows(host, dev, miss_ids, miss_slots, count, staged=staging(hits))
    assert (dev[1] == 0).all() and torch.equal(dev[2:8], host[4:10])


def _steps(
    use_kernels: bool,
    staged: bool,
    seed: int,
) -> tuple[EchoManager, list]:
    """Decode steps of one layer (3 requests x 96 positions, top-12, a 40-slot cache
    under eviction): scores, a threshold near the 12th score (some misses staged, some
    staged rows not selected), the staged prefetch over three chunks, then the resolve.
    Returns the manager and the rows attention would read at each step."""
    tokens, batch, length, k = 300, 3, 96, 12
    host = HostKVPool(1, tokens, 8, torch.float32, pin=DEV == "cuda")
    cache = DeviceCache(1, 40, tokens, 8, torch.float32, DEV)
    m = EchoManager(host, cache, use_kernels=use_kernels)
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(tokens, 8, generator=g)
    m.write_host(0, torch.arange(1, tokens + 1, device=DEV), rows.to(DEV))
    p = DecodePrefetcher(m, max_rows=4, cap=24, chunks=3)
    locs = torch.stack([torch.randperm(tokens, generator=g)[:length] + 1 for _ in range(batch)])
    locs, lens = locs.to(DEV), torch.tensor([96, 80, 50], device=DEV)
    reads = []
    for step in range(5):
        scores = torch.randn(batch, length, generator=g).to(DEV)
        pos = torch.arange(length, device=DEV)
        scores = scores.masked_fill(pos[None, :] >= lens[:, None], float("-inf"))
        top = scores.topk(k, dim=1)
        theta = top.values[:, k - 1] - 0.3 * (step % 2)  # exact, then a little low
        if staged:
            for i, (start, end) in enumerate(p.chunk_bounds(length, 16)):
                p.stage(0, i, scores, locs, lens, theta.float(), start, end)
            p.finish(0, scores, top.indices, torch.arange(batch, device=DEV))
        sel = locs.gather(1, top.indices)
        slots = m.resolve(0, sel)
        got = cache.rows[0][slots.view(-1)]
        assert torch.equal(got.cpu(), rows[sel.view(-1).cpu() - 1])
        reads.append(got.cpu())
    return m, reads


@pytest.mark.parametrize("seed", range(2))
def test_staged_prefetch_reads_what_the_plain_resolve_reads(seed):
    """Bits and cache state as without prefetch, kernels and reference alike; staged rows
    were recalled from the staging."""
    plain, plain_reads = _steps(use_kernels=False, staged=False, seed=seed)
    for use_kernels in (False, True):
        m, reads = _steps(use_kernels, staged=True, seed=seed)
        assert all(torch.equal(a, b) for a, b in zip(plain_reads, reads, strict=True))
        for name in STATE:
            assert torch.equal(getattr(m.cache, name), getattr(plain.cache, name)), name
        staged, used = int(m.prefetched_rows[0]), int(m.prefetch_hits[0])
        assert 0 < used <= staged and used <= int(m.cache.misses[0])


@pytest.mark.parametrize("length", [0, 7, 64, 96, 1000])
@pytest.mark.parametrize("chunks", [1, 2, 3])
def test_chunk_bounds_tile_the_table(chunks, length):
    """Chunks cover [0, length) once, in order, start on a program's span, never outnumber
    the staging regions, split evenly."""
    m = EchoManager(
        HostKVPool(1, 8, 4, torch.float32, pin=False), DeviceCache(1, 8, 8, 4, torch.float32, DEV)
    )
    p = DecodePrefetcher(m, max_rows=2, cap=6, chunks=chunks)
    span = 16
    bounds = p.chunk_bounds(length, span)
    assert 1 <= len(bounds) <= chunks
    assert bounds[0][0] == 0 and bounds[-1][1] == length
    assert all(e0 == s1 for (_, e0), (s1, _) in itertools.pairwise(bounds))
    assert all(s < e for s, e in bounds) or bounds == [(0, 0)]
    assert all(s % span == 0 for s, _ in bounds)
    assert len({e - s for s, e in bounds[:-1]}) <= 1  # even chunks, the last one the rest


def test_stats_count_the_staging_buffer():
    """The start-up log's device bytes include the staging buffer when decode prefetch is
    on: request rows x rows per request x row bytes, plus its index (ids, a counter per
    chunk, the host-id map) and each layer's thresholds (float32 and bool per request row
    and a scratch row)."""
    from sglang_echo.config import EchoConfig, default_stage_rows
    from sglang_echo.offload.echo_cache import EchoKVCache

    def cache(mode: str) -> EchoKVCache:
        config = EchoConfig(offload=True, dev_cache_size=64, fuse_decode=mode)
        kv = EchoKVCache(config, 2, 100, 16, 8, torch.float32, DEV, pin=False)
        kv.bind_request_rows(4)
        return kv

    off, on = cache("0"), cache("auto")
    p = on.decode_prefetcher
    assert p.cap == default_stage_rows(16 * 4)  # float32 rows of 16
    rows = p.chunks * 4 * p.chunk_cap
    assert rows == 4 * p.cap  # rows x rows per request
    thresholds = 2 * (4 + 1) * (4 + 1)  # 2 layers x (float32 + bool) x (4 rows + scratch)
    want = rows * 16 * 4 + rows * 8 + p.chunks * 4 + (100 + 2) * 4 + thresholds
    assert on.stats()["device_bytes"] - off.stats()["device_bytes"] == want == p.nbytes


def test_default_staged_rows_follow_the_rows_bytes():
    """The default stages a byte budget per request (what fits beside the logits and the
    top-k): 512 bf16 rows of 1152 bytes, 896 fp8 rows of 656 bytes, in 64-row steps,
    between 64 rows and 1536."""
    from sglang_echo.config import MAX_STAGE_ROWS, default_stage_rows

    assert default_stage_rows(1152) == 512 and default_stage_rows(656) == 896
    assert default_stage_rows(64) == MAX_STAGE_ROWS == 1536
    assert default_stage_rows(10**6) == 64
    with pytest.raises(ValueError, match="row_bytes"):
        default_stage_rows(0)


def test_prefetcher_thresholds_per_layer_and_row():
    m = EchoManager(
        HostKVPool(2, 10, 4, torch.float32, pin=False),
        DeviceCache(2, 8, 10, 4, torch.float32, DEV),
    )
    p = DecodePrefetcher(m, max_rows=3, cap=64)
    rows = torch.tensor([0, 2], device=DEV)
    assert torch.isinf(p.theta(0, rows)).all()  # no prediction: stage nothing

    def learn(kth: list[float]) -> None:  # a top-k of one whose score is the k-th
        scores = torch.tensor(kth, device=DEV).view(-1, 1)
        p.observe_topk(1, scores, torch.zeros(2, 1, dtype=torch.int64, device=DEV), rows)

    learn([4.0, 2.0])
    learn([2.0, 2.0])
    assert p.theta(1, rows).tolist() == [3.0, 2.0]  # EMA, alpha 0.5
    assert torch.isinf(p.theta(0, rows)).all()  # layers keep their own thresholds
    p.reset_rows([2])
    assert p.theta(1, rows)[0].item() == 3.0 and p.theta(1, rows)[1].item() == float("inf")
    with pytest.raises(ValueError, match="cap"):
        DecodePrefetcher(m, 3, cap=0)


@pytest.mark.parametrize("use_kernels", [True, False], ids=["kernel", "reference"])
def test_thresholds_from_the_topk_match_exact_topk_kth(use_kernels):
    """observe_topk (with the kernels one launch: k-th score from the top-k, then the EMA)
    leaves the same thresholds bit for bit as exact_topk's k-th score through the
    predictor's torch update, including rows that see fewer than k keys (-inf) and steps
    back to finite."""
    from sglang_echo.model.indexer import exact_topk

    m = EchoManager(
        HostKVPool(1, 10, 4, torch.float32, pin=False),
        DeviceCache(1, 8, 10, 4, torch.float32, DEV),
        use_kernels=use_kernels,
    )
    ref, ker = DecodeThresholdPredictor(6, DEV), DecodePrefetcher(m, 6, cap=8)
    g = torch.Generator().manual_seed(5)
    k = 8
    for step in range(5):
        scores = (torch.randn(4, 40, generator=g) * 3).to(DEV)
        qpos = torch.tensor([39, 20, 5 if step % 2 else 30, 39], device=DEV)  # row 2: < k keys
        visible = torch.arange(40, device=DEV)[None, :] <= qpos[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        rows = torch.randperm(6, generator=g)[:4].to(DEV)
        pos, kth = exact_topk(scores, qpos, k, use_kernels, True)
        ref.update(kth, rows)
        ker.observe_topk(0, scores, pos, rows)
        p, q = ref, ker.predictors[0]
        assert torch.equal(p.theta, q.theta) and torch.equal(p.finite, q.finite)
    assert torch.isfinite(q.theta[rows]).any() and not torch.isfinite(q.theta).all()
