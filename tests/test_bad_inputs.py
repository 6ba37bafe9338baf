"""Every bad input and configuration a user can hit, sent for real, with the answer shown.

The server (ECHO on, tiny checkpoint, CPU) gets each bad request; the CLIs get each bad
flag or environment. Each must be refused with its status (HTTP) or exit code 2 (CLI) and
a message naming what to change. The table docs/ERRORS.md shows between the
``bad-inputs`` markers is this test's output: it fails when the two differ, and
``ECHO_WRITE_ERRORS=1 pytest tests/test_bad_inputs.py`` rewrites the block.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from pathlib import Path

import aiohttp
import pytest

from server_utils import min_cache_echo_serving, running_server
from sglang_echo.generate import main as generate_main
from sglang_echo.launch_server import main as launch_main

ERRORS_DOC = Path(__file__).resolve().parents[1] / "docs" / "ERRORS.md"
BEGIN, END = "<!-- bad-inputs:begin -->", "<!-- bad-inputs:end -->"
MAX_RUNNING, CHUNK, POOL, CONTEXT, BODY_LIMIT = 4, 32, 600, 512, 64 << 10

# (what the user sends, endpoint, body: dict, or bytes sent as they are)
HTTP_CASES: list[tuple[str, str, object]] = [
    ("malformed JSON", "/generate", b'{"text": "hi", '),
    ("a body that is not an object", "/v1/completions", b"[1, 2]"),
    ("neither text nor input_ids", "/generate", {"sampling_params": {}}),
    ("an empty prompt", "/generate", {"input_ids": []}),
    ("token ids outside the vocabulary", "/generate", {"input_ids": [5, 999999]}),
    ("a negative token id", "/generate", {"input_ids": [5, -3]}),
    ("token ids that are not integers", "/generate", {"input_ids": [5, 1.5]}),
    ("a boolean among the token ids", "/generate", {"input_ids": [5, True]}),
    ("a prompt longer than the context", "/generate", {"input_ids": [5] * 600}),
    ("prompt + max_tokens over the limit", "/v1/completions", {"prompt": [5] * 500, "max_tokens": 100}),
    ("several prompts in one request", "/v1/completions", {"prompt": ["a", "b"]}),
    ("negative max_tokens", "/v1/completions", {"prompt": "hi", "max_tokens": -1}),
    ("negative max_new_tokens", "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": -5}}),
    ("negative temperature", "/v1/completions", {"prompt": "x", "temperature": -1}),
    ("NaN temperature", "/generate", b'{"text": "x", "sampling_params": {"temperature": NaN}}'),
    ("infinite temperature", "/generate", b'{"text": "x", "sampling_params": {"temperature": Infinity}}'),
    ("NaN top_p", "/v1/completions", b'{"prompt": "x", "top_p": NaN}'),
    ("top_p of 0", "/v1/completions", {"prompt": "x", "top_p": 0}),
    ("top_k of 0", "/generate", {"text": "x", "sampling_params": {"top_k": 0}}),
    ("a seed of 2**64", "/v1/completions", {"prompt": "x", "seed": 2**64}),
    ("a lone surrogate in the text", "/generate", b'{"text": "ab\\ud800"}'),
    ("a lone surrogate in a chat message", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}'),
    ("an empty messages list", "/v1/chat/completions", {"messages": []}),
    ("a message without a role", "/v1/chat/completions", {"messages": [{"content": "hi"}]}),
    ("stop that is not text", "/v1/completions", {"prompt": "x", "stop": [1, 2]}),
    ("stream that is not a boolean", "/generate", {"text": "x", "stream": "yes"}),
    ("ignore_eos that is not a boolean", "/generate", {"text": "x", "sampling_params": {"ignore_eos": 1}}),
    ("n = 2", "/v1/completions", {"prompt": "x", "n": 2}),
    ("echo", "/v1/completions", {"prompt": "x", "echo": True}),
    ("a frequency penalty", "/v1/completions", {"prompt": "x", "frequency_penalty": 0.5}),
    ("a repetition penalty", "/generate", {"text": "x", "sampling_params": {"repetition_penalty": 1.2}}),
    ("logit_bias", "/v1/completions", {"prompt": "x", "logit_bias": {"5": 3}}),
    ("constrained decoding (regex)", "/generate", {"text": "x", "sampling_params": {"regex": "a+"}}),
    ("logprobs above 20", "/v1/completions", {"prompt": "x", "logprobs": 50}),
    ("top_logprobs without logprobs", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}),
    ("a JSON response_format", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}}),
    ("a body over --max-request-bytes", "/generate", {"text": "x" * (BODY_LIMIT + 1)}),
    ("text certainly longer than the context", "/generate", {"text": "y" * (BODY_LIMIT // 2)}),
    ("an abort without rid", "/abort_request", {}),
]  # fmt: skip

# (what the user runs, CLI, argv, environment)
CLI_CASES: list[tuple[str, str, list[str], dict[str, str]]] = [
    ("NSA_KV_OFFLOAD=2", "launch_server", ["--model-path", "{model}"], {"NSA_KV_OFFLOAD": "2"}),
    ("NSA_DEV_CACHE_SIZE=lots", "launch_server", ["--model-path", "{model}"], {"NSA_KV_OFFLOAD": "1", "NSA_DEV_CACHE_SIZE": "lots"}),
    ("a device cache smaller than one step's selections", "launch_server", ["--model-path", "{model}", "--max-running-requests", "8", "--max-total-tokens", "500"], {"NSA_KV_OFFLOAD": "1", "NSA_DEV_CACHE_SIZE": "64"}),
    ("--tp 8", "launch_server", ["--model-path", "{model}", "--tp", "8"], {}),
    ("--enable-dp-attention", "launch_server", ["--model-path", "{model}", "--enable-dp-attention"], {}),
    ("--port 70000", "launch_server", ["--model-path", "{model}", "--port", "70000"], {}),
    ("--mem-fraction-static 2", "launch_server", ["--model-path", "{model}", "--mem-fraction-static", "2"], {}),
    ("an unknown flag", "launch_server", ["--model-path", "{model}", "--frobnicate"], {}),
    ("a context longer than the model's", "launch_server", ["--model-path", "{model}", "--context-length", "999999", "--device", "cpu"], {}),
    ("fp8 KV for a latent that is not whole 128-wide tiles", "launch_server", ["--model-path", "{model}", "--kv-cache-dtype", "fp8_e4m3", "--device", "cpu"], {}),
    ("a missing checkpoint", "generate", ["--model-path", "no/such/model", "--prompts-file", "{prompts}", "--max-new-tokens", "4", "--output", "{out}"], {}),
    ("an empty prompts file", "generate", ["--model-path", "{model}", "--prompts-file", "{empty}", "--max-new-tokens", "4", "--output", "{out}"], {}),
]  # fmt: skip


@pytest.fixture(scope="module")
def server(small_checkpoint):
    serving = min_cache_echo_serving(
        small_checkpoint, MAX_RUNNING, CHUNK, POOL, CONTEXT, max_request_bytes=BODY_LIMIT
    )
    with running_server(serving) as (url, _app):
        yield url


def _send_all(url: str) -> list[tuple[int, str]]:
    async def go():
        out = []
        async with aiohttp.ClientSession() as s:
            for _, path, body in HTTP_CASES:
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                async with s.post(url + path, data=data) as r:
                    out.append((r.status, (await r.json())["error"]["message"]))
        return out

    return asyncio.run(go())


def _run_cli(
    which: str, argv: list[str], env: dict[str, str], monkeypatch, capsys
) -> tuple[int, str]:
    with monkeypatch.context() as m:
        for k in ("NSA_KV_OFFLOAD", "NSA_DEV_CACHE_SIZE"):
            m.delenv(k, raising=False)
        for k, v in env.items():
            m.setenv(k, v)
        capsys.readouterr()
        rc = (launch_main if which == "launch_server" else generate_main)(argv)
    err = capsys.readouterr().err.strip().splitlines()
    return rc, err[-1] if err else ""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _table(rows: list[tuple[str, str, str, str]]) -> str:
    lines = ["| what is sent | where | answer | message |", "| --- | --- | --- | --- |"]
    lines += [f"| {_cell(a)} | `{b}` | {c} | {_cell(d)} |" for a, b, c, d in rows]
    return "\n".join(lines)


def test_every_bad_input_is_refused_with_a_message(
    server, small_checkpoint, tmp_path, monkeypatch, capsys
):
    rows: list[tuple[str, str, str, str]] = []
    for (what, path, _), (status, message) in zip(HTTP_CASES, _send_all(server), strict=True):
        assert status in (400, 413), (what, status, message)
        assert len(message) > 20, (what, message)
        rows.append((what, path, f"HTTP {status}", message))
    (tmp_path / "p.jsonl").write_text('{"input_ids": [5, 6]}\n')
    (tmp_path / "empty.jsonl").write_text("")
    paths = {
        "model": str(small_checkpoint),
        "prompts": str(tmp_path / "p.jsonl"),
        "empty": str(tmp_path / "empty.jsonl"),
        "out": str(tmp_path / "o.jsonl"),
    }
    for what, which, argv, env in CLI_CASES:
        rc, message = _run_cli(which, [a.format(**paths) for a in argv], env, monkeypatch, capsys)
        assert rc == 2 and message.startswith("error: "), (what, rc, message)
        for name, value in paths.items():  # paths differ between runs: show them by role
            message = message.replace(value, f"<{name}>")
        rows.append((what, which, "exit 2", message.removeprefix("error: ")))
    assert len(rows) >= 25
    table = _table(rows)
    text = ERRORS_DOC.read_text()
    block = f"{BEGIN}\n{table}\n{END}"
    if os.environ.get("ECHO_WRITE_ERRORS") == "1":
        ERRORS_DOC.write_text(
            re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _m: block, text, flags=re.S)
        )
        text = ERRORS_DOC.read_text()
    assert block in text, (
        "docs/ERRORS.md's bad-inputs table is stale: ECHO_WRITE_ERRORS=1 pytest tests/test_bad_inputs.py"
    )
