"""The study worker under SGLANG_ECHO_BATCH_INVARIANT=1: a request's logits do not depend on
its batch, routed MoE included.

Why: served ECHO and served no-offload decode the study worker (benchmark/study/worker.py)
at different batch sizes (about 14 against 3 at rate inf), so their greedy tokens agree
only if every op of the forward rounds a row the same whatever its batch. The tiny model's
test (tests/test_batch_invariant.py) covers the model's own layers; the worker swaps every
FFN for ``LocalRoutedMoE``, whose router, grouped expert GEMMs and pair sums must be
invariant too. On the CPU (interpreter) at the smoke dimensions; the GPU test runs the
worker at DeepSeek-V3.2's attention dimensions through CUDA graphs, where a CUDA
reduction's thread layout (set by the number of rows) is what the mode must avoid.
"""

from __future__ import annotations

import random

import pytest
import torch

from benchmark.study.moe import LocalRoutedMoE
from benchmark.study.worker import DSV32_DIMS, SMOKE_DIMS, SMOKE_MOE, build_worker, study_config
from sglang_echo.config import EchoConfig
from sglang_echo.model.attention import ModelKernels
from sglang_echo.model.kv_cache import PlainKVCache
from sglang_echo.model.layers import set_batch_invariant
from sglang_echo.runtime.engine import Engine, Request
from sglang_echo.runtime.kv_factory import echo_cache_for_model

STEPS = 4
BATCH = 6
ECHO_BATCH = 3
CHUNK = 16


def _moe(dtype: torch.dtype, invariant: bool) -> LocalRoutedMoE:
    moe = LocalRoutedMoE(64, seed=5, dtype=dtype, **SMOKE_MOE)
    set_batch_invariant(moe, invariant)  # the router, experts and the shared expert's Linears
    return moe


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_invariant_moe_rows_equal_alone_and_the_reference(dtype: torch.dtype) -> None:
    moe = _moe(dtype, invariant=True)
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    together = moe(x)
    for i in range(x.shape[0]):
        assert torch.equal(moe(x[i : i + 1])[0], together[i]), i
    ref = moe.reference(x)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert ((together.float() - ref).norm() / ref.norm()).item() < tol


def test_invariant_moe_routes_as_the_default_on_float32() -> None:
    """The mode changes how sums are ordered, not which experts serve a token."""
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    _, experts_on, weights_on = _moe(torch.float32, True).route(x)
    _, experts_off, weights_off = _moe(torch.float32, False).route(x)
    assert torch.equal(experts_on, experts_off)
    torch.testing.assert_close(weights_on, weights_off)


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(18, 40))] for _ in range(BATCH)]


def _run(model, prompts, batch: int, echo: bool, device: str, graphs: bool) -> list[Request]:
    """Greedy decode with every step's logits; ECHO at its legal minimum cache (evicting)."""
    cfg, dtype = model.config, model.lm_head.weight.dtype
    capacity = sum(len(p) + STEPS for p in prompts)
    context = max(len(p) for p in prompts) + STEPS
    if echo:
        legal_min = EchoConfig(offload=True, dev_cache_size=1).min_dev_cache_size(
            batch, cfg.index_topk, CHUNK
        )
        config = EchoConfig(offload=True, dev_cache_size=legal_min)
        cache = echo_cache_for_model(config, cfg, capacity, dtype, device)
    else:
        cache = PlainKVCache.for_model(cfg, capacity, dtype, device)
    engine = Engine(model, cache, capacity, batch, context, CHUNK, True, use_cuda_graph=graphs)
    return engine.generate(prompts, STEPS, record_logits=True)


def _check_batched_equal_alone(model, device: str, graphs: bool) -> None:
    prompts = _prompts(model.config.vocab_size)
    alone = [_run(model, [p], 1, False, device, graphs)[0] for p in prompts]
    for echo, batch in ((False, BATCH), (True, ECHO_BATCH)):
        together = _run(model, prompts, batch, echo, device, graphs)
        for i, (a, b) in enumerate(zip(together, alone, strict=True)):
            assert a.output == b.output, (echo, i)
            for step, (x, y) in enumerate(zip(a.step_logits, b.step_logits, strict=True)):
                assert torch.equal(x, y), f"echo={echo} request {i} step {step}"


# The worker's MoE shape at a quarter of the experts: the same kernels, a smaller test.
GPU_MOE = dict(intermediate=512, local_experts=8, global_experts=64, top_k=8, dp_ranks=8)


def _worker(dims: dict, moe: dict, device: str, dtype: torch.dtype):
    cfg = study_config(dims, 2, 256, 2048, "fp8_hadamard")
    model, _ = build_worker(cfg, moe, dtype, device)
    ModelKernels(batch_invariant=True).apply(model)
    assert all(m.batch_invariant for m in model.modules() if isinstance(m, LocalRoutedMoE))
    return model


def test_smoke_worker_batched_equals_alone_on_the_cpu() -> None:
    _check_batched_equal_alone(
        _worker(SMOKE_DIMS, SMOKE_MOE, "cpu", torch.float32), "cpu", graphs=False
    )


@pytest.mark.gpu
def test_worker_batched_equals_alone_through_cuda_graphs() -> None:
    """DeepSeek-V3.2's attention dimensions, bf16, decode graphs (padded buckets)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = _worker(DSV32_DIMS, GPU_MOE, "cuda", torch.bfloat16)
    _check_batched_equal_alone(model, "cuda", graphs=True)
