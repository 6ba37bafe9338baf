"""CUDA: the serving scheduler with CUDA-graph decode (batch sizes up to the graph limit,
larger ones eager) and ECHO at its smallest legal cache gives offline generate's tokens."""

from __future__ import annotations

import random

import pytest
import torch

from sglang_echo.config import EchoConfig
from sglang_echo.model.kv_cache import PlainKVCache
from sglang_echo.model.loader import load_model
from sglang_echo.runtime.engine import Engine
from sglang_echo.runtime.kv_factory import echo_cache_for_model
from sglang_echo.runtime.request import SamplingParams, ServeRequest
from sglang_echo.runtime.scheduler import Scheduler
from sglang_echo.runtime.step_runner import StepRunner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("name", ["default-rope", "fp8-indexer"])
def test_scheduler_with_cuda_graphs_matches_offline(checkpoints, name):
    model = load_model(checkpoints[name], device="cuda", dtype=torch.float32)
    cfg = model.config
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 259) for _ in range(rng.randint(5, 80))] for _ in range(14)]
    new = 12
    cap = sum(len(p) + new for p in prompts)
    plain = PlainKVCache.for_model(cfg, cap, torch.float32, "cuda")
    expected = [
        r.output for r in Engine(model, plain, cap, 4, 128, 64, True).generate(prompts, new)
    ]

    max_running, chunk = 6, 32
    n_g = EchoConfig(offload=True).min_dev_cache_size(max_running, cfg.index_topk, chunk)
    echo = EchoConfig(offload=True, dev_cache_size=n_g)
    cache = echo_cache_for_model(echo, cfg, cap, torch.float32, "cuda")
    steps = StepRunner(
        model, cache, cap, max_running, 128, use_cuda_graph=True, cuda_graph_max_bs=4
    )
    sched = Scheduler(steps, max_running, chunk, 128, list(cfg.eos_token_ids))
    params = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    reqs = [ServeRequest(p, rid=str(i), params=params) for i, p in enumerate(prompts)]
    for i, r in enumerate(reqs):
        sched.add(r)
        if i % 3 == 0:
            sched.step()
    while sched.has_work():
        sched.step()
    assert [r.output for r in reqs] == expected
    assert steps.decode_runner is not None and steps.decode_runner.graphs  # graphs were used
    assert max(steps.decode_runner.graphs) <= 4
    assert cache.cache.free_count.tolist() == [n_g] * cfg.num_hidden_layers
    assert steps.allocator.num_free == cap
