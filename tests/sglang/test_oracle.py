"""The plugin's oracle (``sglang_echo.sglang.oracle``) against sglang 0.5.23's launcher.

The oracle's line must resolve, with the plugin off, to exactly the configuration ECHO's
line resolves to with it on (one resolved configuration, checked field by field), while
the naive comparison (ECHO's line without NSA_KV_OFFLOAD) resolves to another sglang path.
The check command is driven end to end against a stand-in server, so the argv and
environment each side is launched with, and the verdict, are what is asserted.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import plugin_testenv  # first: sets the process up before sglang loads
import pytest

plugin_testenv.require_sglang()

from test_plugin_args import DP_ATTENTION, MODEL_CONFIG  # noqa: E402

from sglang_echo.sglang import oracle  # noqa: E402

HERE = Path(__file__).parent
CASES = {
    "server": ["--max-total-tokens", "600000", "--context-length", "8192"],
    "pd_decode_dp8": ["--disaggregation-mode", "decode", "--max-total-tokens", "1000000",
                      *DP_ATTENTION],
}  # fmt: skip
# sglang asks the device capability while resolving; the launcher subprocesses have no GPU.
SITE = "import torch\ntorch.cuda.get_device_capability = lambda *a, **k: (9, 0)\n"


@pytest.fixture(scope="module")
def resolved(tmp_path_factory):
    """Each case's line pair (two fresh launcher processes each), and the naive
    comparison: ECHO's server line resolved without NSA_KV_OFFLOAD."""
    tmp = tmp_path_factory.mktemp("oracle")
    model = tmp / "dsv32"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(MODEL_CONFIG))
    site = tmp / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITE)
    base = ["--model-path", str(model), "--device", "cpu", "--skip-tokenizer-init"]
    with pytest.MonkeyPatch.context() as env, ThreadPoolExecutor(2) as pool:
        path = os.environ.get("PYTHONPATH")
        env.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), path])))
        env.setenv("NSA_DEV_CACHE_SIZE", "8192")
        pairs = {name: pool.submit(oracle.line_pair, base + argv) for name, argv in CASES.items()}
        echo_line = oracle.with_seed(base + CASES["server"])
        echo = pool.submit(oracle.resolve_fields, echo_line, True)
        naive = pool.submit(oracle.resolve_fields, echo_line, False)
        result = {name: f.result() for name, f in pairs.items()}
        result["echo_fields"], result["naive_fields"] = echo.result(), naive.result()
    return result


@pytest.mark.parametrize("name", list(CASES))
def test_oracle_line_is_stock_hisparse_with_echos_sizes(resolved, name):
    pair = resolved[name]
    assert pair.pd_decode == (name == "pd_decode_dp8")
    stock = pair.oracle_argv
    assert "--enable-hisparse" in stock and "--disable-radix-cache" in stock
    config = json.loads(stock[stock.index("--hisparse-config") + 1])
    assert not set(config) & set(oracle.ECHO_ONLY_KEYS), "ECHO's own keys stay out"
    assert config["top_k"] == MODEL_CONFIG["index_topk"]
    # The user's host pool became the plan's device rows: one --max-total-tokens only.
    assert stock.count("--max-total-tokens") == 1
    assert int(stock[stock.index("--max-total-tokens") + 1]) < 600_000
    assert pair.echo_argv[-2:] == ["--random-seed", str(oracle.SEED)]
    if pair.pd_decode:
        assert stock[stock.index("--disaggregation-decode-retraction-backup") + 1] == "none"


def test_naive_comparison_is_another_sglang_path(resolved):
    """Without NSA_KV_OFFLOAD the same line resolves to sglang without HiSparse: the
    comparison docs/PLUGIN.md no longer offers."""
    problems = oracle.configuration_differences(resolved["echo_fields"], resolved["naive_fields"])
    named = {p.split(":", 1)[0] for p in problems}
    assert {"enable_hisparse", "disable_radix_cache", "hisparse_config"} <= named


def test_a_changed_field_is_a_difference(resolved):
    echo = resolved["echo_fields"]
    assert oracle.configuration_differences(echo, dict(echo)) == []
    for name, value in (("max_running_requests", echo["max_running_requests"] + 1),
                        ("hisparse_config", json.dumps({"top_k": 1024}))):  # fmt: skip
        changed = {**echo, name: value}
        assert [p.split(":")[0] for p in oracle.configuration_differences(echo, changed)] == [name]


def test_without_flags_spellings():
    argv = ["--a", "1", "--max-total-tokens=5", "--enable-hisparse", "--b", "--max-total-tokens",
            "7", "--c"]  # fmt: skip
    assert oracle.without_flags(argv, ["max_total_tokens", "enable_hisparse"]) == [
        "--a", "1", "--b", "--c",
    ]  # fmt: skip


def test_compare_finds_the_first_differing_token_and_logprob():
    a = [{"index": 0, "output_ids": [1, 2, 3], "logprobs": [-0.5, -0.25, -1.0]},
         {"index": 1, "output_ids": [4, 5], "logprobs": [-0.1, -0.2]},
         {"index": 2, "output_ids": [6, 7], "logprobs": [-0.1, -0.2]}]  # fmt: skip
    b = json.loads(json.dumps(a))
    assert oracle.compare(a, b)["mismatches"] == []
    b[0]["output_ids"][2] = 9
    b[1]["logprobs"][1] = -0.2000001
    b[2]["output_ids"] = [6]  # stopped early
    verdict = oracle.compare(a, b)
    assert verdict["equal"] == 0
    assert [(m["index"], m["what"], m["first_position"]) for m in verdict["mismatches"]] == [
        (0, "output_ids", 2), (1, "logprobs", 1), (2, "output_ids", 1),
    ]  # fmt: skip
    with pytest.raises(oracle.OracleError, match="length"):
        oracle.compare(a, b[:2])


def test_prompts_from_a_file_or_seeded(tmp_path):
    assert oracle.load_prompts(None, 2, 5, 3) == oracle.load_prompts(None, 2, 5, 3)
    assert oracle.load_prompts(None, 2, 5, 3) != oracle.load_prompts(None, 2, 5, 4)
    good = tmp_path / "p.jsonl"
    good.write_text('{"text": "hi", "x": 1}\n\n{"input_ids": [5, 6]}\n')
    assert oracle.load_prompts(str(good), 0, 0, 0) == [{"text": "hi"}, {"input_ids": [5, 6]}]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "hi"}\n')
    with pytest.raises(oracle.OracleError, match=r"bad\.jsonl:1"):
        oracle.load_prompts(str(bad), 0, 0, 0)


# A stand-in for sglang.launch_server: /health, and /generate whose tokens are a function
# of the prompt (plus 1 in the last token when STANDIN_DIFFER=1 and offload is on); it
# records its argv and NSA_KV_OFFLOAD.
STANDIN = r"""
import json, os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
argv = sys.argv[1:]
port = int(argv[argv.index("--port") + 1])
offload = os.environ.get("NSA_KV_OFFLOAD")
with open(os.environ["STANDIN_LOG"], "a") as f:
    f.write(json.dumps({"argv": argv, "offload": offload}) + "\n")
class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def _send(self, body):
        data = json.dumps(body).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(data)))
        self.end_headers(); self.wfile.write(data)
    def do_GET(self): self._send({})
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = body["sampling_params"]["max_new_tokens"]
        ids = [(sum(body["input_ids"]) + i) % 97 for i in range(n)]
        if offload == "1" and os.environ.get("STANDIN_DIFFER") == "1":
            ids[-1] += 1
        lp = [[-1.0 / (1 + t), t, None] for t in ids]
        self._send({"output_ids": ids, "meta_info": {"output_token_logprobs": lp,
                    "finish_reason": {"type": "length"}}})
HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("differ", [False, True])
def test_check_launches_each_side_as_declared_and_judges(resolved, tmp_path, monkeypatch, differ):
    standin = tmp_path / "standin.py"
    standin.write_text(STANDIN)
    log = tmp_path / "launches.jsonl"
    monkeypatch.setenv("STANDIN_LOG", str(log))
    monkeypatch.setenv("STANDIN_DIFFER", "1" if differ else "0")
    monkeypatch.setattr(oracle, "line_pair", lambda args: resolved["server"])
    work = tmp_path / "work"
    code = oracle.main(
        ["check", "--port", str(free_port()), "--workdir", str(work), "--launcher",
         f"{sys.executable} {standin}", "--num-prompts", "3", "--prompt-len", "16",
         "--max-new-tokens", "4", "--", "ignored"]
    )  # fmt: skip
    launches = [json.loads(line) for line in log.read_text().splitlines()]
    pair = resolved["server"]
    assert [x["offload"] for x in launches] == ["0", "1"], "the oracle first, without ECHO"
    assert launches[0]["argv"][:-2] == pair.oracle_argv
    assert launches[1]["argv"][:-2] == pair.echo_argv
    verdict = json.loads((work / "verdict.json").read_text())
    assert verdict["requests"] == 3 and verdict["tokens"] == 12
    if differ:
        assert code == 1
        assert [(m["what"], m["first_position"]) for m in verdict["mismatches"]] == [
            ("output_ids", 3)
        ] * 3
    else:
        assert code == 0 and verdict["equal"] == 3


def test_check_refuses_a_pd_decode_node(resolved, monkeypatch, capsys):
    monkeypatch.setattr(oracle, "line_pair", lambda args: resolved["pd_decode_dp8"])
    assert oracle.main(["check", "--", "ignored"]) == 2
    assert "prefill node and router" in capsys.readouterr().err
