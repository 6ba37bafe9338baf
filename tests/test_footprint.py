"""Each ECHO buffer owner's ``bytes_for`` (offload/footprint.py, kernels/alloc_geometry.py)
equals the bytes of the tensors it allocates, so the sizing that sums them before anything
exists (the plugin's launcher, the runtime's token budget) counts every buffer: a tensor
added to an owner without its formula fails here."""

from __future__ import annotations

import pytest
import torch

from sglang_echo.kernels.alloc_common import AllocWorkspace
from sglang_echo.offload import footprint
from sglang_echo.offload.decode_prefetcher import DecodePrefetcher
from sglang_echo.offload.device_cache import DeviceCache
from sglang_echo.offload.host_pool import HostKVPool
from sglang_echo.offload.manager import EchoManager


def tensor_bytes(obj: object) -> int:
    return sum(v.nbytes for v in vars(obj).values() if isinstance(v, torch.Tensor))


SIZES = [  # (layers, slots, host tokens, row bytes, eviction reserve, max lanes)
    (1, 2, 0, 0, 0, 1),
    (3, 64, 100, 16, 2, 64),
    (2, 3000, 5000, 1152, 94, 4100),  # past one slot block and one lane block
    (61, 4096, 9000, 656, 128, 2048),
]


@pytest.mark.parametrize("layers, slots, host, row, reserve, lanes", SIZES)
def test_device_cache_counts_every_tensor(layers, slots, host, row, reserve, lanes):
    cache = DeviceCache(layers, slots, host, row, torch.uint8, "meta", reserve)
    assert DeviceCache.bytes_for(layers, slots, host, row) == tensor_bytes(cache) == cache.nbytes


@pytest.mark.parametrize("layers, slots, host, row, reserve, lanes", SIZES)
def test_alloc_workspace_counts_every_tensor(layers, slots, host, row, reserve, lanes):
    cache = DeviceCache(layers, slots, host, 0, torch.uint8, "meta", reserve)
    workspace = AllocWorkspace(cache, max_lanes=lanes)
    assert AllocWorkspace.bytes_for(slots, lanes, reserve) == tensor_bytes(workspace)


@pytest.mark.parametrize("layers", [1, 4])
def test_manager_counters_and_decode_prefetcher(layers):
    host_tokens, row, slots, requests = 100, 32, 64, 5
    host = HostKVPool(layers, host_tokens, row, torch.uint8, pin=False)
    cache = DeviceCache(layers, slots, host_tokens, row, torch.uint8, "cpu")
    manager = EchoManager(host, cache, use_kernels=False)
    counters = (manager.prefetched_rows, manager.prefetch_hits, manager.release_errors)
    assert footprint.manager_counter_bytes(layers) == sum(t.nbytes for t in counters)
    for chunks in (1, 2):
        p = DecodePrefetcher(manager, requests, cap=16, chunks=chunks)
        want = DecodePrefetcher.bytes_for(requests, host_tokens, row, layers, chunks, 16)
        assert want == p.nbytes


def test_echo_metadata_is_the_sum_of_its_owners():
    """What the plugin's sizing adds for ECHO's metadata, per owner."""
    layers, slots, host, reserve = 4, 4096, 20_000, 128
    cache = DeviceCache(layers, slots, host, 0, torch.uint8, "meta", reserve)
    workspace = AllocWorkspace(cache, max_lanes=slots)
    want = tensor_bytes(cache) + tensor_bytes(workspace) + 8 * (2 * layers + 1)
    assert footprint.echo_metadata_bytes(layers, slots, host, reserve) == want


def test_the_runtimes_token_budget_sums_the_owners(small_checkpoint, monkeypatch):
    """runtime/serving.memory_token_budget under ECHO: the largest host-token count whose
    device bytes (index keys, the cache over those host ids, its workspace and counters,
    each as its owner counts it) fit the budget; one token more would not."""
    from sglang_echo.config import EchoConfig
    from sglang_echo.model.config import load_config
    from sglang_echo.runtime import serving

    cfg = load_config(small_checkpoint)
    echo = EchoConfig(offload=True, dev_cache_size=256)
    host_bytes = 64 * 2**20
    monkeypatch.setattr(serving, "_host_available_bytes", lambda: host_bytes)
    fraction = 0.25
    tokens = serving.memory_token_budget(cfg, torch.float32, torch.device("cpu"), echo, fraction)
    kv_b, idx_b = serving._token_bytes(cfg, torch.float32)
    layers = cfg.num_hidden_layers

    def device_bytes(t: int) -> int:
        return t * idx_b + footprint.echo_device_bytes(
            layers, 256, t, kv_b // layers, echo.eviction_reserve
        )

    budget = host_bytes * fraction
    on_host = int(host_bytes * 0.5 // kv_b)
    if tokens < on_host:  # bound by the device budget: tight there
        assert device_bytes(tokens) <= budget < device_bytes(tokens + 1)
    else:
        assert device_bytes(tokens) <= budget
