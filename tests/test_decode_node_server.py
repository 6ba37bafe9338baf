"""The server as a PD decode node with the fake transfer backend, on the CPU.

``--disaggregation-mode decode --disaggregation-transfer-backend fake``: each prompt's KV
is synthesized on the node (deterministic by prompt) instead of prefilled, and the
request decodes at once. A no-offload node and an ECHO node at its smallest legal cache
(evicting) give the same tokens for the same prompts; nothing is prefilled; everything is
free afterwards; bad flag combinations are refused at start-up.

The server itself never changes weights: the top-k locality knob (which biases the
indexers) and the study's worker folders come through its one extension point,
``--model-loader``, here the benchmarks' loader (benchmark/study/loader.py; its own CLI and
the study's worker folders are tested in tests/repo/test_study_loader.py).
"""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import aiohttp
import pytest

from benchmark.study import loader
from server_utils import make_serving, running_server
from sglang_echo.config import EchoConfig
from sglang_echo.runtime.server_args import ServerArgError, parse_server_args

MAX_RUNNING, POOL, CONTEXT, NEW = 4, 2400, 512, 12


def _loader_flags(locality: float) -> dict:
    """Server flags for the benchmarks' loader at ``locality`` (0: the product's own
    loading, no loader at all)."""
    if not locality:
        return {}
    return dict(model_loader=loader.SPEC, model_loader_args=f"--fake-kv-locality {locality}")


def _indexer_bias(serving):
    return serving.model.model.layers[0].self_attn.indexer.wq_b.bias


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, 259) for _ in range(rng.randint(200, 400))] for _ in range(10)]


def _serve_all(serving, prompts) -> tuple[list[list[int]], dict]:
    async def one(session, url, ids):
        body = {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True},
        }
        async with session.post(url + "/generate", json=body) as r:
            assert r.status == 200, await r.text()
            return (await r.json())["output_ids"]

    with running_server(serving) as (url, app):

        async def go():
            async with aiohttp.ClientSession() as s:
                return await asyncio.gather(*(one(s, url, p) for p in prompts))

        outs = asyncio.run(go())

        def read(sched):
            tel = sched.steps.kv_cache.telemetry()  # None: the plain pool
            return {
                "prefill_steps": sched.stats.prefill_steps,
                "prompt_tokens": sched.stats.prompt_tokens,
                "free_tokens": sched.steps.allocator.num_free,
                "free_rows": sched.steps.table.num_free_rows,
                "live": len(sched.live),
                "evictions": int(sum(tel["evictions"])) if tel else 0,
            }

        state = app.state.engine.call(read).result(timeout=60)
    return outs, state


@pytest.mark.parametrize("locality", [0.0, 0.9])
def test_decode_node_is_lossless_and_never_prefills(small_checkpoint, locality):
    topk = json.loads((Path(small_checkpoint) / "config.json").read_text())["index_topk"]
    flags = dict(
        max_total_tokens=POOL,
        max_running_requests=MAX_RUNNING,
        context_length=CONTEXT,
        chunked_prefill_size=32,
        disaggregation_mode="decode",
        disaggregation_transfer_backend="fake",
        **_loader_flags(locality),
    )
    prompts = _prompts()
    plain_serving = make_serving(small_checkpoint, EchoConfig(offload=False), **flags)
    # The product loads the checkpoint as it is; only the benchmark loader biases indexers.
    assert (_indexer_bias(plain_serving) is None) == (locality == 0)
    assert plain_serving.info["model_loader"] == (loader.SPEC if locality else None)
    plain, plain_state = _serve_all(plain_serving, prompts)
    legal_min = EchoConfig(offload=True).min_dev_cache_size(MAX_RUNNING, topk, 32)
    echo_serving = make_serving(
        small_checkpoint, EchoConfig(offload=True, dev_cache_size=legal_min), **flags
    )
    assert echo_serving.info["locality_source"] == (
        "random" if locality == 0 else "synthetic-keys:0.9"
    )
    echo, echo_state = _serve_all(echo_serving, prompts)
    assert echo == plain and all(len(o) == NEW for o in echo)
    assert echo_state["evictions"] > 0  # lossless under real cache pressure
    for state in (plain_state, echo_state):
        assert state["prefill_steps"] == 0  # prompts arrived cached
        assert state["prompt_tokens"] == sum(len(p) for p in prompts)
        assert state["free_tokens"] == POOL and state["free_rows"] == MAX_RUNNING
        assert state["live"] == 0


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--disaggregation-mode", "decode"], "fake"),
        (["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "mooncake"], "fake"),
        (["--disaggregation-mode", "prefill"], "plugin"),
        (["--disaggregation-transfer-backend", "fake"], "--disaggregation-mode decode"),
        # A knob that alters weights is no server flag: it points at the benchmark loader.
        (["--fake-kv-locality", "0.5"], "alters the served model's weights"),
        (["--model-loader-args=--fake-kv-locality 0.5"], "needs --model-loader"),
        (["--model-loader", "benchmark.study.loader"], "MODULE:FUNCTION"),
    ],
)  # fmt: skip
def test_bad_disaggregation_flags(argv, needle):
    with pytest.raises(ServerArgError, match=None) as err:
        parse_server_args(["--model-path", "m", *argv])
    assert needle in str(err.value)


def test_model_loader_flags_parse():
    args = parse_server_args(
        ["--model-path", "m", "--model-loader", loader.SPEC,
         "--model-loader-args=--fake-kv-locality 0.9"]
    )  # fmt: skip
    assert (args.model_loader, args.model_loader_args) == (loader.SPEC, "--fake-kv-locality 0.9")


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (dict(model_loader_args="--fake-kv-locality 2"), "[0, 1]"),
        (dict(model_loader_args="--fake-kv-locality 0.5", disaggregation_mode="null",
              disaggregation_transfer_backend=None), "needs --disaggregation-mode decode"),
        (dict(model_loader_args="--no-such-flag"), "unrecognized arguments"),
        (dict(model_loader="no_such_module_xyz:load"), "cannot import"),
        (dict(model_loader="benchmark.study.loader:no_such_function"), "no function"),
    ],
)  # fmt: skip
def test_model_loader_refusals(small_checkpoint, flags, needle):
    """The loader's own checks (the knob's range and mode) and the extension point's
    (import, function) are start-up errors that name the loader."""
    base = dict(
        model_loader=loader.SPEC, disaggregation_mode="decode",
        disaggregation_transfer_backend="fake", max_total_tokens=POOL,
    )  # fmt: skip
    with pytest.raises(ServerArgError) as err:
        make_serving(small_checkpoint, EchoConfig(offload=False), **{**base, **flags})
    assert needle in str(err.value) and "--model-loader" in str(err.value)
