"""Decode prefetch (kernels/decode_prefetch.py): the fp8 logits kernel that fetches
candidates while it scores leaves the logits bit-identical to the plain kernel and the
cache in the reference's state (up to which candidates win a contended cap or the last
free slots); fetched rows are byte copies of their host rows and the maps stay a
bijection. Manager-level prefetch (prefill's side-stream path, EchoManager.prefetch) and
the step's epilogue kernels too. Triton runs under the interpreter on CPU."""

from __future__ import annotations

import random

import pytest
import torch

from sglang_echo.kernels.cache_layout import ABSENT
from sglang_echo.kernels.decode_prefetch import (
    FetchWorkspace,
    decode_fetch_reference,
    fp8_index_logits_fetch,
)
from sglang_echo.kernels.indexer import fp8_index_logits
from sglang_echo.kernels.topk import select_topk
from sglang_echo.offload.decode_prefetcher import DecodePrefetcher
from sglang_echo.offload.device_cache import DeviceCache
from sglang_echo.offload.host_pool import HostKVPool
from sglang_echo.offload.manager import EchoManager

DEV = "cuda" if torch.cuda.is_available() else "cpu"
STATE = ("host_to_device", "device_to_host", "priority", "free_stack", "free_count", "clock")


@pytest.fixture(params=["forward", "reversed"])
def program_order(request, monkeypatch):
    """The interpreter runs programs in order; reversed, the ticket that settles the step
    falls to another program and contended candidates go to other requests."""
    if request.param == "reversed":
        if DEV != "cpu":
            pytest.skip("program order is the hardware's on a GPU")
        from triton.runtime import interpreter

        builder = interpreter.interpreter_builder
        original = type(builder).set_grid_idx

        def reversed_idx(self, x, y, z):
            original(self, self.grid_dim[0] - 1 - x, self.grid_dim[1] - 1 - y, z)

        monkeypatch.setattr(type(builder), "set_grid_idx", reversed_idx)
    return request.param


def _inputs(
    seed: int, batch: int = 3, heads: int = 16, dim: int = 32, length: int = 150,
    shared: bool = False,
):  # fmt: skip
    """Requests own disjoint host ids, as in decode; ``shared``: their ids overlap (two
    requests may fetch the same id: one claim wins)."""
    g = torch.Generator().manual_seed(seed)
    n_keys = batch * length + 2
    q = (torch.randn(batch, heads, dim, generator=g) * 2).to(torch.float8_e4m3fn)
    keys = (torch.randn(n_keys, dim, generator=g) * 2).to(torch.float8_e4m3fn)
    scales = torch.rand(n_keys, generator=g) + 0.5
    weights = torch.randn(batch, heads, generator=g)
    if shared:
        locs = torch.stack(
            [torch.randperm(n_keys - 2, generator=g)[:length] + 1 for _ in range(batch)]
        )
    else:
        locs = (torch.randperm(n_keys - 2, generator=g)[: batch * length] + 1).view(batch, -1)
    seq_lens = torch.tensor([length, length // 2 + 3, 17][:batch], dtype=torch.int32)
    return tuple(t.to(DEV) for t in (q, weights, keys, scales, locs, seq_lens))


def _thetas(logits: torch.Tensor, lens: torch.Tensor, quantile: float) -> torch.Tensor:
    """Row 0 at a score quantile (some flagged), row 1 -inf (all visible), then +inf."""
    first = logits[0, : int(lens[0])].float().quantile(quantile).item()
    values = [first, float("-inf"), float("inf")][: logits.shape[0]]
    return torch.tensor(values, dtype=torch.float32, device=logits.device)


def _cache_manager(n_keys: int, slots: int, seed: int, use_kernels: bool) -> EchoManager:
    """A one-layer cache over ``n_keys`` host ids with distinct rows, 40% of the ids
    resident (appended), the rest of the slots free."""
    g = torch.Generator().manual_seed(seed)
    host = HostKVPool(1, n_keys, 8, torch.float32, pin=DEV == "cuda")
    cache = DeviceCache(1, slots, n_keys, 8, torch.float32, DEV)
    m = EchoManager(host, cache, use_kernels=use_kernels)
    rows = torch.randn(n_keys + 1, 8, generator=g)
    m.write_host(0, torch.arange(1, n_keys + 1, device=DEV), rows[1:].to(DEV))
    resident = (torch.randperm(n_keys, generator=g)[: int(0.4 * n_keys)] + 1).to(DEV)
    m.append(0, resident, rows[resident.cpu()].to(DEV))
    return m


def _fetched_lists(ws: FetchWorkspace, batch: int, cap: int) -> list[list[int]]:
    return [ws.ids[b * cap : b * cap + int(ws.kept[b])].tolist() for b in range(batch)]


def _assert_consistent(m: EchoManager, before_free: int, host: torch.Tensor) -> None:
    """Maps a bijection over resident ids, fetched rows byte-equal to their host rows,
    the free stack's untouched bottom where it was."""
    c = m.cache
    h2d, d2h = c.host_to_device[0], c.device_to_host[0]
    ids = (h2d != ABSENT).nonzero().squeeze(1)
    ids = ids[ids <= c.host_tokens]
    slots = h2d[ids].long()
    assert (slots >= 0).all(), "a claim was left PENDING"
    assert torch.equal(d2h[slots].long(), ids)
    assert len(set(slots.tolist())) == len(slots)
    assert torch.equal(c.rows[0][slots].cpu(), host[ids.cpu()])
    free = int(c.free_count[0])
    assert free <= before_free
    used = set(c.free_stack[0, free:before_free].tolist())
    assert used <= set(slots.tolist()) and len(used) == before_free - free


@pytest.fixture(params=["inline", "queue"])
def mode(request) -> str:
    return request.param


@pytest.mark.parametrize(
    ("block_n", "blocks", "keys_as_m", "cap", "quantile", "slots", "shared"),
    [
        (16, 1, True, 200, 0.8, 600, False),  # nothing binds: the reference's fetch exactly
        (32, 2, False, 5, 0.5, 600, True),  # the cap binds every row; ids shared
        (16, 4, True, 200, 0.6, 230, False),  # the free slots run out
    ],
    ids=["unbound", "cap-binds-shared-ids", "slots-run-out"],
)
def test_fetch_kernel_logits_bit_identical_and_state_matches_reference(
    block_n, blocks, keys_as_m, cap, quantile, slots, shared, program_order, mode
):
    q, w, keys, scales, locs, lens = _inputs(0, shared=shared)
    n_keys = keys.shape[0] - 1
    plain = fp8_index_logits(q, w, keys, scales, locs, lens, block_n, 4, 1, blocks, keys_as_m)
    theta = _thetas(plain, lens, quantile)
    ker = _cache_manager(n_keys, slots, 1, use_kernels=True)
    ref = _cache_manager(n_keys, slots, 1, use_kernels=False)
    free0 = int(ker.cache.free_count[0])
    ws_k = FetchWorkspace(3, cap, torch.device(DEV))
    got = fp8_index_logits_fetch(
        q, w, keys, scales, locs, lens, theta, ker.fetch_target(0), ws_k, cap,
        block_n=block_n, num_stages=1, blocks_per_program=blocks, keys_as_m=keys_as_m,
        mode=mode,
    )  # fmt: skip
    assert torch.equal(got, plain)
    # The queue mode caps the step's candidates (3 x cap in all), not each request's.
    ref_cap = cap if mode == "inline" else 3 * cap
    ws_r = FetchWorkspace(3, ref_cap, torch.device(DEV))
    decode_fetch_reference(got, locs, lens, theta, ref.fetch_target(0), ws_r, ref_cap)
    host = ker.host.rows[0]
    _assert_consistent(ker, free0, host)
    _assert_consistent(ref, free0, host)
    took = free0 - int(ker.cache.free_count[0])
    assert took == int(ker.prefetched_rows[0]) > 0
    lists, lanes = ws_k.lists_shape
    k_lists = _fetched_lists(ws_k, lists, lanes)
    r_lists = _fetched_lists(ws_r, 3, ref_cap)
    k_all = sorted(i for x in k_lists for i in x if i >= 0)
    assert len(k_all) == took == len(set(k_all))
    if mode == "inline" and not shared:  # what each request asked for: order-free
        assert torch.equal(ws_k.kept[:3], ws_r.kept[:3])
    cands = set()
    for b in range(3):
        n = int(lens[b])
        cands |= {int(locs[b, p]) for p in range(n) if plain[b, p] > theta[b]}
    assert set(k_all) <= cands  # every fetch a candidate
    unbound = not shared and slots == 600 and (cap == 200 or mode == "queue")
    if unbound:  # nothing contended: the reference's fetch
        assert k_all == sorted(i for x in r_lists for i in x if i >= 0)
        resident_k = ker.cache.host_to_device[0] != ABSENT
        assert torch.equal(resident_k, ref.cache.host_to_device[0] != ABSENT)
        assert took == free0 - int(ref.cache.free_count[0])
    if mode == "inline":
        assert all(len(x) <= cap for x in k_lists)
    assert int(ws_k.request_counts.abs().sum()) == int(ws_k.taken) == 0
    assert int(ws_k.tail) == int(ws_k.head) == int(ws_k.done) == 0
    assert bool((ws_k.queue == -1).all())
    if slots == 230:
        assert int(ker.cache.free_count[0]) == 0  # every free slot went to a candidate


def test_fetch_twice_finds_the_first_fetch_resident():
    """The counters reset: a second fetch of the same step's candidates fetches nothing."""
    q, w, keys, scales, locs, lens = _inputs(2)
    plain = fp8_index_logits(q, w, keys, scales, locs, lens)
    theta = _thetas(plain, lens, 0.7)
    m = _cache_manager(keys.shape[0] - 1, 600, 3, use_kernels=True)
    ws = FetchWorkspace(3, 64, torch.device(DEV))
    fp8_index_logits_fetch(q, w, keys, scales, locs, lens, theta, m.fetch_target(0), ws, 64)
    first = int(m.prefetched_rows[0])
    assert first > 0
    fp8_index_logits_fetch(q, w, keys, scales, locs, lens, theta, m.fetch_target(0), ws, 64)
    assert int(m.prefetched_rows[0]) == first and int(ws.kept[:3].sum()) == 0


def test_fetch_bad_inputs_say_what_to_change():
    q, w, keys, scales, locs, lens = _inputs(0)
    m = _cache_manager(keys.shape[0] - 1, 600, 1, use_kernels=True)
    theta = torch.zeros(3, device=DEV)
    t = m.fetch_target(0)
    small = FetchWorkspace(2, 4, torch.device(DEV))
    with pytest.raises(ValueError, match="workspace"):
        fp8_index_logits_fetch(q, w, keys, scales, locs, lens, theta, t, small, 4)
    ws = FetchWorkspace(3, 4, torch.device(DEV))
    with pytest.raises(ValueError, match="workspace"):
        fp8_index_logits_fetch(q, w, keys, scales, locs, lens, theta, t, ws, 8)
    with pytest.raises(ValueError, match="theta"):
        fp8_index_logits_fetch(q, w, keys, scales, locs, lens, theta.double(), t, ws, 4)
    with pytest.raises(ValueError, match="host_to_device"):
        bad = t._replace(host_to_device=t.host_to_device.long())
        fp8_index_logits_fetch(q, w, keys, scales, locs, lens, theta, bad, ws, 4)
    with pytest.raises(ValueError, match="scores"):
        decode_fetch_reference(theta, locs, lens, theta, t, ws, 4)
    with pytest.raises(ValueError, match="max_rows"):
        FetchWorkspace(0, 4, torch.device(DEV))


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


def test_prefetch_hit_count_kernel_matches_reference():
    from sglang_echo.kernels.decode_prefetch import count_prefetch_hits

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
        count_prefetch_hits(ids, slots, n, lanes, d2h, prio, clock, a, use_kernel=False)
        count_prefetch_hits(ids, slots, n, lanes, d2h, prio, clock, b)
        assert torch.equal(a, b)
        assert (int(a) > 0) == (count > 0)
