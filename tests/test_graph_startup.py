"""The decode-graph runner's promises, on the CPU through a stand-in graph backend.

A server captures every decode shape at start-up, before it says it is ready; the dummy
steps that warm each shape leave ECHO's state exactly as a fresh cache's; a capture that
fails never fails a request (that shape runs eagerly, logged) and the outputs stay those
of a run without graphs; a shape not captured at start-up is captured at its first step.
The CUDA versions of these run in tests/test_gpu.py.
"""

from __future__ import annotations

import logging
import random

import pytest
import torch

from sglang_echo.config import EchoConfig
from sglang_echo.model.kv_cache import PlainKVCache
from sglang_echo.model.loader import load_model
from sglang_echo.runtime.cuda_graph import CudaGraphDecodeRunner
from sglang_echo.runtime.kv_factory import echo_cache_for_model
from sglang_echo.runtime.request import SamplingParams, ServeRequest
from sglang_echo.runtime.scheduler import Scheduler
from sglang_echo.runtime.step_runner import StepRunner

MAX_RUNNING, POOL, CONTEXT, CHUNK, NEW = 3, 900, 160, 16, 10


class EagerReplay:
    """A graph backend for the CPU: "capturing" runs the step once (as the real capture's
    recording does not, which makes the state checks here stricter), and each replay runs
    it again into the same output tensor, reading the same static inputs."""

    def __init__(self, fail_batch_sizes: tuple[int, ...] = ()) -> None:
        self.fail_batch_sizes = fail_batch_sizes
        self.captured: list[int] = []

    def capture(self, step):
        out = step()
        bs = out.shape[0]
        if bs in self.fail_batch_sizes:
            raise RuntimeError("operation not permitted when stream is capturing (injected)")
        self.captured.append(bs)

        def replay() -> None:
            with torch.inference_mode():  # the model's outputs are inference tensors
                out.copy_(step())

        return replay, out


@pytest.fixture(scope="module")
def model(small_checkpoint):
    return load_model(small_checkpoint)


def _echo(model, fuse_decode: str = "0"):
    n_g = EchoConfig(offload=True).min_dev_cache_size(MAX_RUNNING, model.config.index_topk, CHUNK)
    echo = EchoConfig(offload=True, dev_cache_size=n_g, fuse_decode=fuse_decode)
    return echo_cache_for_model(echo, model.config, POOL, torch.float32, "cpu")


def _steps(model, cache, backend=None) -> StepRunner:
    steps = StepRunner(model, cache, POOL, MAX_RUNNING, CONTEXT)
    if backend is not None:
        steps.decode_runner = CudaGraphDecodeRunner(
            model, cache, CONTEXT, max_batch_size=MAX_RUNNING, backend=backend
        )
    return steps


def _serve(steps: StepRunner, prompts: list[list[int]], overlap: bool = False) -> list[list[int]]:
    eos = list(steps.model.config.eos_token_ids)
    sched = Scheduler(steps, MAX_RUNNING, CHUNK, CONTEXT, eos, overlap=overlap)
    reqs = []
    for i, p in enumerate(prompts):
        params = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
        req = ServeRequest(prompt=p, rid=f"r{i}", params=params)
        sched.add(req)
        reqs.append(req)
    for _ in range(10_000):
        if not sched.has_work():
            break
        sched.step()
    assert all(r.finished and r.finish_reason["type"] == "length" for r in reqs)
    return [r.output for r in reqs]


def _prompts(seed: int = 5, n: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 259) for _ in range(rng.randint(30, 120))] for _ in range(n)]


def _state(cache) -> dict[str, object]:
    """ECHO's state, named one by one (not through the checkpoint under test)."""
    c, m = cache.cache, cache.manager
    state: dict[str, object] = {
        name: getattr(c, name).clone()
        for name in (
            "host_to_device", "device_to_host", "priority", "free_stack", "free_count",
            "clock", "hits", "misses", "evictions", "append_evictions", "recalled_rows",
        )
    }  # fmt: skip
    state.update(
        prefetched_rows=m.prefetched_rows.clone(),
        prefetch_hits=m.prefetch_hits.clone(),
        release_errors=m.release_errors.clone(),
    )
    p = cache.decode_prefetcher
    if p is not None:
        for i, pred in enumerate(p.predictors):
            state[f"theta{i}"] = pred.theta.clone()
            state[f"finite{i}"] = pred.finite.clone()
        state["stage_map"] = p.stage_map.clone()
    if cache.rule is not None:
        state["rule"] = (cache.rule.on, cache.rule.steps, cache.rule.steps_on)
    return state


def _same(a: dict, b: dict) -> bool:
    assert a.keys() == b.keys()
    for k in a:
        same = torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k]
        assert same, k
    return True


def _fresh_state(model, fuse_decode: str = "0") -> dict[str, object]:
    cache = _echo(model, fuse_decode)
    _steps(model, cache)  # bound to the request rows, as the runner's cache is
    return _state(cache)


@pytest.mark.parametrize("fuse_decode", ["0", "auto"])
def test_startup_capture_covers_every_shape_and_leaves_echo_clean(model, fuse_decode):
    cache = _echo(model, fuse_decode)
    steps = _steps(model, cache, EagerReplay())
    fresh = _fresh_state(model, fuse_decode)
    captured = steps.capture_decode_graphs()
    runner = steps.decode_runner
    modes = (False, True) if fuse_decode == "auto" else (False,)
    assert cache.decode_prefetch_modes() == modes
    expected = {(bs, m) for bs in range(1, MAX_RUNNING + 1) for m in modes}
    assert set(runner.graphs) == expected and captured == len(expected)
    assert runner.startup_captures == len(expected) and runner.capture_failures == 0
    # The dummy steps ran (twice per shape here) and left nothing behind: every map,
    # stack, clock, counter and threshold equals a fresh cache's.
    assert _same(_state(cache), fresh)
    assert cache.cache.free_count.tolist() == [cache.cache.num_slots] * cache.num_layers
    assert int(cache.cache.hits.sum()) == 0 and int(cache.cache.clock.sum()) == 0


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("fuse_decode", ["0", "auto"])
def test_replayed_graphs_are_lossless_under_eviction(model, fuse_decode, overlap):
    """Also with overlap scheduling: the ids carried on the device enter the captured
    step's static inputs."""
    prompts = _prompts()
    plain = PlainKVCache.for_model(model.config, POOL, torch.float32, "cpu")
    expected = _serve(_steps(model, plain), prompts)
    cache = _echo(model, fuse_decode)
    steps = _steps(model, cache, EagerReplay())
    steps.capture_decode_graphs()
    got = _serve(steps, prompts, overlap)
    assert got == expected
    assert sum(cache.telemetry()["evictions"]) > 0  # under real cache pressure
    assert steps.decode_runner.captures == steps.decode_runner.startup_captures  # none later


def test_failed_capture_falls_back_to_eager_and_fails_nothing(model, caplog):
    prompts = _prompts(seed=9)
    plain = PlainKVCache.for_model(model.config, POOL, torch.float32, "cpu")
    expected = _serve(_steps(model, plain), prompts)
    cache = _echo(model)
    backend = EagerReplay(fail_batch_sizes=(2,))
    steps = _steps(model, cache, backend)
    fresh = _fresh_state(model)
    with caplog.at_level(logging.WARNING, logger="sglang_echo.cuda_graph"):
        steps.capture_decode_graphs()
    runner = steps.decode_runner
    assert runner.capture_failures == 1 and runner.eager_shapes == {(2, False)}
    assert (2, False) not in runner.graphs and {(1, False), (3, False)} <= set(runner.graphs)
    assert any("batch size 2" in r.message and "eagerly" in r.message for r in caplog.records)
    assert _same(_state(cache), fresh)
    assert _serve(steps, prompts) == expected  # batches of 2 ran eagerly, the rest replayed
    assert backend.captured.count(2) == 0 and runner.capture_failures == 1  # not retried


def test_shape_missed_at_startup_is_captured_at_its_first_step(model):
    cache = _echo(model)
    steps = _steps(model, cache, EagerReplay())
    steps.decode_runner.capture_all([1])  # only batch size 1 at start-up
    prompts = _prompts(seed=11, n=3)
    plain = PlainKVCache.for_model(model.config, POOL, torch.float32, "cpu")
    assert _serve(steps, prompts) == _serve(_steps(model, plain), prompts)
    runner = steps.decode_runner
    assert runner.startup_captures == 1 and runner.captures > 1  # later shapes, lazily
