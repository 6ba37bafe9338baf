"""No leaks: after 10,000 request lifecycles (many aborted mid-decode) every device slot
and every host row is free again, in every layer."""

from __future__ import annotations

import random

import pytest
import torch

from sglang_echo.config import EchoConfig
from sglang_echo.offload.device_cache import ABSENT, FREE
from sglang_echo.offload.echo_cache import EchoKVCache
from sglang_echo.runtime.token_table import TokenSlotAllocator

LAYERS, TOPK, MAX_RUNNING, HOST_TOKENS = 2, 4, 4, 256


def test_10000_lifecycles_with_aborts_free_everything():
    rng = random.Random(0)
    n_g = MAX_RUNNING * TOPK
    cache = EchoKVCache(
        EchoConfig(offload=True, dev_cache_size=n_g),
        LAYERS,
        HOST_TOKENS,
        6,
        4,
        torch.float32,
        "cpu",
    )
    allocator = TokenSlotAllocator(HOST_TOKENS)
    running: list[dict] = []
    finished = aborted = 0

    def write(locs: list[int]) -> None:
        for s in range(0, len(locs), n_g):  # chunked prefill: a chunk fits the cache
            t = torch.tensor(locs[s : s + n_g])
            for layer in range(LAYERS):
                cache.write(layer, t, torch.randn(len(t), 6), torch.randn(len(t), 4))

    def end(req: dict) -> None:
        cache.release(torch.tensor(req["locs"]))
        allocator.free(req["locs"])
        running.remove(req)

    while finished + aborted < 10_000:
        while len(running) < MAX_RUNNING and allocator.num_free >= 60:
            req = {"locs": allocator.alloc(rng.randint(1, 40)), "target": rng.randint(1, 12)}
            write(req["locs"])
            running.append(req)
        for req in list(running):
            if rng.random() < 0.1:  # abort mid-decode
                end(req)
                aborted += 1
            elif req["target"] == 0:
                end(req)
                finished += 1
        if not running:
            continue
        new = [allocator.alloc(1)[0] for _ in running]
        for req, loc in zip(running, new, strict=True):
            req["locs"].append(loc)
            req["target"] -= 1
        write(new)
        sel = torch.full((len(running), TOPK), -1, dtype=torch.int64)
        for i, req in enumerate(running):
            picks = rng.sample(req["locs"], min(TOPK, len(req["locs"])))
            sel[i, : len(picks)] = torch.tensor(picks)
        for layer in range(LAYERS):
            cache.resolve(layer, sel)
    for req in list(running):
        end(req)

    c = cache.cache
    assert aborted > 1000 and finished > 1000
    assert allocator.num_free == HOST_TOKENS
    assert c.free_count.tolist() == [n_g] * LAYERS
    assert (c.host_to_device[:, 1 : HOST_TOKENS + 1] == ABSENT).all()
    assert (c.device_to_host[:, 1 : n_g + 1] == FREE).all()
    assert (c.priority[:, 1 : n_g + 1] == FREE).all()
    for layer in range(LAYERS):
        assert sorted(c.free_stack[layer, :n_g].tolist()) == list(range(1, n_g + 1))
    assert c.host_to_device[:, 0].tolist() == [0] * LAYERS  # the sink never moved
    assert sum(c.evictions.tolist()) > 0


def test_oversized_append_or_resolve_fails_clearly():
    cache = EchoKVCache(
        EchoConfig(offload=True, dev_cache_size=4), 1, 32, 6, 4, torch.float32, "cpu"
    )
    with pytest.raises(ValueError, match="NSA_DEV_CACHE_SIZE"):
        cache.write(0, torch.arange(1, 6), torch.randn(5, 6), torch.randn(5, 4))
    with pytest.raises(ValueError, match="exceeds the 4-slot device cache"):
        cache.resolve(0, torch.arange(1, 7).view(2, 3))


def test_clock_past_int32_keeps_the_sink_and_the_maps():
    """After 2^31 resolves of a layer the logical clock must not wrap (it once did)."""
    kv = EchoKVCache(EchoConfig(offload=True, dev_cache_size=4), 1, 16, 2, 1, torch.float32, "cpu")
    c = kv.cache
    c.clock[:] = torch.iinfo(torch.int32).max - 1
    for lo in (1, 5):
        rows = torch.arange(8.0).view(4, 2) + 10 * lo
        kv.write(0, torch.arange(lo, lo + 4), rows, torch.zeros(4, 1))
    kv.resolve(0, torch.tensor([[5, 6, 7, 8]]))
    _, slots = kv.resolve(0, torch.tensor([[1, 2, 3, 4]]))
    assert (slots >= 1).all()
    assert c.host_to_device[0, 0].item() == 0 and c.device_to_host[0, 0].item() == 0
    for h, s in zip([1, 2, 3, 4], slots[0].tolist(), strict=True):
        assert c.device_to_host[0, s].item() == h
        assert torch.equal(c.rows[0, s], kv.host.rows[0, h])
