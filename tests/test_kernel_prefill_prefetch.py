"""Prefill prefetch kernels vs their torch reference (Triton interpreter on a CPU machine),
and the property that makes prefetch lossless: every candidate is in its row's exact top-k."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_echo.kernels.prefill_prefetch import (
    ABSENT,
    count_prefetch_hits,
    count_prefetch_hits_reference,
    histogram_census,
    order_key_bins,
    prefetch_cap,
    prefill_prefetch,
    prefill_prefetch_reference,
)
from sglang_echo.kernels.topk import select_topk
from sglang_echo.offload.device_cache import DeviceCache
from sglang_echo.offload.host_pool import HostKVPool
from sglang_echo.offload.manager import EchoManager
from sglang_echo.offload.predictor import PrefillOffsetPredictor

DEV = "cuda" if torch.cuda.is_available() else "cpu"
NEG_INF = float("-inf")


def _case(kind: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "normal":
        s = torch.randn(rows, cols, generator=g)
    elif kind == "negative":  # every score < 0: thresholds in the negative bins
        s = -torch.rand(rows, cols, generator=g) * 100 - 1e-3
    elif kind == "ties":  # few distinct values incl. +-0.0: the k-th value is tied
        s = torch.randint(-2, 3, (rows, cols), generator=g).float()
        s[:, 1::4] = -0.0
        s[:, ::20] = 8.0  # fewer than k tokens above the tied k-th value
    elif kind == "zeros":  # relu-clipped: the k-th value is a zero, signed both ways
        s = torch.rand(rows, cols, generator=g)
        s[:, 10:] = -0.0
        s[:, 10:15] = 0.0
        s[:, 250:] = -1.0
    elif kind == "wide":  # magnitudes over many binades, both signs
        s = torch.randn(rows, cols, generator=g) * torch.exp2(
            torch.randint(-60, 60, (rows, cols), generator=g).float()
        )
    else:
        raise AssertionError(kind)
    s[torch.rand(rows, cols, generator=g) < 0.1] = NEG_INF  # masked positions
    return s


def _inputs(rows: int, cols: int, seed: int, resident: float = 0.4):
    g = torch.Generator().manual_seed(seed + 1000)
    host_tokens = cols + 50
    locs = torch.randperm(host_tokens, generator=g)[:cols] + 1
    h2d = torch.full((host_tokens + 2,), ABSENT, dtype=torch.int32)
    res = locs[torch.rand(cols, generator=g) < resident]
    h2d[res] = torch.arange(1, res.numel() + 1, dtype=torch.int32)
    return locs, h2d


def _run_both(scores, locs, h2d, topk, cap, offsets=None, query_pos=None, budgets=(None, None)):
    dev = lambda t: None if t is None else t.to(DEV)  # noqa: E731
    got = prefill_prefetch(
        dev(scores),
        dev(locs),
        dev(h2d),
        topk,
        cap,
        offsets=dev(offsets),
        query_pos=dev(query_pos),
        budget=dev(budgets[0]),
        block=64,
        tiles=2,
        tile=64,
        row_block=4,
    )
    want = prefill_prefetch_reference(
        scores, locs, h2d, topk, cap, offsets=offsets, query_pos=query_pos, budget=budgets[1]
    )
    return got, want


def _assert_same(got, want):
    assert torch.equal(got.count.cpu(), want.count)
    assert torch.equal(got.threshold_bin.cpu(), want.threshold_bin)
    n = int(want.count.item())
    assert torch.equal(got.ids.cpu()[:n], want.ids[:n])
    assert got.ids.shape == want.ids.shape


@pytest.mark.parametrize("kind", ["normal", "negative", "ties", "zeros", "wide"])
@pytest.mark.parametrize("use_offset", [False, True])
def test_kernel_matches_reference(kind, use_offset):
    rows, cols, topk = 5, 300, 24
    scores = _case(kind, rows, cols, seed=len(kind))
    locs, h2d = _inputs(rows, cols, seed=3)
    g = torch.Generator().manual_seed(7)
    offsets = None
    if use_offset:  # near each row's k-th score, plus one non-finite (treated as 0)
        kth = torch.topk(scores, topk, dim=1).values[:, -1]
        offsets = torch.where(torch.isfinite(kth), kth, 0.0) + 0.1 * torch.randn(rows, generator=g)
        offsets[-1] = float("inf")
    got, want = _run_both(scores, locs, h2d, topk, cap=cols, offsets=offsets)
    _assert_same(got, want)
    assert want.count.item() > 0  # the case exercises a non-empty list


def test_rows_with_fewer_than_k_tokens_and_query_pos():
    """Causal rows (query_pos) with short rows: threshold bin -1, every visible token."""
    rows, cols, topk = 6, 200, 40
    scores = _case("normal", rows, cols, seed=11)
    scores[0] = NEG_INF  # a row with nothing visible
    query_pos = torch.tensor([199, 10, 30, 120, 60, 199])
    locs, h2d = _inputs(rows, cols, seed=5, resident=0.0)
    got, want = _run_both(scores, locs, h2d, topk, cap=cols, query_pos=query_pos)
    _assert_same(got, want)
    assert (want.threshold_bin[1:3] == -1).all() and want.threshold_bin[0] == -1


def test_cap_and_shared_budget():
    rows, cols, topk = 4, 256, 64
    scores = _case("normal", rows, cols, seed=2)
    locs, h2d = _inputs(rows, cols, seed=9, resident=0.0)
    full, _ = _run_both(scores, locs, h2d, topk, cap=cols)
    n_full = int(full.count.item())
    cap = n_full // 2
    got, want = _run_both(scores, locs, h2d, topk, cap=cap)
    _assert_same(got, want)
    assert int(want.count.item()) == cap
    # A device budget shared by two calls: the second gets what the first left.
    b_got = torch.tensor([n_full // 3 + n_full // 2], dtype=torch.int64, device=DEV)
    b_want = b_got.cpu().clone()
    for _ in range(2):
        got, want = _run_both(scores, locs, h2d, topk, cap=n_full // 2, budgets=(b_got, b_want))
        _assert_same(got, want)
    assert int(b_want.item()) == 0 and int(b_got.item()) == 0
    assert int(want.count.item()) == n_full // 3


def test_resident_tokens_are_dropped_and_ids_distinct():
    rows, cols, topk = 8, 256, 32
    scores = _case("normal", rows, cols, seed=4)
    locs, h2d = _inputs(rows, cols, seed=4, resident=0.5)
    got, want = _run_both(scores, locs, h2d, topk, cap=cols)
    _assert_same(got, want)
    ids = want.ids[: int(want.count.item())]
    assert (h2d[ids] == ABSENT).all()
    assert ids.unique().numel() == ids.numel()


def test_bad_inputs_fail_clearly():
    s = torch.zeros(2, 8)
    locs, h2d = torch.arange(1, 9), torch.zeros(12, dtype=torch.int32)
    with pytest.raises(ValueError, match="locs must be"):
        prefill_prefetch(s, locs[:4], h2d, 2, 4)
    with pytest.raises(ValueError, match="int32 map"):
        prefill_prefetch(s, locs, h2d.long(), 2, 4)
    with pytest.raises(ValueError, match="topk"):
        prefill_prefetch(s, locs, h2d, 0, 4)
    with pytest.raises(ValueError, match="offsets"):
        prefill_prefetch(s, locs, h2d, 2, 4, offsets=torch.zeros(3))
    assert prefetch_cap(260_000, 512) == 8192
    assert prefetch_cap(600, 512) == 87
    assert prefetch_cap(100, 512) == 0


def test_absent_matches_the_device_cache():
    from sglang_echo.offload.device_cache import ABSENT as CACHE_ABSENT

    assert ABSENT == CACHE_ABSENT


def test_order_key_bins_preserve_order():
    x = torch.tensor([NEG_INF, -3e38, -5.0, -1.0, -1e-30, -0.0, 0.0, 1e-30, 1.0, 5.0, 3e38])
    b = order_key_bins(x)
    assert (b[1:] >= b[:-1]).all()
    assert b[5] == b[6] == 128 and b[0] == 0 and b[-1] <= 255


# --------------------------------------------------- the lossless property (reference)
_scores = st.lists(
    st.one_of(
        st.floats(allow_nan=False, width=32),
        st.sampled_from([0.0, -0.0, 1.0, -1.0, NEG_INF]),
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(
    rows=st.lists(_scores, min_size=1, max_size=4),
    topk=st.integers(1, 20),
    offset=st.one_of(st.none(), st.floats(allow_nan=False, allow_infinity=False, width=32)),
    data=st.data(),
)
def test_candidates_are_exact_topk_members(rows, topk, offset, data):
    width = max(len(r) for r in rows)
    scores = torch.full((len(rows), width), NEG_INF)
    for i, r in enumerate(rows):
        scores[i, : len(r)] = torch.tensor(r)
    qpos = torch.tensor([data.draw(st.integers(0, width - 1)) for _ in rows])
    offsets = None if offset is None else torch.full((len(rows),), offset)
    c = histogram_census(scores, topk, offsets, qpos)
    certain = c["valid"] & (c["bins"] > c["threshold_bin"][:, None])
    # Membership in the model's exact top-k (ties to the lowest position) ...
    chosen = select_topk(scores[None], qpos[None], topk)[0]
    in_topk = torch.zeros_like(certain)
    for i in range(len(rows)):
        picked = chosen[i][chosen[i] >= 0]
        in_topk[i, picked] = True
    assert not (certain & ~in_topk).any()
    # ... and under any tie-break: a certain token beats the k-th largest visible score.
    visible = torch.where(c["valid"], scores, torch.full_like(scores, NEG_INF))
    kth = torch.topk(visible, min(topk, width), dim=1).values[:, -1]
    has_k = c["valid"].sum(1) >= topk
    beats = scores > kth[:, None]
    assert not (certain & has_k[:, None] & ~beats).any()
    # Rows without a threshold bin have fewer than k visible tokens: all are certain.
    no_thr = c["threshold_bin"] == -1
    assert torch.equal(no_thr, ~has_k)
    assert torch.equal(certain[no_thr], c["valid"][no_thr])


def test_offset_shrinks_the_ambiguous_bin():
    """Indexer-like scores (relu'd head dots, weighted): an offset predicted from the
    previous block's k-th scores leaves fewer ambiguous tokens and more certain ones."""
    g = torch.Generator().manual_seed(0)
    hist_len, queries, block, topk, heads, dim = 4096, 128, 32, 128, 8, 32
    keys = torch.randn(hist_len, dim, generator=g)
    q = torch.randn(heads, dim, generator=g)[None] + 0.7 * torch.randn(
        queries, heads, dim, generator=g
    )
    w = torch.randn(heads, generator=g).abs()[None] * (1 + 0.2 * torch.randn(queries, heads))
    scores = torch.einsum("qh,qhl->ql", w, torch.relu(torch.einsum("qhd,ld->qhl", q, keys)))
    pred = PrefillOffsetPredictor(max_rows=2)
    req = torch.zeros(block, dtype=torch.int64)
    plain_amb, pred_amb, plain_cert, pred_cert = 0, 0, 0, 0
    for b in range(queries // block):
        s = scores[b * block : (b + 1) * block]
        off, known = pred.predict(req)
        plain = histogram_census(s, topk)
        with_off = histogram_census(s, topk, torch.where(known, off, 0.0))
        if b > 0:
            assert known.all()
            plain_amb += int(plain["in_bin"].sum())
            pred_amb += int(with_off["in_bin"].sum())
            plain_cert += int(plain["above"].sum())
            pred_cert += int(with_off["above"].sum())
        pred.update(torch.topk(s, topk, dim=1).values[:, -1], req)
    print(
        f"\nambiguous tokens per row: {plain_amb / (queries - block):.0f} plain -> "
        f"{pred_amb / (queries - block):.0f} with offset; certain: "
        f"{plain_cert / (queries - block):.0f} -> {pred_cert / (queries - block):.0f} of {topk}"
    )
    assert pred_amb < plain_amb
    assert pred_cert > plain_cert


def test_default_launch_parameters_match_reference():
    """The GPU defaults (wide tiles, 16-row flag steps over a 5-row block) also agree."""
    scores = _case("normal", 5, 700, seed=21)
    locs, h2d = _inputs(5, 700, seed=21)
    offsets = torch.full((5,), 1.5)
    got = prefill_prefetch(scores.to(DEV), locs.to(DEV), h2d.to(DEV), 40, 500, offsets.to(DEV))
    _assert_same(got, prefill_prefetch_reference(scores, locs, h2d, 40, 500, offsets))


# ----------------------------------------------- EchoManager.prefetch (the prefill prefetch's)
STATE = ("host_to_device", "device_to_host", "priority", "free_stack", "free_count", "clock")


def _manager(use_kernels: bool, slots: int = 24, tokens: int = 80) -> EchoManager:
    # Pinned on CUDA: the kernels read host rows through the UVA view (side-stream path).
    host = HostKVPool(1, tokens, 6, torch.float32, pin=DEV == "cuda")
    cache = DeviceCache(1, slots, tokens, 6, torch.float32, DEV)
    return EchoManager(host, cache, use_kernels=use_kernels)


def _life(manager: EchoManager, seed: int, prefetch: bool) -> list[torch.Tensor]:
    """Append tokens, then resolve random selections; with ``prefetch`` each resolve is
    preceded by a prefetch of some of its misses and some unselected absent tokens.
    Returns the rows attention would read at every resolve."""
    rng, picker = random.Random(seed), random.Random(seed + 100)
    c = manager.cache
    g = torch.Generator().manual_seed(seed)
    host_rows = torch.randn(c.host_tokens + 1, c.row_dim, generator=g)
    seen: list[int] = []
    reads = []
    for start in range(1, 61, 5):
        locs = torch.arange(start, start + 5, device=DEV)
        manager.append(0, locs, host_rows[start : start + 5].to(DEV))
        seen += locs.tolist()
        selection = rng.sample(seen, min(len(seen), 12))
        if prefetch:
            absent = [t for t in seen if int(c.host_to_device[0, t]) == ABSENT]
            picks = picker.sample(absent, min(len(absent), 6))  # selected or not
            ids = torch.full((2, 4), -1, dtype=torch.int64)
            ids.view(-1)[: len(picks)] = torch.tensor(picks, dtype=torch.int64)
            counts = torch.tensor([min(4, len(picks)), max(0, len(picks) - 4)])
            manager.prefetch(0, ids.to(DEV), counts.to(DEV))
        sel = torch.tensor(selection + [-1] * (12 - len(selection)), device=DEV)
        slots = manager.resolve(0, sel.view(3, 4)).view(-1)
        rows = c.rows[0][slots.clamp(min=0)]
        for t, s, row in zip(sel.tolist(), slots.tolist(), rows, strict=True):
            if t >= 0:
                assert torch.equal(row.cpu(), host_rows[t]), f"token {t} slot {s}"
        reads.append(rows.cpu())
    return reads


@pytest.mark.parametrize("seed", range(2))
def test_prefetch_then_resolve_reads_the_same_rows_and_kernels_match_reference(seed):
    plain = _life(_manager(use_kernels=False), seed, prefetch=False)
    ref, ker = _manager(use_kernels=False), _manager(use_kernels=True)
    with_ref = _life(ref, seed, prefetch=True)
    with_ker = _life(ker, seed, prefetch=True)
    for a, b, x in zip(plain, with_ref, with_ker, strict=True):
        assert torch.equal(a, b) and torch.equal(a, x)
    for name in STATE:
        assert torch.equal(getattr(ref.cache, name), getattr(ker.cache, name)), name
    assert torch.equal(ref.prefetched_rows, ker.prefetched_rows)
    assert torch.equal(ref.prefetch_hits, ker.prefetch_hits)
    prefetched, hits = int(ref.prefetched_rows[0]), int(ref.prefetch_hits[0])
    assert prefetched > 0 and 0 < hits <= prefetched


def test_prefetch_hits_count_only_selected_prefetches():
    m = _manager(use_kernels=False, slots=16, tokens=40)
    rows = torch.randn(8, 6, device=DEV)
    m.append(0, torch.arange(1, 9, device=DEV), rows)
    m.release(torch.arange(1, 9, device=DEV))  # host rows kept, nothing resident
    m.prefetch(0, torch.tensor([[1, 2, 3, -1]], device=DEV))
    assert int(m.prefetched_rows[0]) == 3
    slots = m.resolve(0, torch.tensor([[2, 5]], device=DEV))
    assert int(m.prefetch_hits[0]) == 1  # token 2 was prefetched and selected
    assert int(m.cache.misses[0]) == 1  # only token 5 was still missing
    assert torch.equal(m.cache.rows[0][slots[0]], rows[[1, 4]])


@pytest.mark.parametrize("use_kernels", [False, True], ids=["reference", "kernels"])
def test_chained_prefetches_count_the_hits_of_every_link(use_kernels):
    """Prefill prefetches once per query block before one resolve (a chain): the hits of
    every block's prefetch count, not only the last one's."""
    m = _manager(use_kernels=use_kernels, slots=16, tokens=40)
    rows = torch.randn(10, 6, device=DEV)
    m.append(0, torch.arange(1, 11, device=DEV), rows)
    m.release(torch.arange(1, 11, device=DEV))  # host rows kept, nothing resident
    m.prefetch(0, torch.tensor([[1, 2, 3, -1]], device=DEV))  # block 1
    m.prefetch(0, torch.tensor([[4, 5, -1, -1]], device=DEV))  # block 2, chained
    assert int(m.prefetched_rows[0]) == 5
    slots = m.resolve(0, torch.tensor([[2, 3, 5, 9]], device=DEV))
    assert int(m.prefetch_hits[0]) == 3  # 2 and 3 from block 1, 5 from block 2
    assert int(m.cache.misses[0]) == 1  # only token 9 was still missing
    assert torch.equal(m.cache.rows[0][slots[0]], rows[[1, 2, 4, 8]])


def test_prefetch_hit_count_kernel_matches_reference():
    g = torch.Generator().manual_seed(4)
    d2h = torch.randint(0, 30, (40,), generator=g, dtype=torch.int32).to(DEV)
    prio = torch.randint(5, 8, (40,), generator=g).to(DEV)
    ids = torch.randint(0, 30, (64,), generator=g).to(DEV)
    slots = torch.randint(0, 40, (64,), generator=g).to(DEV)
    ids[:20] = d2h[slots[:20]].long()  # owned by their token: hits where stamped 7
    clock = torch.tensor([7], device=DEV)
    for count, lanes in ((50, 60), (64, 64), (0, 64)):
        a, b = torch.zeros(1, dtype=torch.int64, device=DEV), torch.zeros_like(clock)
        n = torch.tensor([count], device=DEV)
        count_prefetch_hits_reference(ids, slots, n, lanes, d2h, prio, clock, a)
        count_prefetch_hits(ids, slots, n, lanes, d2h, prio, clock, b)
        assert torch.equal(a, b)
        assert (int(a) > 0) == (count > 0)
