"""EchoCoordinator on sglang's real pool, allocator and host pool (CPU): a scripted
PD-decode life of many requests, with every returned row checked byte for byte, with the
runtime's default eviction reserve (what the plugin runs) and without one."""

from __future__ import annotations

import random

import plugin_testenv  # first: sets the process up before sglang loads
import pytest
import torch

plugin_testenv.require_sglang()

from sglang_world import (  # noqa: E402
    DecodeNode,
    assert_coordinator_clean,
    cpu_machine,  # noqa: F401 (autouse: CPU shims, process group)
)

from sglang_echo.config import (  # noqa: E402
    ENV_EVICTION_RESERVE,
    ConfigError,
    EchoConfig,
    reset_settings,
)
from sglang_echo.kernels.topk_rows import RING  # noqa: E402


def selections(node: DecodeNode, rng: random.Random):
    """Random top-k per (layer, request): recent tokens favoured, the current token often
    in, width top-k padded with -1 for short sequences."""

    def topk_for(layer: int, rid: str, seq_len: int) -> torch.Tensor:
        k = min(seq_len, node.top_k)
        recent = list(range(max(0, seq_len - 6), seq_len))
        picked = set(rng.sample(recent, min(len(recent), rng.randint(0, 4))))
        while len(picked) < k:
            picked.add(rng.randrange(seq_len))
        return torch.tensor(sorted(picked)[:k], dtype=torch.int32)

    return topk_for


def check_tables(node: DecodeNode, rids: list[str], tables) -> None:
    """Each selected token's row holds its bytes in that layer; the rest is -1."""
    coord = node.coord
    echo_lo, echo_hi = coord.row_base + 1, coord.row_base + coord.num_slots
    for layer, (topk, table) in enumerate(tables):
        rows = node.layer_rows(layer)
        host = node.host_rows(layer)
        for i, rid in enumerate(rids):
            token = node.running[rid]
            idx = token.req.kv.req_pool_idx
            lanes = topk[i] >= 0
            assert torch.all(table[i][~lanes] == -1)
            positions = topk[i][lanes].long()
            got = table[i][lanes].long()
            assert torch.all(got >= 0), f"{rid} layer {layer}: unresolved lanes"
            want = token.rows[positions, layer]
            assert torch.equal(rows[got].view(torch.uint8), want.view(torch.uint8)), (
                f"{rid} layer {layer}: a returned row does not hold its token's bytes"
            )
            # The request's newest decoded tokens are read in its ring (its own page).
            ring_lo = max(int(coord.ring_start[idx]), token.seq_len - RING)
            in_ring = positions >= ring_lo
            assert torch.equal(got[in_ring], coord.ring_rows[idx, positions[in_ring] % RING])
            old = ~in_ring
            assert torch.all((got[old] >= echo_lo) & (got[old] <= echo_hi))
            host_ids = coord.req_to_host_pool[idx, positions[old]]
            assert torch.equal(
                rows[got[old]].view(torch.uint8), host[host_ids].view(torch.uint8)
            ), f"{rid} layer {layer}: device row differs from its host row"
        assert torch.all(table[len(rids) :] == -1), "padding rows must resolve to nothing"


def run_life(node: DecodeNode, steps: int, seed: int) -> dict:
    rng = random.Random(seed)
    topk_for = selections(node, rng)
    budget: dict[str, int] = {}
    stats = {"finished": 0, "aborted": 0, "aborted_before_admission": 0, "steps": 0}
    for _ in range(steps):
        while len(node.running) < node.max_running and rng.random() < 0.6:
            if rng.random() < 0.1:  # aborted while its KV is still in flight
                rid = node.arrive(rng.randint(5, 150), admit=False)
                node.finish(rid)
                stats["aborted_before_admission"] += 1
                continue
            rid = node.arrive(rng.randint(1, 150))
            budget[rid] = rng.randint(1, 30)
        if not node.running:
            continue
        rids = list(node.running)
        tables = node.step(rids, padded_bs=node.max_running + 1, topk_for=topk_for)
        check_tables(node, rids, tables)
        stats["steps"] += 1
        for rid in rids:
            budget[rid] -= 1
            if rng.random() < 0.05:
                node.finish(rid)
                stats["aborted"] += 1
            elif budget[rid] <= 0:
                node.finish(rid)
                stats["finished"] += 1
    for rid in list(node.running):
        node.finish(rid)
    return stats


def assert_back_to_start(node: DecodeNode) -> None:
    coord = node.coord
    assert node.counters() == node.after_init
    assert node.start["req_slots"] == node.after_init["req_slots"]
    # The coordinator holds only the logical pages the host pool could not serve.
    assert node.after_init["logical"] == min(node.start["logical"], node.after_init["host"])
    assert_coordinator_clean(coord, node.allocator)


@pytest.fixture
def reserve_env(monkeypatch):
    """Sets (a count) or unsets (None) SGLANG_ECHO_EVICTION_RESERVE for the test; the
    process's settings (config.settings()) are parsed afresh after each change and after
    the test."""

    def apply(value: int | None) -> None:
        if value is None:
            monkeypatch.delenv(ENV_EVICTION_RESERVE, raising=False)
        else:
            monkeypatch.setenv(ENV_EVICTION_RESERVE, str(value))
        reset_settings()

    yield apply
    monkeypatch.undo()
    reset_settings()


def test_plugin_cache_takes_the_runtime_eviction_reserve(reserve_env):
    """The plugin's device cache gets EchoConfig's reserve for its N_G, as the runtime's
    EchoKVCache does: the default unless SGLANG_ECHO_EVICTION_RESERVE sets it."""
    reserve_env(None)
    node = DecodeNode(layers=1, top_k=16, dev_cache=128, max_running=2, host_tokens=1024,
                      max_context=128)  # fmt: skip
    assert node.coord.cache.eviction_reserve == EchoConfig(dev_cache_size=128).eviction_reserve
    assert node.coord.cache.eviction_reserve == 4  # 128 / 32
    for value in (0, 7):
        reserve_env(value)
        node = DecodeNode(layers=1, top_k=16, dev_cache=128, max_running=2, host_tokens=1024,
                          max_context=128)  # fmt: skip
        assert node.coord.cache.eviction_reserve == value
    reserve_env(65)  # more than half of the 128 slots: what EchoConfig.validate refuses
    with pytest.raises(ConfigError, match=f"{ENV_EVICTION_RESERVE}=65.*at most 64"):
        DecodeNode(layers=1, top_k=16, dev_cache=128, max_running=2, host_tokens=1024,
                   max_context=128)  # fmt: skip


@pytest.mark.parametrize("reserve", [None, 0], ids=["default-reserve", "reserve-0"])
@pytest.mark.parametrize("seed", [0, 1])
def test_pd_decode_life_rows_exact(seed, reserve, reserve_env):
    reserve_env(reserve)
    node = DecodeNode(
        layers=3, top_k=16, dev_cache=64, max_running=4, host_tokens=1536,
        max_context=256, seed=seed,
    )  # fmt: skip
    want = EchoConfig(dev_cache_size=64).eviction_reserve if reserve is None else reserve
    assert node.coord.cache.eviction_reserve == want
    if reserve is None:
        assert want > 0, "the default must reserve slots at this N_G"
    stats = run_life(node, steps=60, seed=seed)
    assert stats["finished"] + stats["aborted"] >= 6
    assert stats["aborted"] + stats["aborted_before_admission"] >= 1
    telemetry = node.coord.echo_telemetry()
    assert min(telemetry["evictions"]) > 0, "the life must evict in every layer"
    assert min(telemetry["hits"]) > 0 and min(telemetry["misses"]) > 0
    reused = [h for h, owners in node.host_owners.items() if len(owners) > 1]
    assert reused, "host ids must be reused by later requests"
    assert_back_to_start(node)


def test_padding_and_dummy_request_are_noops():
    """CUDA-graph capture runs the backend with req 0 (ReqToTokenPool's padding row) and
    garbage selections; replays pad past num_real_reqs. Neither may touch ECHO state."""
    node = DecodeNode(layers=2, top_k=16, dev_cache=64, max_running=4, host_tokens=1024,
                      max_context=128)  # fmt: skip
    coord = node.coord
    before = [t.clone() for t in (coord.cache.host_to_device, coord.cache.priority)]
    coord.num_real_reqs.fill_(3)
    table = coord.swap_in_selected_pages(
        torch.zeros(3, dtype=torch.int64),
        torch.full((3,), 100, dtype=torch.int64),
        torch.randint(0, 100, (3, 16), dtype=torch.int32),
        layer_id=1,
    )
    assert torch.all(table == -1)
    assert torch.equal(before[0], coord.cache.host_to_device)
    assert torch.equal(before[1], coord.cache.priority)
    assert int(coord.cache.misses.sum()) == 0

    rid = node.arrive(40)
    coord.num_real_reqs.fill_(0)  # a real request past num_real_reqs is padding too
    idx = torch.tensor([node.running[rid].req.kv.req_pool_idx])
    table = coord.swap_in_selected_pages(
        idx, torch.tensor([41]), torch.arange(16, dtype=torch.int32).view(1, 16), layer_id=0
    )
    assert torch.all(table == -1) and int(coord.cache.misses.sum()) == 0
    node.finish(rid)
    assert node.counters() == node.after_init


def test_more_rows_than_the_cache_holds_are_padding():
    """A graph batch wider than N_G // top-k: rows past it can only be padding."""
    node = DecodeNode(layers=1, top_k=16, dev_cache=32, max_running=4, host_tokens=1024,
                      max_context=128)  # fmt: skip
    coord = node.coord
    assert coord.resolver.max_rows == 2
    rids = [node.arrive(30), node.arrive(50)]
    rng = random.Random(3)
    tables = node.step(rids, padded_bs=4, topk_for=selections(node, rng))
    check_tables(node, rids, tables)
    for rid in rids:
        node.finish(rid)
    assert node.counters() == node.after_init


def test_a_batch_past_the_cache_is_refused_on_the_host():
    """More running requests than N_G // top-k cannot all be resident: the step fails at
    once with the numbers and the fix, instead of resolving the extra rows to nothing."""
    node = DecodeNode(layers=1, top_k=16, dev_cache=32, max_running=4, host_tokens=1024,
                      max_context=128)  # fmt: skip
    assert node.coord.resolver.max_rows == 2
    rids = [node.arrive(30), node.arrive(50), node.arrive(20)]
    misses = node.coord.cache.misses.clone()
    with pytest.raises(ConfigError) as err:
        node.step(rids, padded_bs=4, topk_for=selections(node, random.Random(4)))
    text = str(err.value)
    for part in (
        "3 requests",
        "32 // top-k 16 = 2",
        "NSA_DEV_CACHE_SIZE",
        "--max-running-requests",
    ):
        assert part in text, (part, text)
    assert torch.equal(node.coord.cache.misses, misses), "nothing may be resolved"
    for rid in rids:
        node.finish(rid)
    assert node.counters() == node.after_init
    assert_coordinator_clean(node.coord, node.allocator)


def test_no_device_page_names_the_request():
    """The allocator gave no page for a request's newest token: a clear error naming the
    request, not a TypeError on None."""
    node = DecodeNode(layers=1, top_k=16, dev_cache=64, max_running=2, host_tokens=1024,
                      max_context=128)  # fmt: skip
    node.allocator.alloc_device_buffer = lambda logical, need: None
    with pytest.raises(RuntimeError, match=r"no device page.*request 'r0'"):
        node.arrive(40)


def test_token_stats_count_requests_not_reservations():
    node = DecodeNode(layers=1, top_k=16, dev_cache=64, max_running=2, host_tokens=1024,
                      max_context=256)  # fmt: skip
    coord = node.coord
    assert coord.get_token_stats().device_tokens == 0
    rid = node.arrive(100)
    stats = coord.get_token_stats()
    assert stats.device_tokens == 64  # the newest page
    assert stats.host_tokens == 128  # two host pages
    node.finish(rid)
    assert coord.get_token_stats().host_tokens == 0


@pytest.mark.parametrize("kernels", [False, True], ids=["reference", "triton"])
def test_recent_tokens_are_read_in_the_ring_never_recalled(kernels):
    """A decode step that selects only its request's newest decoded tokens (the last
    RING, the previous one always among them, as an indexer nearly always picks it) looks
    up no host id: ECHO's cache sees neither a hit nor a miss, and every row is exact. A
    selection reaching one token further back takes exactly one resolve lane per layer
    and request. With the Triton kernels (interpreted here), also the resolve's distinct
    allocation at a batch of three."""
    node = DecodeNode(layers=2, top_k=2 * RING, dev_cache=6 * RING, max_running=3,
                      host_tokens=4096, max_context=512)  # fmt: skip
    node.coord.manager.use_kernels = kernels
    cache = node.coord.cache
    rids = [node.arrive(n) for n in (100, 7, 300)]

    def recent(extra: int):
        def pick(layer: int, rid: str, seq_len: int) -> torch.Tensor:
            start = node.coord.ring_start[node.running[rid].req.kv.req_pool_idx]
            lo = max(int(start), seq_len - RING) - extra
            return torch.arange(max(lo, 0), seq_len, dtype=torch.int32)

        return pick

    for _ in range(RING + 5):  # the ring fills, then wraps
        before = (cache.hits.sum().item(), cache.misses.sum().item())
        check_tables(node, rids, node.step(rids, padded_bs=4, topk_for=recent(0)))
        assert (cache.hits.sum().item(), cache.misses.sum().item()) == before
    before = cache.hits.sum().item() + cache.misses.sum().item()
    check_tables(node, rids, node.step(rids, padded_bs=4, topk_for=recent(1)))
    looked_up = cache.hits.sum().item() + cache.misses.sum().item() - before
    assert looked_up == 2 * len(rids)  # one older token per layer and request
    for rid in rids:
        node.finish(rid)
    assert_back_to_start(node)
