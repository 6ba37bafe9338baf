"""The plugin's oracle: stock sglang HiSparse, launched with the configuration ECHO resolved.

Why not "the same line without NSA_KV_OFFLOAD": that runs a different sglang path. With
the plugin on, sglang runs HiSparse (``--enable-hisparse``), which forces the unfused decode
top-k and turns off dense MHA prefill for short prompts, and the plugin turns the radix
cache off. Those paths round differently, so their outputs may differ in the last bits
with or without ECHO. What ECHO promises inside sglang is narrower and exact: its token ids
and log-probabilities equal those of stock ``--enable-hisparse`` (sglang's own per-request
device buffers, no ECHO) launched with the same resolved arguments, when both run the
same requests one at a time (a fixed batch composition: a batch's size changes the
rounding of the dense GEMMs on both).

This module makes that comparison a command (``python -m sglang_echo.sglang.oracle``, run
with sglang's Python in the launch's environment):

- ``lines -- ARGS``: resolve ARGS with ECHO on, write the oracle's line (the same ARGS plus
  the HiSparse fields ECHO declared, sizes included), resolve it with ECHO off, and check
  that both resolve to the same configuration field by field (``configuration_differences``);
  print both launch lines. A fixed ``--random-seed`` is added to both when ARGS has none.
- ``collect --url URL``: send the prompts one at a time (greedy, or the seeded sampling
  given) to a running server or PD router and write each request's output ids (and
  log-probabilities) as JSON lines.
- ``compare A B``: token ids (and log-probabilities) of two collections, request by request.
- ``check -- ARGS`` (a non-disaggregated server): ``lines``, then start the oracle, collect,
  stop it, start ECHO, collect, stop it, compare; exit 1 on any difference. A PD decode
  node needs its prefill node and router: the docs give the same steps by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sglang_echo.sglang.args import (
    DEVICE_ROWS_KEY,
    ECHO_EXTRA_KEY,
    HOST_TOKENS_KEY,
    declared_fields,
)

# The keys of ECHO's hisparse_config that only ECHO reads (sglang passes unknown keys on
# as sparse_extra_config and ignores them); the oracle's config is the rest.
ECHO_ONLY_KEYS = (ECHO_EXTRA_KEY, HOST_TOKENS_KEY, DEVICE_ROWS_KEY)
SEED = 1234  # --random-seed added to both lines when the user's has none
READY_TIMEOUT_S = 3600.0  # DeepSeek-V3.2's full checkpoint loads for many minutes
PROGRESS_EVERY_S = 30.0


class OracleError(RuntimeError):
    """A comparison that could not be made as claimed (the message says why and what to do)."""


# --------------------------------------------------------------------------- the lines
def flag_of(field: str) -> str:
    return "--" + field.replace("_", "-")


def without_flags(argv: Sequence[str], fields: Iterable[str]) -> list[str]:
    """ARGS with every occurrence of the fields' flags removed (``--f v``, ``--f=v`` or a
    bare switch; a switch's next token is kept when it is itself a flag)."""
    flags = {flag_of(f) for f in fields}
    out: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        name = token.split("=", 1)[0]
        if name in flags:
            takes_value = "=" not in token and i + 1 < len(argv)
            i += 2 if takes_value and not argv[i + 1].startswith("--") else 1
            continue
        out.append(token)
        i += 1
    return out


def has_flag(argv: Sequence[str], field: str) -> bool:
    flag = flag_of(field)
    return any(t == flag or t.startswith(flag + "=") for t in argv)


def with_seed(argv: Sequence[str]) -> list[str]:
    """ARGS with a fixed --random-seed: otherwise each launch draws its own, the one field
    in which two resolutions of one line differ (and seeded sampling would follow it)."""
    if has_flag(argv, "random_seed"):
        return list(argv)
    return [*argv, "--random-seed", str(SEED)]


def oracle_config(hisparse_config: str) -> dict[str, Any]:
    """ECHO's hisparse_config without the keys only ECHO reads."""
    config = json.loads(hisparse_config)
    return {k: v for k, v in config.items() if k not in ECHO_ONLY_KEYS}


def declared_values(echo_fields: Mapping[str, Any]) -> dict[str, Any]:
    """Every field the plugin declares (``args.declared_fields``) at the value ECHO's side
    resolved it to; hisparse_config without ECHO's own keys. The oracle's line sets each
    one explicitly."""
    pd_decode = echo_fields.get("disaggregation_mode") == "decode"
    values = {name: echo_fields[name] for name in declared_fields(pd_decode)}
    values["hisparse_config"] = json.dumps(oracle_config(values["hisparse_config"]), sort_keys=True)
    return values


def oracle_argv(echo_argv: Sequence[str], echo_fields: Mapping[str, Any]) -> list[str]:
    """The stock HiSparse line: ECHO's ARGS with the declared fields set explicitly."""
    if not echo_fields.get("enable_hisparse"):
        raise OracleError(
            "the ECHO side did not resolve to HiSparse (enable_hisparse is off): was "
            "NSA_KV_OFFLOAD=1 applied and the plugin loaded? Check with "
            "`NSA_KV_OFFLOAD=1 python -m sglang_echo.plugin`."
        )
    declared = declared_values(echo_fields)
    argv = without_flags(echo_argv, declared)
    for name, value in declared.items():
        if value is True:
            argv.append(flag_of(name))
        else:
            argv += [flag_of(name), str(value)]
    return argv


def configuration_differences(
    echo_fields: Mapping[str, Any], oracle_fields: Mapping[str, Any]
) -> list[str]:
    """Every resolved field in which the two sides differ; hisparse_config is compared
    without the keys only ECHO reads. Empty: one configuration."""
    problems = []
    for name in sorted(set(echo_fields) | set(oracle_fields)):
        mine, theirs = echo_fields.get(name), oracle_fields.get(name)
        if name == "hisparse_config" and isinstance(mine, str) and isinstance(theirs, str):
            mine, theirs = oracle_config(mine), oracle_config(theirs)
        if mine != theirs:
            problems.append(f"{name}: ECHO resolves to {mine!r}, the oracle to {theirs!r}")
    return problems


def launch_env(offload: bool, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The launch's environment for one side: NSA_KV_OFFLOAD=1 for ECHO, 0 for the oracle
    (with 0 the plugin does nothing, so sglang runs as without it)."""
    env = dict(os.environ if base is None else base)
    env["NSA_KV_OFFLOAD"] = "1" if offload else "0"
    return env


def resolve_fields(
    argv: Sequence[str], offload: bool, python: str = sys.executable
) -> dict[str, Any]:
    """ARGS as sglang's launcher resolves them, in a fresh process (the plugin loads once
    per process, so each side needs its own)."""
    proc = subprocess.run(
        [python, "-m", "sglang_echo.sglang.oracle", "resolve", "--", *argv],
        env=launch_env(offload),
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("FIELDS ")]
    if proc.returncode != 0 or not lines:
        side = "ECHO" if offload else "the oracle"
        raise OracleError(
            f"sglang could not resolve {side}'s line ({' '.join(argv)}):\n"
            f"{(proc.stderr or proc.stdout)[-3000:]}"
        )
    return json.loads(lines[-1][len("FIELDS ") :])


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except TypeError:
        return repr(value)


def resolved_here(argv: Sequence[str]) -> dict[str, Any]:
    """In this process: load sglang's plugins, parse and resolve ARGS as the launcher
    does, and read every field through sglang's resolving view."""
    from sglang.srt.arg_groups.arg_utils import field_names
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    load_plugins()
    server_args = prepare_server_args(list(argv))
    server_args.resolve_once()
    view = resolving_view(server_args)
    return {name: _jsonable(getattr(view, name, None)) for name in field_names(type(server_args))}


@dataclass(frozen=True)
class LinePair:
    echo_argv: list[str]
    oracle_argv: list[str]
    pd_decode: bool
    dev_cache_size: int  # N_G, as ECHO's side resolved it


def line_pair(argv: Sequence[str], python: str = sys.executable) -> LinePair:
    """Both lines, checked to resolve to one configuration (OracleError otherwise)."""
    echo_argv = with_seed(argv)
    echo_fields = resolve_fields(echo_argv, offload=True, python=python)
    stock_argv = oracle_argv(echo_argv, echo_fields)
    stock_fields = resolve_fields(stock_argv, offload=False, python=python)
    problems = configuration_differences(echo_fields, stock_fields)
    if problems:
        listed = "\n".join(f"  - {p}" for p in problems)
        raise OracleError(
            "the oracle's line does not resolve to ECHO's configuration, so their outputs "
            f"are not comparable:\n{listed}"
        )
    pd = echo_fields.get("disaggregation_mode") == "decode"
    dev_cache = json.loads(echo_fields["hisparse_config"])[ECHO_EXTRA_KEY]
    return LinePair(echo_argv, stock_argv, pd, int(dev_cache))


def shell_line(argv: Sequence[str], dev_cache_size: int | None = None) -> str:
    """A launch line; ``dev_cache_size`` given: ECHO's (N_G as its side resolved it)."""
    env = "NSA_KV_OFFLOAD=0"
    if dev_cache_size is not None:
        env = f"NSA_KV_OFFLOAD=1 NSA_DEV_CACHE_SIZE={dev_cache_size}"
    return f"{env} python -m sglang.launch_server {shlex.join(argv)}"


# ------------------------------------------------------------------------ the prompts
def load_prompts(path: str | None, count: int, length: int, seed: int) -> list[dict]:
    """Prompts from a JSON-lines file (``{"text": ...}`` or ``{"input_ids": [...]}``), or
    ``count`` random token-id prompts of ``length`` tokens (seeded: the same on both
    sides; ids below 20,000 are valid in any DeepSeek vocabulary)."""
    if path:
        prompts = []
        for n, line in enumerate(Path(path).read_text().splitlines(), 1):
            if not line.strip():
                continue
            item = json.loads(line)
            if not isinstance(item, dict) or not ("text" in item or "input_ids" in item):
                raise OracleError(f"{path}:{n}: each line needs 'text' or 'input_ids'")
            prompts.append({k: item[k] for k in ("text", "input_ids") if k in item})
        if not prompts:
            raise OracleError(f"{path} holds no prompts")
        return prompts
    if count < 1 or length < 1:
        raise OracleError("--num-prompts and --prompt-len must be at least 1")
    rng = random.Random(seed)
    return [
        {"input_ids": [rng.randrange(100, 20_000) for _ in range(length)]} for _ in range(count)
    ]


def generate(url: str, prompt: dict, sampling: dict, logprobs: bool, timeout: float) -> dict:
    body = {**prompt, "sampling_params": sampling, "return_logprob": logprobs}
    request = urllib.request.Request(
        url.rstrip("/") + "/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            out = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise OracleError(f"{url}/generate answered {exc.code}: {exc.read()[:500]!r}") from exc
    record = {"output_ids": list(out.get("output_ids") or [])}
    if logprobs:
        meta = out.get("meta_info") or {}
        record["logprobs"] = [item[0] for item in meta.get("output_token_logprobs") or []]
    record["finish_reason"] = (out.get("meta_info") or {}).get("finish_reason")
    return record


def collect(
    url: str,
    prompts: Sequence[dict],
    sampling: dict,
    logprobs: bool,
    out: Path,
    timeout: float = 3600.0,
) -> list[dict]:
    """Each prompt alone (one request in flight: a fixed batch composition), in order."""
    records = []
    with out.open("w") as f:
        for i, prompt in enumerate(prompts):
            record = {"index": i, **generate(url, prompt, sampling, logprobs, timeout)}
            records.append(record)
            f.write(json.dumps(record) + "\n")
            f.flush()
            print(f"  request {i + 1}/{len(prompts)}: {len(record['output_ids'])} tokens")
    return records


# ----------------------------------------------------------------------- the verdict
def compare(oracle: Sequence[dict], echo: Sequence[dict]) -> dict[str, Any]:
    """Request by request: token ids equal, and log-probabilities bit-equal where both
    sides returned them (floats from JSON: equal values, not close ones)."""
    if len(oracle) != len(echo):
        raise OracleError(f"the collections differ in length ({len(oracle)} and {len(echo)})")
    mismatches = []
    for a, b in zip(oracle, echo, strict=True):
        for what in ("output_ids", "logprobs"):
            if what in a and what in b and a[what] != b[what]:
                mismatches.append(
                    {
                        "index": a.get("index"),
                        "what": what,
                        "first_position": first_difference(a[what], b[what]),
                    }
                )
                break
    return {
        "requests": len(oracle),
        "equal": len(oracle) - len(mismatches),
        "tokens": sum(len(r["output_ids"]) for r in oracle),
        "mismatches": mismatches,
    }


def first_difference(a: Sequence[Any], b: Sequence[Any]) -> int:
    """The first position where two unequal sequences differ (or the shorter's length)."""
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def read_collection(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


# ------------------------------------------------------------------------- the servers
def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    start = time.monotonic()
    last_report = start
    while True:
        if proc.poll() is not None:
            raise OracleError(f"the server exited with code {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        now = time.monotonic()
        if now - start > timeout:
            raise OracleError(f"the server at {url} was not ready after {timeout:.0f} s")
        if now - last_report >= PROGRESS_EVERY_S:
            print(f"  waiting for {url} ({now - start:.0f} s)", flush=True)
            last_report = now
        time.sleep(1.0)


def stop(proc: subprocess.Popen) -> None:
    """The server and every process it started (its own session): SIGINT, then SIGKILL."""
    if proc.poll() is not None:
        return
    for sig, grace in ((signal.SIGINT, 60), (signal.SIGKILL, 30)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def serve_and_collect(
    name: str,
    launcher: Sequence[str],
    argv: Sequence[str],
    offload: bool,
    port: int,
    run: Mapping[str, Any],
    workdir: Path,
) -> list[dict]:
    url = f"http://127.0.0.1:{port}"
    log = (workdir / f"{name}.log").open("w")
    cmd = [*launcher, *without_flags(argv, ["port"]), "--port", str(port)]
    print(f"{name}: starting ({' '.join(cmd)}); log {log.name}", flush=True)
    proc = subprocess.Popen(
        cmd, env=launch_env(offload), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        wait_ready(url, proc, run["ready_timeout"])
        print(f"{name}: ready; sending {len(run['prompts'])} prompts one at a time", flush=True)
        return collect(
            url, run["prompts"], run["sampling"], run["logprobs"], workdir / f"{name}.jsonl"
        )
    finally:
        stop(proc)
        log.close()


# ---------------------------------------------------------------------------- the CLI
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sglang_echo.sglang.oracle",
        description=(
            "Compare the ECHO plugin's outputs against its oracle: stock sglang "
            "--enable-hisparse launched with the configuration ECHO resolved to, one request "
            "at a time. Run with sglang's Python, in the launch's environment "
            "(NSA_DEV_CACHE_SIZE and the other NSA_ variables as you launch ECHO)."
        ),
    )
    sub = p.add_subparsers(dest="command", required=True)

    def prompt_args(q: argparse.ArgumentParser) -> None:
        q.add_argument("--prompts", help="JSON lines of {'text': ...} or {'input_ids': [...]}")
        q.add_argument("--num-prompts", type=int, default=8, help="random prompts (default 8)")
        q.add_argument(
            "--prompt-len",
            type=int,
            default=32768,
            help="tokens per random prompt (default 32768: longer than a small "
            "NSA_DEV_CACHE_SIZE, so ECHO evicts)",
        )
        q.add_argument("--seed", type=int, default=0, help="random prompts' seed")
        q.add_argument("--max-new-tokens", type=int, default=256)
        q.add_argument(
            "--temperature",
            type=float,
            default=0.0,
            help="0 (default): greedy; above 0: seeded sampling (sampling_seed = --seed)",
        )
        q.add_argument(
            "--no-logprobs",
            action="store_true",
            help="compare token ids only (default: log-probabilities too, bit for bit)",
        )

    lines = sub.add_parser("lines", help="print ECHO's and the oracle's launch lines")
    lines.add_argument("args", nargs=argparse.REMAINDER, help="-- then sglang's launch arguments")
    res = sub.add_parser("resolve", help="(internal) print this environment's resolution")
    res.add_argument("args", nargs=argparse.REMAINDER)
    col = sub.add_parser("collect", help="send the prompts to a running server or router")
    col.add_argument("--url", required=True, help="e.g. http://127.0.0.1:30000 (or the router)")
    col.add_argument("--out", required=True, help="JSON-lines file of the outputs")
    prompt_args(col)
    cmp_ = sub.add_parser("compare", help="compare the oracle's collection with ECHO's")
    cmp_.add_argument("oracle")
    cmp_.add_argument("echo")
    chk = sub.add_parser("check", help="a non-PD server: both launches, collect and compare")
    chk.add_argument("--port", type=int, default=30000)
    chk.add_argument("--workdir", default="oracle_check", help="logs and collections")
    chk.add_argument("--ready-timeout", type=float, default=READY_TIMEOUT_S)
    chk.add_argument(
        "--launcher",
        default=f"{sys.executable} -m sglang.launch_server",
        help="the command that starts a server (default: this Python's sglang.launch_server)",
    )
    prompt_args(chk)
    chk.add_argument("args", nargs=argparse.REMAINDER, help="-- then sglang's launch arguments")
    return p


def strip_separator(args: list[str]) -> list[str]:
    return args[1:] if args and args[0] == "--" else args


def sampling_of(ns: argparse.Namespace) -> dict[str, Any]:
    sampling: dict[str, Any] = {"temperature": ns.temperature, "max_new_tokens": ns.max_new_tokens}
    if ns.temperature > 0:
        sampling["sampling_seed"] = ns.seed
    return sampling


def report(verdict: dict[str, Any], out: Path | None = None) -> int:
    if out is not None:
        out.write_text(json.dumps(verdict, indent=2) + "\n")
    print(
        f"{verdict['equal']}/{verdict['requests']} requests equal to the oracle "
        f"({verdict['tokens']} oracle tokens)"
    )
    for m in verdict["mismatches"]:
        print(f"  request {m['index']}: {m['what']} differ from position {m['first_position']}")
    return 0 if not verdict["mismatches"] else 1


def main(argv: Sequence[str] | None = None) -> int:
    ns = parser().parse_args(argv)
    try:
        if ns.command == "resolve":
            print("FIELDS " + json.dumps(resolved_here(strip_separator(ns.args))), flush=True)
            return 0
        if ns.command == "lines":
            pair = line_pair(strip_separator(ns.args))
            print("# ECHO:")
            print(shell_line(pair.echo_argv, pair.dev_cache_size))
            print("# the oracle (stock HiSparse, the same resolved configuration):")
            print(shell_line(pair.oracle_argv))
            return 0
        if ns.command == "collect":
            prompts = load_prompts(ns.prompts, ns.num_prompts, ns.prompt_len, ns.seed)
            collect(ns.url, prompts, sampling_of(ns), not ns.no_logprobs, Path(ns.out))
            return 0
        if ns.command == "compare":
            return report(compare(read_collection(ns.oracle), read_collection(ns.echo)))
        return check(ns)
    except OracleError as exc:
        print(f"sglang-echo oracle: {exc}", file=sys.stderr)
        return 2


def check(ns: argparse.Namespace) -> int:
    pair = line_pair(strip_separator(ns.args))
    if pair.pd_decode:
        raise OracleError(
            "a PD decode node needs its prefill node and router: print the two decode lines "
            "with `lines`, run the cluster with the oracle's, `collect --url <router>`, then "
            "with ECHO's, `collect` again, and `compare` (docs/PLUGIN.md)"
        )
    workdir = Path(ns.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    run = {
        "prompts": load_prompts(ns.prompts, ns.num_prompts, ns.prompt_len, ns.seed),
        "sampling": sampling_of(ns),
        "logprobs": not ns.no_logprobs,
        "ready_timeout": ns.ready_timeout,
    }
    launcher = ns.launcher.split()
    oracle = serve_and_collect("oracle", launcher, pair.oracle_argv, False, ns.port, run, workdir)
    echo = serve_and_collect("echo", launcher, pair.echo_argv, True, ns.port, run, workdir)
    return report(compare(oracle, echo), workdir / "verdict.json")


if __name__ == "__main__":
    sys.exit(main())
