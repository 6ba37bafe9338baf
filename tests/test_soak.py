"""A bounded soak: the server with ECHO at its smallest legal device cache, loaded at about
twice what it can run at once, with random aborts, client disconnects, bad requests and
over-long prompts mixed in; a fifth of the requests end at their first token (the
requests a tight pool used to retract after they had finished). Every request gets exactly
one terminal event and nothing after it. Afterwards nothing has leaked (every token slot / host row,
request row, device-cache slot and request id is free), every good request completed, and
each greedy output equals offline generate's with the plain pool.

The default suite runs it for 20 s; ``-m slow`` for 10 minutes (ECHO_SOAK_S overrides).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections import Counter, defaultdict

import aiohttp
import pytest
import torch

from server_utils import legal_min_cache, min_cache_echo_serving, running_server
from sglang_echo.model.kv_cache import PlainKVCache
from sglang_echo.model.loader import load_model
from sglang_echo.runtime.engine import Engine

MAX_RUNNING = 4
CLIENTS = 8  # about twice what runs at once
CHUNK = 32
POOL = 360  # 4 running x up to 200 tokens each: admission waits and preemption happens
CONTEXT = 256


async def _client(url: str, rng: random.Random, until: float, log: list, counts: Counter) -> None:
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < until:
            kind = rng.choices(
                ["good", "abort", "disconnect", "bad", "too_long"], [70, 8, 8, 7, 7]
            )[0]
            prompt = [rng.randrange(3, 259) for _ in range(rng.randint(2, 100))]
            new = 1 if rng.random() < 0.2 else rng.randint(1, 100)
            body = {
                "input_ids": prompt,
                "sampling_params": {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True},
            }
            if kind == "bad":
                body["sampling_params"]["top_p"] = rng.choice([0, 2, -1])
            elif kind == "too_long":
                body["input_ids"] = [5] * rng.randint(CONTEXT, 2 * CONTEXT)
            stream = kind in ("abort", "disconnect") or rng.random() < 0.5
            if kind == "abort":
                body["rid"] = f"soak-{rng.getrandbits(48):x}"
            async with s.post(url + "/generate", json={**body, "stream": stream}) as r:
                if kind in ("bad", "too_long"):
                    assert r.status == 400, await r.text()
                    counts["bad_rejected"] += 1
                    continue
                assert r.status == 200
                if not stream:
                    out = await r.json()
                    log.append((prompt, new, out["output_ids"]))
                    counts["good"] += 1
                    continue
                last, seen = None, 0
                async for raw in r.content:
                    line = raw.decode().strip()
                    if not line.startswith("data: {"):
                        continue
                    last, seen = json.loads(line[6:]), seen + 1
                    if kind == "abort" and seen == 2:
                        await s.post(url + "/abort_request", json={"rid": body["rid"]})
                    if kind == "disconnect" and seen == 2:
                        break
                if kind == "disconnect" and seen == 2:
                    counts["disconnects"] += 1
                    continue  # leaving the block drops the connection
                reason = last["meta_info"]["finish_reason"]
                if reason["type"] == "abort":
                    assert kind == "abort", reason
                    counts["aborted"] += 1
                else:
                    log.append((prompt, new, last["output_ids"]))
                    counts["good"] += 1


def _engine_state(app) -> dict:
    def read(sched):
        cache = sched.steps.kv_cache.cache
        return {
            "busy": len(sched.running) + len(sched.waiting),
            "live": len(sched.live),
            "free_tokens": sched.steps.allocator.num_free,
            "free_rows": sched.steps.table.num_free_rows,
            "free_slots": cache.free_count.tolist(),
            "preemptions": sched.stats.preemptions,
            "evictions": int(sum(sched.steps.kv_cache.telemetry()["evictions"])),
        }

    return app.state.engine.call(read).result(timeout=60)


def _offline(model, log: list) -> list[list[int]]:
    """Each logged request's greedy output with the plain pool, grouped by length."""
    by_new: dict[int, list[int]] = {}
    for i, (_, new, _) in enumerate(log):
        by_new.setdefault(new, []).append(i)
    out: list[list[int]] = [[] for _ in log]
    for new, idx in by_new.items():
        prompts = [log[i][0] for i in idx]
        cap = sum(len(p) + new for p in prompts)
        cache = PlainKVCache.for_model(model.config, cap, torch.float32, "cpu")
        engine = Engine(model, cache, cap, 8, CONTEXT, CHUNK, ignore_eos=True)
        for i, req in zip(idx, engine.generate(prompts, new), strict=True):
            out[i] = req.output
    return out


def _soak(checkpoint, seconds: float) -> Counter:
    legal_min = legal_min_cache(checkpoint, MAX_RUNNING, CHUNK)
    serving = min_cache_echo_serving(checkpoint, MAX_RUNNING, CHUNK, POOL, CONTEXT)
    serving.scheduler.reserve_steps = 4  # admit eagerly: the pool runs out, preemption runs
    log: list = []
    counts: Counter = Counter()
    # Every event the engine emits, per request: True for a terminal one.
    terminal: dict[str, list[bool]] = defaultdict(list)
    emit = serving.scheduler.events.emit

    def recording_emit(req, new_tokens, reason, logprobs=()):
        terminal[req.rid].append(reason is not None)
        emit(req, new_tokens, reason, logprobs)

    serving.scheduler.events.emit = recording_emit
    with running_server(serving) as (url, app):
        until = time.monotonic() + seconds

        async def load():
            rngs = [random.Random(1000 + i) for i in range(CLIENTS)]
            await asyncio.gather(*(_client(url, r, until, log, counts) for r in rngs))

        asyncio.run(load())
        deadline = time.monotonic() + 60
        while (state := _engine_state(app))["busy"] and time.monotonic() < deadline:
            time.sleep(0.1)
    assert state["busy"] == 0 and state["live"] == 0
    for rid, ends in terminal.items():
        assert ends.count(True) == 1 and ends[-1], f"request {rid}: events {ends}"
    counts["requests_seen"] = len(terminal)
    assert state["free_tokens"] == POOL
    assert state["free_rows"] == MAX_RUNNING
    assert state["free_slots"] == [legal_min] * serving.info["num_layers"]
    counts["preemptions"] = state["preemptions"]
    counts["evictions"] = state["evictions"]
    expected = _offline(load_model(checkpoint), log)
    assert [got for _, _, got in log] == expected
    print(f"\nsoak {seconds:.0f} s: {dict(counts)}")
    return counts


def test_soak_short(small_checkpoint):
    counts = _soak(small_checkpoint, float(os.environ.get("ECHO_SOAK_S", 20)))
    assert counts["good"] > 20 and counts["bad_rejected"] > 0
    assert counts["evictions"] > 0 and counts["preemptions"] > 0


@pytest.mark.slow
def test_soak_ten_minutes(small_checkpoint):
    counts = _soak(small_checkpoint, float(os.environ.get("ECHO_SOAK_S", 600)))
    assert counts["aborted"] > 0 and counts["disconnects"] > 0 and counts["preemptions"] > 0
