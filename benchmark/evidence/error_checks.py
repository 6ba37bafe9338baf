"""The code paths docs/ERRORS.md calls (``CHECKS``): each takes a row's arguments and
calls the check a user's setting meets (settings, config validation, the scheduler, the
request parser, the prompts file, the host pool, the server's arguments, the plugin's plan
and sizing), so the documented messages are the code's own, never copied by hand."""

from __future__ import annotations

import ast
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


class _Stub:
    """Stands in for the object whose method is called (only the attributes it reads)."""

    def __init__(self, **attrs):
        self.__dict__.update(attrs)


def _words(args: list[str]) -> dict[str, Any]:
    """``key=value`` words, values as Python literals where they parse (else strings)."""
    out = {}
    for word in args:
        key, _, raw = word.partition("=")
        try:
            out[key] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            out[key] = raw
    return out


def check_env(args: list[str]) -> object:
    from sglang_echo.config import EchoSettings

    return EchoSettings.from_env(dict(w.split("=", 1) for w in args))


def check_validate(args: list[str]) -> object:
    from sglang_echo.config import EchoConfig

    kw = _words(args)
    sizes = {k: kw.pop(k) for k in ("host_tokens", "max_running_requests", "topk", "chunk_size")}
    return EchoConfig(offload=True, **kw).validate(**sizes)


def check_request(args: list[str]) -> object:
    from sglang_echo.runtime.request import SamplingParams, ServeRequest
    from sglang_echo.runtime.scheduler import Scheduler

    kw = _words(args)
    req = ServeRequest([1] * kw["prompt"], params=SamplingParams(max_new_tokens=kw["new"]))
    stub = _Stub(context_length=kw["context"], capacity=kw["pool"], live={}, draft_tail=0)
    return Scheduler.check(stub, req)


def check_body(args: list[str]) -> object:
    """A request body as a client sends it: ``digits=N`` (a number of N digits) or
    ``depth=N`` (arrays nested N deep)."""
    from sglang_echo.runtime.protocol import parse_json

    kw = _words(args)
    if "digits" in kw:
        body = '{"input_ids": [1], "seed": ' + "7" * kw["digits"] + "}"
    else:
        body = '{"input_ids": ' + "[" * kw["depth"] + "]" * kw["depth"] + "}"
    return parse_json(body.encode())


def check_prompts(args: list[str]) -> object:
    import tempfile

    from sglang_echo.generate import read_prompts

    kw = _words(args)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "prompts.jsonl"
        path.write_text(json.dumps({"input_ids": [5] * kw["tokens"]}) + "\n")
        try:
            return read_prompts(path, None, 1000, kw["context"] - kw["new"], kw["context"])
        except ValueError as exc:  # the temporary folder differs between runs
            raise ValueError(str(exc).replace(str(path), "prompts.jsonl")) from None


def check_host_pool(args: list[str]) -> object:
    import torch

    from sglang_echo.offload.host_pool import HostKVPool

    kw = _words(args)
    return HostKVPool(kw["layers"], kw["tokens"], kw["row_bytes"], torch.uint8, pin=True)


def check_server(args: list[str]) -> object:
    from sglang_echo.runtime.server_args import parse_server_args

    return parse_server_args(["--model-path", "DIR", *args])


def check_generate(args: list[str]) -> object:
    """``generate``'s flag checks, which run before the model loads."""
    from sglang_echo.generate import build_parser, speculative_steps

    argv = ["--model-path", "DIR", "--prompts-file", "P", "--output", "O", "--max-new-tokens", "8"]
    argv += args
    return speculative_steps(build_parser().parse_args(argv))


# What sglang's resolved arguments hold unless a row says otherwise (a non-PD server).
SGLANG_ARGS = {"disaggregation_mode": "null", "context_length": 131072, "max_total_tokens": 2000000}


def check_plugin(args: list[str]) -> object:
    """The plugin's plan for sglang's arguments (an attribute view, as sglang's), at
    DeepSeek-V3.2's top-k and ``NSA_DEV_CACHE_SIZE=260_000``."""
    from sglang_echo.config import EchoConfig
    from sglang_echo.sglang.args import plan_echo

    view = _Stub(**{**SGLANG_ARGS, **_words(args)})
    config = EchoConfig(offload=True, dev_cache_size=260_000)
    return plan_echo(view, config, top_k=2048, context_len=view.context_length)


def check_sizing(args: list[str]) -> object:
    """The plugin's start-up sizing (sglang/sizing.py) of fp8 DeepSeek-V3.2 (its published
    config.json, benchmark/configs/) as a PD decode node under DP attention on 8 GPUs of
    ``gpu_gib`` each, at ``fraction`` (sglang's --mem-fraction-static)."""
    from sglang_echo.sglang import sizing, sizing_budget, sizing_weights

    kw = _words(args)
    config = json.loads((Path(__file__).parents[1] / "configs/deepseek-v3.2.json").read_text())
    sizes = sizing.EchoSizes(kw["dev_cache"], kw["host_tokens"], config["index_topk"], 0)
    shape = sizing.RankShape(
        config["num_hidden_layers"], sizing.kv_row_bytes(config, fp8=True),
        sizing.index_row_bytes(config), config["max_position_embeddings"],
    )  # fmt: skip
    weights = sizing_weights.weight_bytes(config, sizing_weights.Parallel(8, 8))
    budget = sizing_budget.Budget(int(kw["gpu_gib"] * 2**30), kw["fraction"], weights, 8)
    result = sizing.check(sizes, shape, budget)
    if not result.fits:
        raise ValueError(result.message())
    return result


CHECKS: dict[str, tuple[str, Callable[[list[str]], object]]] = {
    "env": ("`EchoSettings.from_env`", check_env),
    "validate": ("`EchoConfig.validate`", check_validate),
    "request": ("`Scheduler.check`", check_request),
    "body": ("`protocol.parse_json`", check_body),
    "prompts": ("`generate.read_prompts`", check_prompts),
    "host_pool": ("`HostKVPool` (pinned)", check_host_pool),
    "server": ("`parse_server_args`", check_server),
    "generate": ("`generate.speculative_steps`", check_generate),
    "plugin": ("`sglang.args.plan_echo`", check_plugin),
    "sizing": ("`sglang.sizing.check`", check_sizing),
}
