"""Served ECHO and served no-offload at different batch sizes give the same tokens and the
same log-probabilities, bit for bit, with SGLANG_ECHO_BATCH_INVARIANT=1 (on the CPU).

Why: the served benchmark compares an ECHO decode node that runs many requests per step
with a no-offload node that runs few (its pool holds few). Without batch-invariant
matmuls a request's logits depend on its batch's size, so the two servers' tokens drift
apart at high load although neither loses anything (benchmark/results/served_vs_study/:
`outputs_equal_across_rates`). Here the no-offload node decodes one request at a time and
ECHO (at its smallest legal cache: evicting) four at a time; the returned log-probability
of every token (computed from the logits) is compared with ``==``. With the mode off the
same comparison differs, so the test can fail.
"""

from __future__ import annotations

import asyncio
import random

import aiohttp
import pytest

from server_utils import legal_min_cache, make_serving, running_server
from sglang_echo.config import ENV_BATCH_INVARIANT, EchoConfig

POOL, CONTEXT, NEW, CHUNK = 1600, 256, 5, 32


def _prompts() -> list[list[int]]:
    rng = random.Random(8)
    return [[rng.randrange(3, 259) for _ in range(rng.randint(120, 200))] for _ in range(4)]


def _serve(serving, prompts) -> list[tuple[list[int], list[float]]]:
    async def one(session, url, ids):
        body = {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True},
            "return_logprob": True,
        }
        async with session.post(url + "/generate", json=body) as r:
            assert r.status == 200, await r.text()
            out = await r.json()
            return out["output_ids"], [lp[0] for lp in out["meta_info"]["output_token_logprobs"]]

    with running_server(serving) as (url, _app):

        async def go():
            async with aiohttp.ClientSession() as s:
                return await asyncio.gather(*(one(s, url, p) for p in prompts))

        return asyncio.run(go())


def _both(checkpoint, prompts):
    flags = dict(
        max_total_tokens=POOL,
        context_length=CONTEXT,
        chunked_prefill_size=CHUNK,
        disaggregation_mode="decode",
        disaggregation_transfer_backend="fake",
    )
    alone = make_serving(checkpoint, EchoConfig(offload=False), max_running_requests=1, **flags)
    n_g = legal_min_cache(checkpoint, 4, CHUNK)
    batched = make_serving(
        checkpoint, EchoConfig(offload=True, dev_cache_size=n_g), max_running_requests=4, **flags
    )
    out_alone, out_batched = _serve(alone, prompts), _serve(batched, prompts)
    one, many = alone.scheduler.stats, batched.scheduler.stats
    assert one.decode_batch_requests == one.decode_steps  # one request per step
    assert many.decode_batch_requests > 2 * many.decode_steps  # several per step
    return out_alone, out_batched, batched


@pytest.mark.parametrize("mode", ["1", "0"], ids=["invariant", "default"])
def test_served_echo_batched_equals_no_offload_alone(small_checkpoint, monkeypatch, mode):
    monkeypatch.setenv(ENV_BATCH_INVARIANT, mode)
    prompts = _prompts()
    alone, batched, echo = _both(small_checkpoint, prompts)
    assert echo.model.lm_head.batch_invariant == (mode == "1")
    assert sum(echo.kv_cache.telemetry()["evictions"]) > 0  # real cache pressure
    assert all(len(ids) == NEW for ids, _ in batched)
    if mode == "1":
        assert batched == alone  # token ids and every log-probability, bit for bit
    else:  # the default GEMMs round by batch size: the log-probabilities drift
        assert [lps for _, lps in batched] != [lps for _, lps in alone]
