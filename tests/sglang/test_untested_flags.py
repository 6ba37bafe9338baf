"""The flags ECHO's coordinator was never run under are refused at argument resolution,
in sglang 0.5.23's real launcher path (load_plugins, parse, resolve_once: dry_parse.py),
each with a message that says what is wrong and what to do: --enable-torch-compile,
--enable-two-batch-overlap and --debug-cuda-graph (the breakable CUDA-graph debug
backend). The same launch without the flag resolves (the refusal is the flag's)."""

from __future__ import annotations

import json

import plugin_testenv  # first: sets the process up before sglang loads
import pytest

plugin_testenv.require_sglang()

from test_plugin_args import (  # noqa: E402
    ECHO_ENV,
    MODEL_CONFIG,
    base_argv,
    collect,
    run_driver,
)

SERVER = ["--max-total-tokens", "600000", "--context-length", "8192"]
PD_DECODE = ["--disaggregation-mode", "decode", "--max-total-tokens", "1000000"]
# flag -> what the message must say is wrong (besides naming the flag)
UNTESTED = {
    "--enable-torch-compile": "graph-capture assumptions",
    "--enable-two-batch-overlap": "overlap assumptions",
    "--debug-cuda-graph": "graph-capture assumptions",
}
LAUNCHES = {"server": SERVER, "pd_decode": PD_DECODE}


@pytest.fixture(scope="module")
def resolved(tmp_path_factory):
    """One launcher process with NSA_KV_OFFLOAD=1: each flag on a non-PD server and on a
    PD decode node, and both launches without the flags."""
    tmp = tmp_path_factory.mktemp("untested")
    model = tmp / "dsv32"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(MODEL_CONFIG))
    base = base_argv(model)
    keys, cases = [], []
    for launch, argv in LAUNCHES.items():
        keys.append((launch, None))
        cases.append({"argv": [*base, *argv], "env": {}})
        for flag in UNTESTED:
            keys.append((launch, flag))
            cases.append({"argv": [*base, *argv, flag], "env": {}})
    proc = run_driver(cases, {"NSA_KV_OFFLOAD": "1", **ECHO_ENV}, tmp, "untested")
    state, results = collect(proc)
    assert state["coordinator"] == "EchoCoordinator"
    return dict(zip(keys, results, strict=True))


@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_the_launch_without_the_flags_resolves(resolved, launch):
    result = resolved[(launch, None)]
    assert "fields" in result, result.get("error")


@pytest.mark.parametrize("launch", list(LAUNCHES))
@pytest.mark.parametrize("flag", list(UNTESTED))
def test_untested_flag_is_refused_clearly(resolved, launch, flag):
    result = resolved[(launch, flag)]
    assert "error" in result, f"{flag} resolved with NSA_KV_OFFLOAD=1"
    message = result["error"]
    assert message.startswith("ConfigError: sglang-echo (NSA_KV_OFFLOAD=1) cannot run")
    # Exactly one problem: the flag's own line.
    lines = [line for line in message.splitlines() if line.startswith("  - ")]
    assert len(lines) == 1, message
    line = lines[0]
    assert line.startswith(f"  - {flag}: untested with ECHO's coordinator"), line
    assert UNTESTED[flag] in line, line  # what is wrong
    assert "drop it, or launch without NSA_KV_OFFLOAD=1" in line, line  # what to do
