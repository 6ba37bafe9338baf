"""A decode step's new tokens go to ECHO's host pool only (``write(..., decode=True)``): no
device slot and no allocation until a top-k selects them, and then the resolve recalls
their rows like any other miss. Prefill writes still append. A decode step therefore
allocates once per layer (its resolve), not twice."""

from __future__ import annotations

import torch

from sglang_echo.config import EchoConfig
from sglang_echo.model.loader import load_model
from sglang_echo.offload.device_cache import ABSENT
from sglang_echo.offload.echo_cache import EchoKVCache
from sglang_echo.runtime.engine import Engine
from sglang_echo.runtime.kv_factory import echo_cache_for_model

ROW, INDEX = 6, 4


def _cache(slots: int = 16, host: int = 64) -> EchoKVCache:
    config = EchoConfig(offload=True, dev_cache_size=slots, eviction_reserve=0)
    return EchoKVCache(config, 1, host, ROW, INDEX, torch.float32, "cpu", pin=False)


def test_a_decode_write_takes_no_slot_and_its_first_selection_recalls_it() -> None:
    kv = _cache()
    prefill = torch.arange(1, 6)
    kv.write(0, prefill, torch.randn(5, ROW), torch.randn(5, INDEX))
    c = kv.cache
    free_before = int(c.free_count[0])
    new = torch.tensor([6, 7])
    rows, keys = torch.randn(2, ROW), torch.randn(2, INDEX)
    kv.write(0, new, rows, keys, decode=True)
    assert torch.equal(kv.host.rows[0, new], rows), "the host row is written at once"
    assert torch.equal(kv.index_keys(0)[new], keys), "the indexer scores it at once"
    assert all(int(c.host_to_device[0, i]) == ABSENT for i in new), "no device slot yet"
    assert int(c.free_count[0]) == free_before and int(c.append_evictions[0]) == 0
    misses, recalled = int(c.misses[0]), int(c.recalled_rows[0])
    buffer, slots = kv.resolve(0, torch.tensor([[1, 6, -1, 3]]))
    assert int(c.misses[0]) == misses + 1 and int(c.recalled_rows[0]) == recalled + 1
    s = int(slots[0, 1])
    assert int(c.host_to_device[0, 6]) == s and torch.equal(buffer[s], rows[0])
    assert int(c.host_to_device[0, 7]) == ABSENT, "unselected: still host-only"


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

    def counting(layer: int, ids: torch.Tensor, append: bool):
        calls.append(append)
        return allocate(layer, ids, append)

    kv.manager._allocate = counting
    engine = Engine(model, kv, capacity, 2, max(map(len, prompts)) + new_tokens, 16)
    done = engine.generate(prompts, new_tokens)
    assert all(len(r.output) == new_tokens for r in done)
    layers = cfg.num_hidden_layers
    # One prefill step (both prompts fit a chunk), then new_tokens - 1 decode steps.
    appends, resolves = calls.count(True), calls.count(False)
    assert appends == layers, f"only the prefill appends: {appends} appends"
    assert resolves == layers * new_tokens, f"{resolves} resolves"
