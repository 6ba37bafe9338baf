"""The HiSparse-like backend (a private LRU buffer per request and layer) on the CPU.

Lossless: greedy tokens and every step's logits equal the plain pool's (torch.equal) with
buffers barely larger than top-k, so every step evicts. Partitions: a resident token sits
only in its own request's slots, maps are inverse, and release frees everything.
"""

from __future__ import annotations

import random

import pytest
import torch

from sglang_echo.model.kv_cache import PlainKVCache
from sglang_echo.model.loader import load_model
from sglang_echo.offload.hisparse_cache import ABSENT, HiSparseKVCache
from sglang_echo.runtime.engine import Engine

BATCH, CONTEXT, CHUNK = 4, 256, 32


@pytest.fixture(scope="module")
def model(small_checkpoint):
    return load_model(small_checkpoint)


def _prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 259) for _ in range(rng.randint(20, 90))] for _ in range(n)]


def _run(model, cache, prompts, new: int):
    cap = sum(len(p) + new for p in prompts)
    engine = Engine(model, cache, cap, BATCH, CONTEXT, CHUNK, ignore_eos=True)
    return engine.generate(prompts, new, record_logits=True)


def _check_partitions(cache: HiSparseKVCache) -> None:
    b = cache.buffer_size
    for layer in range(cache.num_layers):
        s2h, h2s = cache.slot_to_host[layer], cache.host_to_slot[layer]
        used = (s2h[1:] > 0).nonzero().squeeze(1) + 1
        hosts = s2h[used]
        assert torch.equal(h2s[hosts], used)  # inverse maps over resident tokens
        assert torch.equal(cache.owner[hosts], (used - 1) // b)  # each in its own partition
        mapped = (h2s[1:] != ABSENT).nonzero().squeeze(1) + 1
        assert mapped.numel() == used.numel()


@pytest.mark.parametrize(
    ("buffer_size", "kernel"), [(20, False), (40, False), (20, True)], ids=["b20", "b40", "kernel"]
)
def test_hisparse_like_is_lossless_under_eviction(model, buffer_size, kernel, monkeypatch):
    if kernel:  # the recall kernel, as on CUDA, under the Triton interpreter
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    cfg = model.config
    assert buffer_size >= cfg.index_topk
    prompts = _prompts(buffer_size, 6)
    new = 24
    cap = sum(len(p) + new for p in prompts)
    plain = _run(model, PlainKVCache.for_model(cfg, cap, torch.float32, "cpu"), prompts, new)
    cache = HiSparseKVCache.for_model(
        cfg, cap, BATCH, buffer_size, torch.float32, "cpu", use_kernels=kernel
    )
    assert cache.use_kernels == kernel
    got = _run(model, cache, prompts, new)
    assert [r.output for r in got] == [r.output for r in plain]
    for a, b in zip(got, plain, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a.step_logits, b.step_logits, strict=True))
    tel = cache.telemetry()
    assert sum(tel["evictions"]) > 0 and 0 < min(tel["hit_rate"]) < 1
    # Every request ended: every slot is free and nothing stays mapped.
    assert cache.free_slots() == [BATCH * buffer_size] * cfg.num_hidden_layers
    assert bool((cache.host_to_slot[:, 1:] == ABSENT).all())


def test_partitions_hold_only_their_own_tokens(model):
    cfg = model.config
    prompts = _prompts(5, 4)
    cap = sum(len(p) + 8 for p in prompts)
    cache = HiSparseKVCache.for_model(cfg, cap, BATCH, 24, torch.float32, "cpu")
    engine = Engine(model, cache, cap, BATCH, CONTEXT, CHUNK, ignore_eos=True)
    checked = []

    def inspect(_req) -> None:  # called as each request ends, others still resident
        _check_partitions(cache)
        checked.append(True)

    engine.generate(prompts, 8, on_request_done=inspect)
    assert len(checked) == len(prompts)


def test_server_with_enable_hisparse_matches_the_plain_pool(small_checkpoint):
    """``--enable-hisparse --hisparse-config '{"device_buffer_size": 20}'``: the served
    greedy tokens equal the plain pool's (buffers of 20 rows for top-k 16: evictions)."""
    import asyncio

    import aiohttp

    from server_utils import make_serving, running_server
    from sglang_echo.config import EchoConfig

    prompts = _prompts(9, 6)

    async def run_all(url):
        async with aiohttp.ClientSession() as s:

            async def one(ids):
                sp = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
                async with s.post(
                    url + "/generate", json={"input_ids": ids, "sampling_params": sp}
                ) as r:
                    assert r.status == 200, await r.text()
                    return (await r.json())["output_ids"]

            return await asyncio.gather(*(one(p) for p in prompts))

    outs = {}
    for name, flags in (
        ("plain", {}),
        ("hisparse", {"enable_hisparse": True, "hisparse_config": '{"device_buffer_size": 20}'}),
    ):
        serving = make_serving(
            small_checkpoint, EchoConfig(offload=False), max_total_tokens=1500,
            max_running_requests=BATCH, chunked_prefill_size=CHUNK, context_length=CONTEXT, **flags,
        )  # fmt: skip
        with running_server(serving) as (url, _app):
            outs[name] = asyncio.run(run_all(url))
        if name == "hisparse":
            assert serving.info["kv_backend"] == "hisparse"
            assert sum(serving.kv_cache.telemetry()["evictions"]) > 0
    assert outs["hisparse"] == outs["plain"]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--hisparse-config", '{"device_buffer_size": 64}'], "needs --enable-hisparse"),
        (["--enable-hisparse", "--hisparse-config", "{bad"], "not valid JSON"),
        (["--enable-hisparse", "--hisparse-config", '{"top_k": 3}'], "device_buffer_size"),
        (["--enable-hisparse", "--hisparse-config", '{"device_buffer_size": 0}'], "positive"),
    ],
)
def test_bad_hisparse_flags(argv, needle):
    from sglang_echo.runtime.server_args import ServerArgError, parse_server_args

    with pytest.raises(ServerArgError) as err:
        parse_server_args(["--model-path", "m", *argv])
    assert needle in str(err.value)


def test_hisparse_buffer_must_hold_top_k_and_excludes_echo(small_checkpoint):
    from server_utils import make_serving
    from sglang_echo.config import ConfigError, EchoConfig

    with pytest.raises(ConfigError, match="at least 16"):
        make_serving(
            small_checkpoint, EchoConfig(offload=False), max_total_tokens=500,
            enable_hisparse=True, hisparse_config='{"device_buffer_size": 8}',
        )  # fmt: skip
    with pytest.raises(ConfigError, match="keep one"):
        make_serving(
            small_checkpoint, EchoConfig(offload=True, dev_cache_size=4096),
            max_total_tokens=500, enable_hisparse=True,
        )  # fmt: skip
