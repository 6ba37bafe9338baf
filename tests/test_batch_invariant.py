"""SGLANG_ECHO_BATCH_INVARIANT=1: a request's decode logits do not depend on its batch.

Served ECHO and served no-offload decode different batch sizes, and a GEMM library rounds
a row by the batch's size; with the setting on, every matmul of the forward runs the
batch-invariant GEMM (kernels/invariant_matmul.py), so each request of a batch of six gets
the very logits it gets alone, on the plain pool, and so does ECHO decoding them in
batches of three with evictions (lossless and batch invariant together). The tiny model,
float32, the Triton interpreter.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from sglang_echo.config import ENV_BATCH_INVARIANT, EchoConfig, settings
from sglang_echo.model.attention import ModelKernels
from sglang_echo.model.kv_cache import PlainKVCache
from sglang_echo.model.layers import Linear
from sglang_echo.model.loader import load_model
from sglang_echo.runtime.engine import Engine, Request
from sglang_echo.runtime.kv_factory import echo_cache_for_model

STEPS = 4
BATCH = 6
ECHO_BATCH = 3
# Small enough for ECHO's legal minimum cache to be below the context (evictions), and
# to split a prompt across prefill chunks in the batched run.
CHUNK = 16


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 259) for _ in range(rng.randint(18, 40))] for _ in range(BATCH)]


def _run(model, prompts: list[list[int]], batch: int, echo: bool = False):
    """Greedy decode with every step's logits recorded; ECHO at its legal minimum cache."""
    cfg = model.config
    capacity = sum(len(p) + STEPS for p in prompts)
    context = max(len(p) for p in prompts) + STEPS
    if echo:
        smallest = EchoConfig(offload=True, dev_cache_size=1)
        legal_min = smallest.min_dev_cache_size(batch, cfg.index_topk, CHUNK)
        config = EchoConfig(offload=True, dev_cache_size=legal_min)
        cache = echo_cache_for_model(config, cfg, capacity, torch.float32, "cpu")
    else:
        cache = PlainKVCache.for_model(cfg, capacity, torch.float32, "cpu")
    engine = Engine(model, cache, capacity, batch, context, CHUNK, ignore_eos=True)
    return engine.generate(prompts, STEPS, record_logits=True), cache


def _same_logits(a: Request, b: Request) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.step_logits, b.step_logits, strict=True))


@pytest.fixture(scope="module")
def invariant(checkpoints):
    """The model with the setting on, and each request decoded alone on the plain pool."""
    model = load_model(checkpoints["default-rope"], kernels=ModelKernels(batch_invariant=True))
    alone = [_run(model, [p], 1)[0][0] for p in _prompts()]
    return model, alone


def test_batch_of_six_equals_each_request_alone(invariant):
    model, alone = invariant
    together, _ = _run(model, _prompts(), BATCH)
    for i, (a, b) in enumerate(zip(together, alone, strict=True)):
        assert a.output == b.output, i
        assert len(a.step_logits) == STEPS
        assert _same_logits(a, b), f"request {i}: batched logits differ from alone"


def test_echo_under_eviction_in_a_batch_equals_plain_alone(invariant):
    """ECHO decoding three at a time at its legal minimum cache (48 slots: the six
    prompts' rows do not fit, so steps evict; at six at a time the minimum, 96 slots,
    holds these short contexts whole) vs the plain pool, one request at a time."""
    model, alone = invariant
    together, cache = _run(model, _prompts(), ECHO_BATCH, echo=True)
    tel = cache.telemetry()
    assert sum(tel["evictions"]) + sum(tel["append_evictions"]) > 0  # the cache was tight
    for i, (a, b) in enumerate(zip(together, alone, strict=True)):
        assert a.output == b.output, i
        assert _same_logits(a, b), f"request {i}: ECHO batched logits differ from plain alone"


def test_off_the_batch_changes_the_logits(checkpoints):
    """The same comparison with the setting off: on this CPU (MKL picks its kernels by M)
    some request's logits differ, so the tests above can fail."""
    model = load_model(checkpoints["default-rope"])
    together, _ = _run(model, _prompts(), BATCH)
    alone = [_run(model, [p], 1)[0][0] for p in _prompts()]
    assert not all(_same_logits(a, b) for a, b in zip(together, alone, strict=True))


def test_the_setting_is_handed_down_and_off_by_default(checkpoints, monkeypatch):
    def modes(model) -> set[bool]:
        return {m.batch_invariant for m in model.modules() if hasattr(m, "batch_invariant")}

    assert settings().batch_invariant is False and ModelKernels().batch_invariant is False
    assert modes(load_model(checkpoints["default-rope"])) == {False}
    monkeypatch.setenv(ENV_BATCH_INVARIANT, "1")
    from sglang_echo.config import load_settings

    kernels = ModelKernels.from_settings(load_settings())
    assert kernels.batch_invariant is True
    model = load_model(checkpoints["default-rope"], kernels=kernels)
    assert modes(model) == {True}
    assert isinstance(model.lm_head, Linear) and model.lm_head.batch_invariant
    ModelKernels().apply(model)  # switched back off
    assert modes(model) == {False}


def test_off_a_linear_is_f_linear():
    layer = Linear(24, 40, bias=True)
    x = torch.randn(5, 24)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    layer.batch_invariant = True
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))


def test_the_setting_is_refused_at_start_up_where_its_kernel_cannot_run(monkeypatch):
    """On the CPU without the Triton interpreter the invariant GEMM cannot run: the start-up
    says so (a served request's first decode step failed instead)."""
    from sglang_echo.runtime.assemble import resolve_start_up

    monkeypatch.setenv(ENV_BATCH_INVARIANT, "1")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match=r"needs a CUDA device.*TRITON_INTERPRET=1"):
        resolve_start_up("cpu", "float32")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_start_up("cpu", "float32").kernels.batch_invariant
