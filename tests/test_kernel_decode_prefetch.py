"""Decode intra-query prefetch (kernels/decode_prefetch.py, EchoManager.prefetch): the fused
fp8 logits kernel leaves the logits bit-identical to the plain kernel and flags exactly
the reference's candidates; candidates are misses above theta, in position order, capped;
a prefetch followed by the resolve leaves every selected row byte-equal to its host row,
with kernels and reference in the same state. Triton runs under the interpreter on CPU."""

from __future__ import annotations

import random

import pytest
import torch

from sglang_echo.kernels.cache_layout import ABSENT
from sglang_echo.kernels.decode_prefetch import (
    decode_prefetch_reference,
    fp8_index_logits_prefetch,
)
from sglang_echo.kernels.indexer import fp8_index_logits
from sglang_echo.kernels.topk import select_topk
from sglang_echo.offload.decode_prefetcher import DecodePrefetcher
from sglang_echo.offload.device_cache import DeviceCache
from sglang_echo.offload.host_pool import HostKVPool
from sglang_echo.offload.manager import EchoManager

DEV = "cuda" if torch.cuda.is_available() else "cpu"
STATE = ("host_to_device", "device_to_host", "priority", "free_stack", "free_count", "clock")


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


def _thetas(logits: torch.Tensor, lens: torch.Tensor, quantile: float) -> torch.Tensor:
    """Row 0 at a score quantile (some flagged), row 1 -inf (all visible), then +inf."""
    first = logits[0, : int(lens[0])].float().quantile(quantile).item()
    values = [first, float("-inf"), float("inf")][: logits.shape[0]]
    return torch.tensor(values, dtype=torch.float32, device=logits.device)


def _assert_candidates_valid(cand, scores, locs, lens, theta, h2d, cap) -> None:
    """ids[:count] are exactly the first `cap` positions (in order) scoring above theta and
    absent; the rest of each row is -1."""
    for b in range(scores.shape[0]):
        n = int(lens[b])
        flagged = [
            int(locs[b, p])
            for p in range(n)
            if scores[b, p] > theta[b] and int(h2d[int(locs[b, p])]) == ABSENT
        ]
        count = int(cand.counts[b])
        assert count == min(len(flagged), cap) <= cap
        assert cand.ids[b, :count].tolist() == flagged[:cap]
        assert (cand.ids[b, count:] == -1).all()


@pytest.mark.parametrize(
    ("block_n", "blocks", "keys_as_m", "compact_tile", "cap", "quantile"),
    [
        (16, 1, True, 32, 40, 0.8),  # many compaction tiles, cap above row 0's count
        (32, 2, False, 64, 5, 0.5),  # cap cuts every flagged row short
        (16, 4, True, 2048, 200, 0.95),  # one tile, programs walking several blocks
    ],
)
def test_fused_kernel_logits_bit_identical_and_flags_match_reference(
    block_n, blocks, keys_as_m, compact_tile, cap, quantile
):
    q, w, keys, scales, locs, lens, h2d = _inputs(block_n + blocks)
    params = dict(block_n=block_n, blocks_per_program=blocks, keys_as_m=keys_as_m)
    plain = fp8_index_logits(q, w, keys, scales, locs, lens, **params)
    theta = _thetas(plain, lens, quantile)
    got, cand = fp8_index_logits_prefetch(
        q, w, keys, scales, locs, lens, theta, h2d, cap, compact_tile=compact_tile, **params
    )
    assert torch.equal(got, plain)  # the prefetch never changes the logits
    ref = decode_prefetch_reference(got, locs, lens, theta, h2d, cap)
    assert torch.equal(cand.ids, ref.ids) and torch.equal(cand.counts, ref.counts)
    _assert_candidates_valid(cand, got.cpu(), locs.cpu(), lens.cpu(), theta.cpu(), h2d.cpu(), cap)
    counts = cand.counts.tolist()
    assert counts[0] > 0 and counts[1] > 0 and counts[2] == 0  # -inf flags, +inf does not


def test_fused_kernel_with_zero_cap_is_the_plain_kernel():
    q, w, keys, scales, locs, lens, h2d = _inputs(7, length=40)
    theta = torch.full((3,), float("-inf"), device=DEV)
    got, cand = fp8_index_logits_prefetch(q, w, keys, scales, locs, lens, theta, h2d, 0)
    assert torch.equal(got, fp8_index_logits(q, w, keys, scales, locs, lens))
    assert cand.ids.shape == (3, 0) and cand.counts.tolist() == [0, 0, 0]


@pytest.mark.parametrize("seed", range(4))
def test_reference_candidates_are_capped_absent_misses_above_theta(seed):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    batch, length, n_ids = rng.randint(1, 5), rng.randint(1, 300), 700
    scores = torch.randn(batch, length, generator=g).to(rng.choice([torch.float32, torch.bfloat16]))
    locs = torch.stack([torch.randperm(n_ids - 2, generator=g)[:length] + 1 for _ in range(batch)])
    lens = torch.randint(0, length + 1, (batch,), generator=g)
    theta = torch.randn(batch, generator=g)
    theta[rng.randrange(batch)] = rng.choice([float("-inf"), float("inf"), 0.0])
    resident = torch.rand(n_ids, generator=g) < rng.random()
    h2d = torch.where(resident, torch.arange(n_ids, dtype=torch.int32), ABSENT).to(torch.int32)
    cap = rng.randint(1, 64)
    cand = decode_prefetch_reference(scores, locs, lens, theta, h2d, cap)
    _assert_candidates_valid(cand, scores, locs, lens, theta, h2d, cap)


def test_bad_inputs_say_what_to_change():
    q, w, keys, scales, locs, lens, h2d = _inputs(1, length=20)
    theta = torch.zeros(3, device=DEV)
    with pytest.raises(ValueError, match="theta must be"):
        fp8_index_logits_prefetch(q, w, keys, scales, locs, lens, theta.double(), h2d, 4)
    with pytest.raises(ValueError, match="int32 map"):
        fp8_index_logits_prefetch(q, w, keys, scales, locs, lens, theta, h2d.long(), 4)
    with pytest.raises(ValueError, match="cap must be"):
        decode_prefetch_reference(theta.view(3, 1), locs, lens, theta, h2d, -1)
    with pytest.raises(ValueError, match="compact_tile"):
        fp8_index_logits_prefetch(
            q, w, keys, scales, locs, lens, theta, h2d, 4, block_n=32, compact_tile=16
        )


def test_select_topk_reports_the_kth_score():
    scores = torch.tensor([[[5.0, 1.0, 3.0, 2.0, 4.0]], [[1.0, 2.0, 0.0, 0.0, 0.0]]])
    qpos = torch.tensor([[4], [1]])  # row 1 sees two keys: fewer than k
    idx, kth = select_topk(scores, qpos, 3, return_kth=True)
    assert idx[0, 0].tolist() == [0, 4, 2] and kth[0, 0].item() == 3.0
    assert idx[1, 0].tolist() == [1, 0, -1] and kth[1, 0].item() == float("-inf")
    assert torch.equal(select_topk(scores, qpos, 3), idx)
    _, short = select_topk(scores, qpos, 9, return_kth=True)  # top-k beyond the width
    assert short.tolist() == [[float("-inf")], [float("-inf")]]


# ------------------------------------------------------------------ manager.prefetch
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


def test_prefetcher_thresholds_per_layer_and_row():
    m = EchoManager(
        HostKVPool(2, 10, 4, torch.float32, pin=False),
        DeviceCache(2, 8, 10, 4, torch.float32, DEV),
    )
    p = DecodePrefetcher(m, max_rows=3, cap=64)
    assert p.cap_for(16) == 16 and p.cap_for(2048) == 64
    rows = torch.tensor([0, 2], device=DEV)
    assert torch.isinf(p.theta(0, rows)).all()  # no prediction: prefetch nothing
    p.observe(1, torch.tensor([4.0, 2.0], device=DEV), rows)
    p.observe(1, torch.tensor([2.0, 2.0], device=DEV), rows)
    assert p.theta(1, rows).tolist() == [3.0, 2.0]  # EMA, alpha 0.5
    assert torch.isinf(p.theta(0, rows)).all()  # layers keep their own thresholds
    p.reset_rows([2])
    assert p.theta(1, rows)[0].item() == 3.0 and p.theta(1, rows)[1].item() == float("inf")
    with pytest.raises(ValueError, match="cap"):
        DecodePrefetcher(m, 3, cap=0)


@pytest.mark.parametrize("alpha", [0.5, 0.3])
def test_threshold_kernel_matches_the_predictor_bit_for_bit(alpha):
    from sglang_echo.kernels.decode_prefetch import update_thresholds
    from sglang_echo.offload.predictor import DecodeThresholdPredictor

    g = torch.Generator().manual_seed(3)
    ref = DecodeThresholdPredictor(6, DEV, alpha)
    ker = DecodeThresholdPredictor(6, DEV, alpha)
    specials = [float("-inf"), float("inf"), 0.0]
    for step in range(6):
        rows = torch.randperm(6, generator=g)[:4].to(DEV)
        kth = torch.randn(4, generator=g) * 10
        kth[step % 4] = specials[step % 3]  # fewer than k keys, and back to finite
        kth = torch.stack((kth, -kth), 1).to(DEV)[:, 0]  # strided, as select_topk gives it
        ref.update(kth, rows)
        update_thresholds(ker.theta, ker.finite, kth, rows, alpha)
        assert torch.equal(ref.theta, ker.theta) and torch.equal(ref.finite, ker.finite)


@pytest.mark.parametrize("use_kernels", [True, False], ids=["kernel", "reference"])
def test_thresholds_from_the_topk_match_exact_topk_kth(use_kernels):
    """observe_topk (one launch: k-th score from the top-k, then the EMA) leaves the same
    thresholds bit for bit as exact_topk's k-th score through observe, including rows
    that see fewer than k keys (-inf) and steps back to finite."""
    from sglang_echo.model.indexer import exact_topk

    m = EchoManager(
        HostKVPool(1, 10, 4, torch.float32, pin=False),
        DeviceCache(1, 8, 10, 4, torch.float32, DEV),
        use_kernels=use_kernels,
    )
    ref, ker = DecodePrefetcher(m, 6, cap=8), DecodePrefetcher(m, 6, cap=8)
    g = torch.Generator().manual_seed(5)
    k = 8
    for step in range(5):
        scores = (torch.randn(4, 40, generator=g) * 3).to(DEV)
        qpos = torch.tensor([39, 20, 5 if step % 2 else 30, 39], device=DEV)  # row 2: < k keys
        visible = torch.arange(40, device=DEV)[None, :] <= qpos[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        rows = torch.randperm(6, generator=g)[:4].to(DEV)
        pos, kth = exact_topk(scores, qpos, k, use_kernels, True)
        ref.observe(0, kth, rows)
        ker.observe_topk(0, scores, pos, rows)
        p, q = ref.predictors[0], ker.predictors[0]
        assert torch.equal(p.theta, q.theta) and torch.equal(p.finite, q.finite)
    assert torch.isfinite(q.theta[rows]).any() and not torch.isfinite(q.theta).all()


def test_prefetch_hit_count_kernel_matches_reference():
    from sglang_echo.kernels.decode_prefetch import (
        count_prefetch_hits,
        count_prefetch_hits_reference,
    )

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
