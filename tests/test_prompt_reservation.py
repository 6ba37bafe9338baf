"""A decode node's arriving prompt under ECHO: slots reserved on the decode stream, rows
written beside it, unpinned on arrival (offload/echo_cache.py reserve/fill/unpin_prompt).

- reserve + fill + unpin leaves exactly the state the one-shot ``write_prompt`` leaves
  (maps, stacks, priorities, host and device rows), so dynamic residency is unchanged;
- while the rows are in flight, resolves of other requests that must evict never take a
  reserved slot, and the prompt's device rows are intact when it arrives;
- reserving touches no row and filling touches no map: the two can run on different
  streams without racing on the free stacks (what the split is for).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sglang_echo.config import EchoConfig
from sglang_echo.kernels.decode_write import PINNED_PRIORITY, PROMPT_PRIORITY
from sglang_echo.offload.echo_cache import EchoKVCache
from sglang_echo.offload.host_extents import split_extents

LAYERS, HOST, SLOTS, WIDTH, INDEX = 2, 400, 48, 8, 4


def _cache(eviction_reserve: int = 0) -> EchoKVCache:
    config = EchoConfig(offload=True, dev_cache_size=SLOTS, eviction_reserve=eviction_reserve)
    return EchoKVCache(config, LAYERS, HOST, WIDTH, INDEX, torch.float32, "cpu")


def _state(c: EchoKVCache) -> dict[str, torch.Tensor]:
    d = c.cache
    return {
        "h2d": d.host_to_device.clone(),
        "d2h": d.device_to_host.clone(),
        "prio": d.priority.clone(),
        "stack": d.free_stack.clone(),
        "free": d.free_count.clone(),
        "clock": d.clock.clone(),
        "dev_rows": d.rows[:, 1 : SLOTS + 1].clone(),
        "host_rows": c.host.rows.clone(),
        "index": c.index.clone(),
    }


def _prompt(n: int, seed: int) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    locs = torch.randperm(HOST, generator=gen)[:n] + 1
    kv = [torch.randn(n, WIDTH, generator=gen) for _ in range(LAYERS)]
    keys = [torch.randn(n, INDEX, generator=gen) for _ in range(LAYERS)]
    return locs, kv, keys


def test_reserve_fill_unpin_equals_write_prompt():
    for n in (10, SLOTS + 20):  # all placed; more than the free slots (the rest host-only)
        locs, kv, keys = _prompt(n, seed=n)
        one_shot, split = _cache(), _cache()
        for layer in range(LAYERS):
            one_shot.write_prompt(layer, locs, kv[layer], keys[layer])
        slots = split.reserve_prompt(locs)
        pinned = split.cache.priority.clone()
        for layer in range(LAYERS):
            split.fill_prompt(layer, locs, kv[layer], keys[layer], slots[layer])
        placed = min(n, SLOTS)
        assert [int((p == PINNED_PRIORITY).sum()) for p in pinned] == [placed] * LAYERS
        split.unpin_prompt(slots)
        a, b = _state(one_shot), _state(split)
        for key in a:
            assert torch.equal(a[key], b[key]), key
        assert int((split.cache.priority == PROMPT_PRIORITY).sum()) == placed * LAYERS


def test_reserving_writes_no_row_and_filling_changes_no_map():
    locs, kv, keys = _prompt(20, seed=1)
    c = _cache()
    rows_before = (c.cache.rows.clone(), c.host.rows.clone(), c.index.clone())
    slots = c.reserve_prompt(locs)
    assert all(
        torch.equal(x, y)
        for x, y in zip(rows_before, (c.cache.rows, c.host.rows, c.index), strict=True)
    )
    maps_before = {k: v for k, v in _state(c).items() if "rows" not in k and k != "index"}
    for layer in range(LAYERS):
        c.fill_prompt(layer, locs, kv[layer], keys[layer], slots[layer])
    maps_after = {k: v for k, v in _state(c).items() if "rows" not in k and k != "index"}
    assert all(torch.equal(maps_before[k], maps_after[k]) for k in maps_before)


def test_reserved_slots_survive_evictions_until_they_arrive():
    c = _cache(eviction_reserve=4)
    prompt_locs, kv, keys = _prompt(12, seed=7)
    slots = c.reserve_prompt(prompt_locs)  # 12 of the 48 slots pinned
    others = torch.tensor(
        [i for i in range(1, HOST + 1) if i not in set(prompt_locs.tolist())], dtype=torch.int64
    )
    gen = torch.Generator().manual_seed(3)
    for layer in range(LAYERS):  # the other requests' rows, on the host
        c.host.rows[layer, others] = torch.randn(len(others), WIDTH, generator=gen)
    evicted = 0
    for step in range(12):  # steps of another request: 30 selections each, the cache churns
        sel = others[torch.randperm(len(others), generator=gen)[:30]].view(1, -1)
        for layer in range(LAYERS):
            before = int(c.cache.evictions[layer])
            c.resolve(layer, sel, distinct=True)
            evicted += int(c.cache.evictions[layer]) - before
            if step == 5:  # the rows land in the middle of the churn
                c.fill_prompt(layer, prompt_locs, kv[layer], keys[layer], slots[layer])
    assert evicted > 0
    for layer in range(LAYERS):  # still mapped to the prompt, rows intact, still pinned
        s = slots[layer]
        assert torch.equal(c.cache.device_to_host[layer, s].long(), prompt_locs)
        assert torch.equal(c.cache.host_to_device[layer, prompt_locs].long(), s)
        assert torch.equal(c.cache.rows[layer, s], kv[layer])
        assert bool((c.cache.priority[layer, s] == PINNED_PRIORITY).all())
    c.unpin_prompt(slots)
    for layer in range(LAYERS):  # ordinary residents now, the first victims
        assert bool((c.cache.priority[layer, slots[layer]] == PROMPT_PRIORITY).all())
    for _ in range(6):
        sel = others[torch.randperm(len(others), generator=gen)[:30]].view(1, -1)
        for layer in range(LAYERS):
            c.resolve(layer, sel, distinct=True)
    assert all(
        int((c.cache.host_to_device[layer, prompt_locs] != 2**31 - 1).sum()) < 12
        for layer in range(LAYERS)
    )


def _twin_caches(gen: torch.Generator) -> tuple[EchoKVCache, EchoKVCache]:
    """Two caches in the same state: each layer filled differently (some ids resident,
    some layers nearly full)."""
    a, b = _cache(), _cache()
    for layer in range(LAYERS):
        k = int(torch.randint(0, SLOTS, (1,), generator=gen))
        ids = (torch.randperm(HOST, generator=gen)[:k] + 1).view(1, -1)
        if k:
            a.resolve(layer, ids, distinct=True)
            b.resolve(layer, ids, distinct=True)
    return a, b


def test_all_layers_placement_equals_the_per_layer_one():
    """``place_slots_all_layers`` against ``place_slots`` layer by layer, from caches in
    different states (each layer filled differently, some ids already resident, more ids
    than free slots, the sink in the list)."""
    from sglang_echo.kernels.decode_write import place_slots, place_slots_all_layers

    for seed in range(4):
        gen = torch.Generator().manual_seed(seed)
        a, b = _twin_caches(gen)
        locs = torch.randperm(HOST, generator=gen)[: SLOTS // 2 + 8 * seed] + 1
        locs[0] = 0  # the sink: never placed
        per_layer = torch.stack(
            [place_slots(a.cache, layer, locs, PINNED_PRIORITY) for layer in range(LAYERS)]
        )
        at_once = place_slots_all_layers(b.cache, locs, PINNED_PRIORITY)
        assert torch.equal(per_layer, at_once)
        sa, sb = _state(a), _state(b)
        for key in sa:
            assert torch.equal(sa[key], sb[key]), (seed, key)


@pytest.mark.parametrize("lanes", [16, 1024])
def test_all_layers_placement_kernel_equals_its_reference(monkeypatch, lanes):
    """The one-launch placement (a program per layer) against the torch one, from the same
    cache states: more ids than some layers' free slots, ids already resident, the sink in
    the list; with 16 lanes a step, several steps of the loop per layer."""
    from sglang_echo.kernels import decode_write
    from sglang_echo.kernels.decode_write import (
        place_slots_all_layers,
        place_slots_all_layers_kernel,
    )

    monkeypatch.setattr(decode_write, "PLACE_LANES", lanes)
    for seed in range(4):
        gen = torch.Generator().manual_seed(seed)
        a, b = _twin_caches(gen)
        locs = torch.randperm(HOST, generator=gen)[: SLOTS // 2 + 12 * seed] + 1
        locs[1] = 0  # the sink: never placed
        expected = place_slots_all_layers(a.cache, locs, PINNED_PRIORITY)
        got = place_slots_all_layers_kernel(b.cache, locs, PINNED_PRIORITY)
        assert torch.equal(got, expected), seed
        sa, sb = _state(a), _state(b)
        for key in sa:
            assert torch.equal(sa[key], sb[key]), (seed, key)
    assert (a.cache.free_count == 0).any(), "some layer ran out of free slots"


def test_filling_by_extents_writes_what_the_scatter_writes():
    """Long runs by copy engine, the rest by the scatter (offload/host_extents.py): the
    same host rows, device rows and keys as the scatter alone, runs at either end too."""
    short = list(range(300, 320, 2))  # interleaved decode-like locations
    for host_locs in (
        list(range(5, 105)),  # one run
        [*range(5, 45), *short, *range(200, 260), 399],  # runs, a scatter, a single
        short,  # no run at all
    ):
        n = len(host_locs)
        locs = torch.tensor(host_locs)
        gen = torch.Generator().manual_seed(n)
        kv = [torch.randn(n, WIDTH, generator=gen) for _ in range(LAYERS)]
        keys = [torch.randn(n, INDEX, generator=gen) for _ in range(LAYERS)]
        plain, by_extents = _cache(), _cache()
        extents = split_extents(host_locs, min_tokens=16)
        assert extents.tokens_in_runs + extents.rest.numel() == n
        for c, ext in ((plain, None), (by_extents, extents)):
            slots = c.reserve_prompt(locs)
            for layer in range(LAYERS):
                c.fill_prompt(layer, locs, kv[layer], keys[layer], slots[layer], ext)
            c.unpin_prompt(slots)
        a, b = _state(plain), _state(by_extents)
        for key in a:
            assert torch.equal(a[key], b[key]), key


def test_fill_prompt_parts_write_what_all_writes():
    """A transfer runs the host part (copies) and the device part (keys, placed rows) on
    two streams, in either order: together they write exactly what ``part="all"`` does,
    from a window into a bank (the transfer's form) and with some lanes unplaced."""
    from sglang_echo.model.periodic_rows import PeriodicRows

    host_locs = [*range(5, 45), *range(300, 320, 2), *range(200, 260)]
    n = len(host_locs)
    locs = torch.tensor(host_locs)
    gen = torch.Generator().manual_seed(1)
    banks = [torch.randn(13, WIDTH, generator=gen) for _ in range(LAYERS)]
    keys = [torch.randn(n, INDEX, generator=gen) for _ in range(LAYERS)]
    extents = split_extents(host_locs, min_tokens=16)
    states = []
    for order in (("all",), ("host", "device"), ("device", "host")):
        c = _cache()
        slots = c.reserve_prompt(locs)
        for part in order:
            for layer in range(LAYERS):
                window = PeriodicRows(banks[layer], 3, n)
                c.fill_prompt(layer, locs, window, keys[layer], slots[layer], extents, part)
        c.unpin_prompt(slots)
        states.append(_state(c))
    assert (states[0]["free"] == 0).all(), "more lanes than slots: some lanes unplaced"
    for other in states[1:]:
        for key in states[0]:
            assert torch.equal(states[0][key], other[key]), key
    with pytest.raises(ValueError, match="part must be one of"):
        _cache().fill_prompt(0, locs, banks[0][:n], keys[0], None, None, part="rows")


def test_split_extents_covers_every_position_once():
    gen = torch.Generator().manual_seed(0)
    scatter = (torch.randperm(5000, generator=gen)[:300] + 10_000).tolist()
    locs = [*range(100, 2100), *scatter, *range(7000, 8500), 3]
    ext = split_extents(locs, min_tokens=1024)
    assert ext.runs == ((0, 100, 2000), (2300, 7000, 1500))
    covered = sorted([p for s, _, k in ext.runs for p in range(s, s + k)] + ext.rest.tolist())
    assert covered == list(range(len(locs)))
    for s, first, k in ext.runs:  # each run really is ascending by one from its host start
        assert locs[s : s + k] == list(range(first, first + k))
    assert split_extents([]).runs == () and split_extents([]).rest.numel() == 0
    with pytest.raises(ValueError, match="min_tokens"):
        split_extents([1, 2], min_tokens=0)


class _KernelCount(TorchDispatchMode):
    """Ops that launch work (views and allocations excluded), as a GPU would see them."""

    NO_LAUNCH = frozenset(
        [
            "select",
            "slice",
            "view",
            "expand",
            "alias",
            "detach",
            "unsqueeze",
            "squeeze",
            "reshape",
            "_unsafe_view",
            "as_strided",
            "t",
            "transpose",
            "lift_fresh",
            "empty",
            "resize_",
            "permute",
            "split",
            "unbind",
        ]
    )

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in self.NO_LAUNCH:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _arrival_launches(layers: int, fuse_extend: bool) -> int:
    """Launches of an arrival's engine-thread share (the row's predictors reset, the
    prompt's slots reserved in every layer) on a cache of ``layers`` layers."""
    config = EchoConfig(offload=True, dev_cache_size=SLOTS, fuse_extend=fuse_extend)
    c = EchoKVCache(config, layers, HOST, WIDTH, INDEX, torch.float32, "cpu")
    c.bind_request_rows(4)
    locs, _, _ = _prompt(30, seed=1)
    with _KernelCount() as counter:
        c.admit_row(2)
        c.reserve_prompt(locs)
    return counter.count


@pytest.mark.parametrize("fuse_extend", [False, True])
def test_an_arrivals_engine_thread_launches_do_not_grow_with_layers(fuse_extend):
    # Why: the engine thread admits while running requests wait; a reset per layer and
    # predictor cost ~180 launches per admission on a 61-layer model. Both prefetchers'
    # per-layer state lives in [layers, rows] tensors, reset in two launches each.
    assert _arrival_launches(2, fuse_extend) == _arrival_launches(7, fuse_extend)


def test_a_reset_row_forgets_every_layers_prediction_and_nothing_else():
    config = EchoConfig(offload=True, dev_cache_size=SLOTS, fuse_extend=True)
    c = EchoKVCache(config, 3, HOST, WIDTH, INDEX, torch.float32, "cpu")
    c.bind_request_rows(4)
    for layer, p in enumerate(c.decode_prefetcher.predictors):
        p.update(torch.tensor([1.0 + layer, 2.0]), torch.tensor([1, 2]))
    for layer, p in enumerate(c.prefill_prefetch.offsets):
        p.update(torch.tensor([3.0 + layer, 4.0]), torch.tensor([1, 2]))
    c.admit_row(1)
    for p in c.decode_prefetcher.predictors:
        assert p.theta[1] == float("inf") and not p.finite[1]
        assert p.theta[2] == 2.0 and p.finite[2]
    for p in c.prefill_prefetch.offsets:
        assert p.offset[1] == 0.0 and not p.known[1]
        assert p.offset[2] == 4.0 and p.known[2]
