"""The engine's diagnostics: ECHO_ENGINE_PROFILE writes a profile of the engine thread when
it stops (a CPU test at tiny sizes). The benchmarks' decode-node probe is tested in
tests/repo/test_decode_node_probe.py."""

from __future__ import annotations

import time
from pathlib import Path

from server_utils import make_serving
from sglang_echo.config import EchoConfig
from sglang_echo.runtime.engine_loop import PROFILE_ENV, EngineLoop
from sglang_echo.runtime.request import SamplingParams, ServeRequest


def test_engine_profile_is_written_at_stop(small_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv(PROFILE_ENV, str(tmp_path / "engine-{pid}.prof"))
    serving = make_serving(small_checkpoint, EchoConfig(), max_total_tokens=400)
    loop = EngineLoop(serving.scheduler)
    done = []
    req = ServeRequest([5, 6, 7], rid="p", params=SamplingParams(max_new_tokens=3, ignore_eos=True))
    req.on_output = lambda event: done.append(event)
    loop.start()
    loop.submit(req)
    deadline = time.monotonic() + 60
    while not req.finished and time.monotonic() < deadline:
        time.sleep(0.02)
    loop.stop()
    assert req.finished and len(req.output) == 3
    (prof,) = tmp_path.glob("engine-*.prof")
    assert prof.name != "engine-{pid}.prof"  # the process id went in
    text = Path(str(prof) + ".txt").read_text()
    assert "_serve" in text and "cumulative" in text  # the engine loop's own frames
