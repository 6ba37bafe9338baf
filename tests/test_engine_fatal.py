"""A device error that leaves the CUDA context unusable (a device-side assert, an illegal
memory access) stops the engine: the requests in flight end with the error (an abort of status 500), /health
answers 503 with the reason, and new requests are refused with it (503), instead of a
server that accepts requests only to fail each one. A step error that is not sticky keeps
the engine serving (test_scheduler_isolation.py)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from server_utils import make_serving, running_server
from sglang_echo.config import EchoConfig
from sglang_echo.runtime.engine_loop import is_fatal_device_error

STICKY = "CUDA error: device-side assert triggered"


@pytest.mark.parametrize(
    ("message", "fatal"),
    [
        (STICKY, True),
        ("CUDA error: an illegal memory access was encountered", True),
        ("CUDA error: out of memory", False),
        ("operation not permitted when stream is capturing", False),
        ("ValueError: bad thing", False),
    ],
)
def test_which_errors_stop_the_engine(message, fatal):
    assert is_fatal_device_error(RuntimeError(message)) is fatal


def test_sticky_device_error_stops_the_engine_and_says_why(small_checkpoint):
    serving = make_serving(
        small_checkpoint, EchoConfig(offload=False), max_total_tokens=2000, context_length=256
    )
    sched = serving.scheduler
    real_step = sched.step

    def broken_step():
        if sched.running or sched.waiting:
            raise RuntimeError(STICKY)
        return real_step()

    sched.step = broken_step
    body = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 4}}

    async def go(url):
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/generate", json=body) as r:
                first = (r.status, await r.text())
            for _ in range(100):  # the engine thread ends just after failing the request
                async with s.get(url + "/health") as r:
                    health = (r.status, await r.text())
                if health[0] == 503:
                    break
                await asyncio.sleep(0.05)
            async with s.post(url + "/generate", json=body) as r:
                later = (r.status, await r.text())
        return first, health, later

    with running_server(serving) as (url, app):
        first, health, later = asyncio.run(go(url))
        assert app.state.engine.fatal_error and "device-side assert" in app.state.engine.fatal_error
    # SGLang's native route: 200, the abort (with the status a client should see) inside.
    reason = json.loads(first[1])["meta_info"]["finish_reason"]
    assert first[0] == 200 and reason["type"] == "abort" and reason["status_code"] == 500
    assert "device-side assert" in reason["message"]
    assert health[0] == 503 and "device-side assert" in health[1]
    assert later[0] == 503 and "engine stopped" in later[1] and "device-side assert" in later[1]
