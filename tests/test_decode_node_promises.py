"""A PD decode node's promises to a client (fake transfer backend, on the CPU).

- One log-probability per output token when asked, the transferred first token's too
  (it stands in for the prefill node's, drawn uniformly: -ln V).
- A request that ends on its arrival (its first token is its whole budget) gives back its
  token locations and ECHO's slots at once, not when the next command wakes the engine.
"""

from __future__ import annotations

import asyncio
import math
import random

import aiohttp
import pytest

from server_utils import min_cache_echo_serving, running_server
from sglang_echo.runtime.request import SamplingParams, ServeRequest

MAX_RUNNING, POOL, CONTEXT, CHUNK = 2, 2000, 512, 32
DECODE_NODE = dict(disaggregation_mode="decode", disaggregation_transfer_backend="fake")


@pytest.fixture(scope="module")
def serving(small_checkpoint):
    return min_cache_echo_serving(
        small_checkpoint, MAX_RUNNING, CHUNK, POOL, CONTEXT, **DECODE_NODE
    )


def _prompt(seed: int, n: int = 300) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 259) for _ in range(n)]


def test_generate_returns_one_logprob_per_token_on_a_decode_node(serving):
    vocab = serving.model.config.vocab_size

    async def go(url):
        body = {
            "input_ids": _prompt(1),
            "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True},
            "return_logprob": True,
            "top_logprobs_num": 2,
        }
        async with aiohttp.ClientSession() as s, s.post(url + "/generate", json=body) as r:
            assert r.status == 200, await r.text()
            return await r.json()

    with running_server(serving) as (url, _app):
        out = asyncio.run(go(url))
    meta = out["meta_info"]
    assert len(out["output_ids"]) == 3
    lps = meta["output_token_logprobs"]
    assert len(lps) == 3 and len(meta["output_top_logprobs"]) == 3
    # [logprob, token id, text]: the first is the stand-in's, uniform over the vocabulary.
    assert [lp[1] for lp in lps] == out["output_ids"]
    assert lps[0][0] == pytest.approx(-math.log(vocab))
    assert all(lp[0] <= 0.0 for lp in lps)


def test_request_ending_on_arrival_frees_everything_without_another_command(serving):
    sched = serving.scheduler
    events = []
    req = ServeRequest(
        prompt=_prompt(2),
        rid="ends-on-arrival",
        params=SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True),
        on_output=events.append,
    )
    sched.add(req)
    progressed = sched.step()  # admitted, transferred (at once on the CPU), finished
    assert not progressed and req.finished and req.finish_reason["type"] == "length"
    assert [e.finish_reason is not None for e in events] == [True]  # one terminal event
    # No further step or command: everything is back already.
    assert sched.steps.allocator.num_free == POOL
    assert sched.steps.table.num_free_rows == MAX_RUNNING
    cache = serving.kv_cache
    assert cache.cache.free_count.tolist() == [cache.cache.num_slots] * cache.num_layers
    assert not sched.live and not sched.has_work()


def test_a_failed_transfer_ends_only_its_request(serving):
    """The writer thread's error (its launches failed) ends that request with a 500 that
    says why, gives back what it held, and the other requests go on."""
    from concurrent.futures import Future

    sched = serving.scheduler
    source = sched.prompt_source
    start = source.start

    def failing_start(req):
        start(req)
        if req.rid == "broken":  # as if the writer thread had raised
            job: Future = Future()
            job.set_exception(RuntimeError("CUDA out of memory (injected)"))
            source._transfers[-1].job = job

    source.start = failing_start
    events: dict[str, list] = {"broken": [], "fine": []}
    for rid in events:
        sched.add(
            ServeRequest(
                prompt=_prompt(3 if rid == "broken" else 4),
                rid=rid,
                params=SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True),
                on_output=events[rid].append,
            )
        )
    try:
        for _ in range(100):
            if not sched.has_work():
                break
            sched.step()
    finally:
        source.start = start
    broken = events["broken"]
    assert len(broken) == 1 and broken[0].finish_reason["status_code"] == 500
    assert "transfer" in broken[0].finish_reason["message"]
    assert "injected" in broken[0].finish_reason["message"]
    fine = events["fine"]
    assert fine[-1].finish_reason == {"type": "length", "length": 4}
    assert sum(len(e.new_token_ids) for e in fine) == 4
    assert sched.steps.allocator.num_free == POOL and not source.failed
    cache = serving.kv_cache
    assert cache.cache.free_count.tolist() == [cache.cache.num_slots] * cache.num_layers
