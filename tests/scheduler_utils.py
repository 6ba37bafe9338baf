"""The in-process scheduler as the scheduler tests build it: ECHO at its smallest legal
device cache on the CPU, float32, a 16-token prefill chunk and a 128-token context."""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from sglang_echo.config import EchoConfig
from sglang_echo.runtime.kv_factory import echo_cache_for_model
from sglang_echo.runtime.scheduler import DECODE_RESERVE_STEPS, Scheduler
from sglang_echo.runtime.step_runner import StepRunner

CHUNK, CONTEXT = 16, 128


def random_prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 259) for _ in range(rng.randint(3, 40))] for _ in range(n)]


def echo_scheduler(
    model,
    max_running: int,
    pool: int,
    *,
    chunk: int = CHUNK,
    overlap: bool = False,
    reserve_steps: int = DECODE_RESERVE_STEPS,
    detokenize: Callable[[list[int]], str] | None = None,
):
    """-> (scheduler, its ECHO cache, the cache's N_G)."""
    cfg = model.config
    n_g = EchoConfig(offload=True).min_dev_cache_size(max_running, cfg.index_topk, chunk)
    cache = echo_cache_for_model(
        EchoConfig(offload=True, dev_cache_size=n_g), cfg, pool, torch.float32, "cpu"
    )
    steps = StepRunner(model, cache, pool, max_running, CONTEXT)
    sched = Scheduler(
        steps,
        max_running,
        chunk,
        CONTEXT,
        list(cfg.eos_token_ids),
        detokenize,
        reserve_steps=reserve_steps,
        overlap=overlap,
    )
    return sched, cache, n_g


def drain(sched: Scheduler, limit: int = 5_000) -> None:
    """Step until nothing is left (an assertion error if that takes over ``limit`` steps)."""
    for _ in range(limit):
        if not sched.has_work():
            return
        sched.step()
    raise AssertionError("the scheduler did not finish")
