"""A decode step's new tokens (``write(..., decode=True)``) go to ECHO's host pool and, in
the same launch, into free device slots while the free stack lasts (kernels/
decode_write.py): no allocation pass, and the step's resolve finds them resident (a hit,
nothing recalled). With no free slot, or SGLANG_ECHO_DECODE_PLACE=0, they are host-only
and the resolve recalls them like any other miss. Prefill writes still append. A decode
step therefore allocates once per layer (its resolve), not twice."""

from __future__ import annotations

import torch

from sglang_echo.config import EchoConfig
from sglang_echo.model.loader import load_model
from sglang_echo.offload.device_cache import ABSENT
from sglang_echo.offload.echo_cache import EchoKVCache
from sglang_echo.runtime.engine import Engine
from sglang_echo.runtime.kv_factory import echo_cache_for_model

ROW, INDEX = 6, 4


def _cache(slots: int = 16, host: int = 64, place: bool = True) -> EchoKVCache:
    config = EchoConfig(offload=True, dev_cache_size=slots, eviction_reserve=0, decode_place=place)
    return EchoKVCache(config, 1, host, ROW, INDEX, torch.float32, "cpu", pin=False)


def _write_decode(kv: EchoKVCache) -> torch.Tensor:
    kv.write(0, torch.arange(1, 6), torch.randn(5, ROW), torch.randn(5, INDEX))  # prefill
    rows = torch.randn(2, ROW)
    kv.write(0, torch.tensor([6, 7]), rows, torch.randn(2, INDEX), decode=True)
    assert torch.equal(kv.host.rows[0, 6:8], rows), "the host rows are written at once"
    return rows


def test_a_decode_write_takes_a_free_slot_and_its_selection_hits() -> None:
    kv = _cache()
    c = kv.cache
    free_before = int(c.free_count[0]) - 5  # after the prefill's five
    rows = _write_decode(kv)
    assert int(c.free_count[0]) == free_before - 2 and int(c.append_evictions[0]) == 0
    for i, h in enumerate((6, 7)):
        s = int(c.host_to_device[0, h])
        assert s != ABSENT and torch.equal(c.rows[0, s], rows[i])
    misses, recalled = int(c.misses[0]), int(c.recalled_rows[0])
    buffer, slots = kv.resolve(0, torch.tensor([[1, 6, -1, 3]]))
    assert int(c.misses[0]) == misses and int(c.recalled_rows[0]) == recalled, "no recall"
    assert torch.equal(buffer[int(slots[0, 1])], rows[0])


def test_without_a_free_slot_a_decode_write_is_host_only_and_recalled() -> None:
    """Five slots, all taken by the prefill: the decode write never evicts."""
    kv = _cache(slots=5)
    rows = _write_decode(kv)
    c = kv.cache
    assert all(int(c.host_to_device[0, i]) == ABSENT for i in (6, 7)), "no device slot"
    assert int(c.free_count[0]) == 0 and int(c.append_evictions[0]) == 0
    misses, recalled = int(c.misses[0]), int(c.recalled_rows[0])
    buffer, slots = kv.resolve(0, torch.tensor([[1, 6, -1, 3]]))
    assert int(c.misses[0]) == misses + 1 and int(c.recalled_rows[0]) == recalled + 1
    assert torch.equal(buffer[int(slots[0, 1])], rows[0])
    assert int(c.host_to_device[0, 7]) == ABSENT, "unselected: still host-only"


def test_decode_place_off_writes_the_host_only() -> None:
    kv = _cache(place=False)
    _write_decode(kv)
    assert all(int(kv.cache.host_to_device[0, i]) == ABSENT for i in (6, 7))


def _write_prompt(kv: EchoKVCache, first: int, n: int) -> torch.Tensor:
    rows = torch.randn(n, ROW)
    kv.write_prompt(0, torch.arange(first, first + n), rows, torch.randn(n, INDEX))
    assert torch.equal(kv.host.rows[0, first : first + n], rows), "every host row written"
    return rows


def test_a_transferred_prompt_is_placed_while_free_slots_last_and_then_hits() -> None:
    """Dynamic residency: a decode node's prompt takes free slots (oldest priority), never
    evicts; a resolve of its placed rows recalls nothing."""
    kv = _cache(slots=16)
    c = kv.cache
    rows = _write_prompt(kv, 1, 10)
    assert int(c.free_count[0]) == 6 and int(c.append_evictions[0]) == 0
    for i in range(10):
        s = int(c.host_to_device[0, 1 + i])
        assert s != ABSENT and torch.equal(c.rows[0, s], rows[i])
        assert int(c.priority[0, s]) == 0
    buffer, slots = kv.resolve(0, torch.tensor([[1, 5, 10, -1]]))
    assert int(c.misses[0]) == 0 and int(c.recalled_rows[0]) == 0
    assert torch.equal(buffer[int(slots[0, 2])], rows[9])
    _write_prompt(kv, 20, 10)  # room for six: the first six in order, the rest host-only
    placed = [int(c.host_to_device[0, h]) != ABSENT for h in range(20, 30)]
    assert placed == [True] * 6 + [False] * 4 and int(c.free_count[0]) == 0
    assert int(c.append_evictions[0]) == 0 and int(c.evictions[0]) == 0


def test_under_pressure_placed_prompt_rows_are_the_first_victims() -> None:
    """Rows a step selected (3, 4: stamped by the resolve) outlive a placed prompt's rows
    no step selected, though the prompt came later."""
    kv = _cache(slots=8)
    c = kv.cache
    kv.write(0, torch.arange(1, 5), torch.randn(4, ROW), torch.randn(4, INDEX))  # prefill
    kv.resolve(0, torch.tensor([[1, 2, 3, 4]]))
    _write_prompt(kv, 10, 4)  # the last four free slots
    _write_prompt(kv, 20, 1)  # no room: host-only
    assert int(c.free_count[0]) == 0 and int(c.host_to_device[0, 20]) == ABSENT
    kv.resolve(0, torch.tensor([[1, 2, 20, -1]]))  # one miss: one victim
    assert int(c.evictions[0]) == 1
    assert all(int(c.host_to_device[0, h]) != ABSENT for h in (1, 2, 3, 4, 20))
    assert sum(int(c.host_to_device[0, h]) == ABSENT for h in range(10, 14)) == 1


def test_decode_place_off_leaves_a_transferred_prompt_host_only() -> None:
    kv = _cache(place=False)
    _write_prompt(kv, 1, 4)
    assert all(int(kv.cache.host_to_device[0, h]) == ABSENT for h in range(1, 5))
    assert int(kv.cache.free_count[0]) == 16


def test_a_prefill_write_still_appends_to_the_device_cache() -> None:
    kv = _cache()
    rows = torch.randn(3, ROW)
    kv.write(0, torch.tensor([1, 2, 3]), rows, torch.randn(3, INDEX))
    for i, h in enumerate((1, 2, 3)):
        s = int(kv.cache.host_to_device[0, h])
        assert s != ABSENT and torch.equal(kv.cache.rows[0, s], rows[i])


def test_a_decode_step_allocates_once_per_layer(checkpoints) -> None:
    """Counted through the engine: prefill chunks append and resolve (two allocations per
    layer), each decode step only resolves (one)."""
    model = load_model(checkpoints["default-rope"], dtype=torch.float32)
    cfg = model.config
    prompts, new_tokens = [[5, 9, 11, 4, 7, 3, 8], [6, 2, 10]], 4
    capacity = sum(len(p) + new_tokens for p in prompts)
    echo = EchoConfig(offload=True, dev_cache_size=2 * cfg.index_topk + 16, eviction_reserve=0)
    kv = echo_cache_for_model(echo, cfg, capacity, torch.float32, "cpu")
    calls: list[bool] = []
    allocate = kv.manager._allocate

    def counting(layer: int, ids: torch.Tensor, append: bool, distinct: bool = False):
        calls.append(append)
        return allocate(layer, ids, append, distinct)

    kv.manager._allocate = counting
    engine = Engine(
        model, kv, capacity, 2, max(map(len, prompts)) + new_tokens, 16, ignore_eos=True
    )
    done = engine.generate(prompts, new_tokens)
    assert all(len(r.output) == new_tokens for r in done)
    layers = cfg.num_hidden_layers
    # One prefill step (both prompts fit a chunk), then new_tokens - 1 decode steps.
    appends, resolves = calls.count(True), calls.count(False)
    assert appends == layers, f"only the prefill appends: {appends} appends"
    assert resolves == layers * new_tokens, f"{resolves} resolves"
