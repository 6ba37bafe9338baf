"""Complete launch lines for ECHO on sglang 0.5.23: every node of a PD deployment, its
router, and the non-disaggregated alternative, from one description.

Why a generator: a PD deployment is several command lines that must agree, and a
hand-written decode line leaves the rest to the reader. Both sides of a PD pair must use
the same KV layout (``--page-size 64`` and the same ``--kv-cache-dtype``: the transfer
copies pages as they are), the prefill node must run *without* ECHO (the plugin refuses
``--disaggregation-mode prefill``), the router must name every prefill server with its
bootstrap port and every decode server, and the nodes of a multi-node server must share
``--nnodes`` and ``--dist-init-addr`` with ranks 0..n-1. Writing them from one description
keeps them consistent; ``tests/sglang/test_launch_lines.py`` resolves every sglang line
it emits under sglang 0.5.23's real argument resolution, and checks the default sizes
against the plugin's start-up sizing on the GPUs they are meant for.

The shapes follow README's launch lines and the plugin's rules (``args.py``,
docs/PLUGIN.md "Flags and sizes"): decode servers run TP with DP attention over all their
GPUs (``--tp-size G --dp-size G --enable-dp-attention``), so ``NSA_DEV_CACHE_SIZE`` and
``--max-total-tokens`` are per attention-DP rank; ``--cuda-graph-max-bs-decode 128``,
because sglang's default decode graphs leave too little of the GPU for the pools. The
non-PD server uses DP attention too, instead of plain ``--tp 8`` (where every GPU pins a
copy of one scheduler's host pool). Its sizes are smaller than a decode node's: it also
keeps one prompt's rows on the device, and sglang leaves a non-PD server less of the GPU.

The description (``Deployment``, its default sizes and checks) lives in
sglang/launch_deployment.py; this module writes its lines, renders them and is the CLI.
Pure Python (no torch, no sglang): ``python -m sglang_echo.sglang.launch_lines --help``.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path

from sglang_echo.config import ENV_DEV_CACHE, ENV_OFFLOAD
from sglang_echo.sglang.args import DSA_PAGE_SIZE
from sglang_echo.sglang.launch_deployment import (
    DECODE_SIZES,
    DEFAULT_MODEL_PATH,
    GPU_OF,
    KV_DTYPES,
    QUANTIZATIONS,
    SERVER_SIZES,
    Deployment,
    LaunchError,
)

CUDA_GRAPH_MAX_BS_DECODE = 128  # README: sglang's default (512 per rank) does not fit
TRANSFER_BACKEND = "mooncake"
COMMAND = "python -m sglang_echo.sglang.launch_lines"
# Deployment fields whose CLI flag is not their name.
FLAG_OF = {"host_tokens": "--max-total-tokens", "server_host_tokens": "--server-max-total-tokens"}


# --------------------------------------------------------------------------- the lines
@dataclass(frozen=True)
class Line:
    """One command on one node; ``name`` selects it in the script (``bash SCRIPT NAME``)."""

    name: str
    role: str  # prefill, decode, router, server
    host: str  # the node it runs on
    title: str  # what it is, in one line
    env: dict[str, str] = field(default_factory=dict)
    module: str = "sglang.launch_server"
    argv: tuple[str, ...] = ()

    def shell(self, width: int = 92) -> str:
        """The command as README writes it: env, ``python -m``, flags wrapped with ``\\``."""
        words = [f"{k}={shlex.quote(v)}" for k, v in self.env.items()]
        rows, row = [], " ".join([*words, "python", "-m", self.module])
        for unit in _units(self.argv):
            if len(row) + 1 + len(unit) > width - 2:
                rows.append(row)
                row = "    " + unit
            else:
                row += " " + unit
        return " \\\n".join([*rows, row])


def _units(argv: tuple[str, ...]) -> list[str]:
    """Each flag with its values, quoted, so that wrapping never splits a flag's values."""
    units: list[str] = []
    for word in argv:
        if word.startswith("--") or not units:
            units.append(shlex.quote(word))
        else:
            units[-1] += " " + shlex.quote(word)
    return units


def _model(dep: Deployment) -> list[str]:
    quantization = QUANTIZATIONS[dep.quantization]
    return ["--model-path", dep.model, *(["--quantization", quantization] if quantization else [])]


def _layout(dep: Deployment) -> list[str]:
    """The KV layout, stated on both sides of a PD pair (and on the non-PD server)."""
    return ["--kv-cache-dtype", dep.kv_dtype, "--page-size", str(DSA_PAGE_SIZE)]


def _echo(dep: Deployment, role: str) -> tuple[dict[str, str], list[str]]:
    """ECHO's environment and sizing flags for a decode or non-PD server."""
    n_g, t = dep.sizes(role)
    flags = ["--cuda-graph-max-bs-decode", str(CUDA_GRAPH_MAX_BS_DECODE)]
    return {ENV_OFFLOAD: "1", ENV_DEV_CACHE: n_g}, [*flags, "--max-total-tokens", str(t)]


def _servers(dep: Deployment, role: str) -> list[tuple[str, ...]]:
    """The hosts of each server of ``role``; the first is node rank 0 (HTTP, bootstrap)."""
    hosts, per = dep.hosts(role), dep.per_server(role)
    return [hosts[i : i + per] for i in range(0, len(hosts), per)]


def _node_lines(dep: Deployment, role: str) -> list[Line]:
    lines = []
    port = dep.prefill_port if role == "prefill" else dep.decode_port
    for s, hosts in enumerate(_servers(dep, role)):
        tp = str(dep.gpus_per_node * len(hosts))
        for rank, host in enumerate(hosts):
            argv = [*_model(dep), "--tp-size", tp]
            if role == "decode":
                argv += ["--dp-size", tp, "--enable-dp-attention"]
            argv += ["--trust-remote-code", "--disaggregation-mode", role]
            argv += ["--disaggregation-transfer-backend", TRANSFER_BACKEND]
            if dep.ib_device:
                argv += ["--disaggregation-ib-device", dep.ib_device]
            if role == "prefill":
                # An exported NSA_KV_OFFLOAD=1 would stop a prefill node: say 0 outright.
                env = {ENV_OFFLOAD: "0"}
                argv += ["--disaggregation-bootstrap-port", str(dep.bootstrap_port)]
                argv += _layout(dep)
                what = "plain sglang, ECHO off (the plugin refuses prefill nodes)"
            else:
                env, sizing = _echo(dep, "decode")
                argv += [*_layout(dep), *sizing]
                what = f"ECHO on, sizes per attention-DP rank ({tp} ranks)"
            if len(hosts) > 1:
                argv += ["--nnodes", str(len(hosts)), "--node-rank", str(rank)]
                argv += ["--dist-init-addr", f"{hosts[0]}:{dep.dist_init_port}"]
            argv += ["--host", "0.0.0.0", "--port", str(port)]
            where = f", node rank {rank} of {len(hosts)}" if len(hosts) > 1 else ""
            lines.append(
                Line(
                    name=f"{role}-{dep.hosts(role).index(host)}",
                    role=role,
                    host=host,
                    title=f"{role} server {s}{where}, TP {tp} on {host}: {what}",
                    env=env,
                    argv=tuple(argv),
                )
            )
    return lines


def router_line(dep: Deployment) -> Line:
    """sglang_router's PD mode: ``--prefill URL BOOTSTRAP_PORT`` per prefill server (its
    rank-0 node serves HTTP and the bootstrap server), ``--decode URL`` per decode server."""
    argv = ["--pd-disaggregation"]
    for hosts in _servers(dep, "prefill"):
        argv += ["--prefill", f"http://{hosts[0]}:{dep.prefill_port}", str(dep.bootstrap_port)]
    for hosts in _servers(dep, "decode"):
        argv += ["--decode", f"http://{hosts[0]}:{dep.decode_port}"]
    argv += ["--host", "0.0.0.0", "--port", str(dep.router_port)]
    return Line(
        name="router",
        role="router",
        host=dep.router_host,
        title=f"the router on {dep.router_host}; clients send requests to its port {dep.router_port}",
        module="sglang_router.launch_router",
        argv=tuple(argv),
    )


def server_line(dep: Deployment) -> Line:
    """The non-disaggregated alternative on one node: DP attention over its GPUs (each
    rank a scheduler with its own pools, as on the decode nodes), not plain ``--tp``."""
    g = str(dep.gpus_per_node)
    env, sizing = _echo(dep, "server")
    argv = [*_model(dep), "--tp-size", g, "--dp-size", g, "--enable-dp-attention"]
    argv += ["--trust-remote-code", *_layout(dep), *sizing]
    argv += ["--context-length", str(dep.context_length), "--host", "0.0.0.0"]
    argv += ["--port", str(dep.server_port)]
    return Line(
        name="server",
        role="server",
        host=dep.server_host,
        title=(
            f"instead of PD, one non-disaggregated server on {dep.server_host}: TP {g} with "
            "DP attention, ECHO on, sizes per rank"
        ),
        env=env,
        argv=tuple(argv),
    )


def launch_lines(dep: Deployment) -> list[Line]:
    """Every line, in start order: prefill nodes, decode nodes, router; then the non-PD
    server (an alternative to the others)."""
    dep.check()
    return [
        *_node_lines(dep, "prefill"),
        *_node_lines(dep, "decode"),
        router_line(dep),
        server_line(dep),
    ]


# ------------------------------------------------------------------------ rendering
def command_args(dep: Deployment) -> list[str]:
    """The generator's options that reproduce ``dep`` (those at their defaults left out)."""
    words: list[str] = []
    default = Deployment()
    for f in fields(dep):
        value = getattr(dep, f.name)
        if value != getattr(default, f.name):
            flag = FLAG_OF.get(f.name, "--" + f.name.replace("_", "-"))
            words += [flag, ",".join(value) if isinstance(value, tuple) else str(value)]
    return words


def _command(dep: Deployment, *extra: str) -> str:
    return " ".join([COMMAND, *(shlex.quote(w) for w in [*extra, *command_args(dep)])])


def _n(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def _summary(dep: Deployment) -> str:
    p, d = len(_servers(dep, "prefill")), len(_servers(dep, "decode"))
    quant = "W4 (--quantization moe_wna16)" if dep.quantization == "w4" else "fp8"
    n_g, t = dep.sizes("decode")
    return (
        f"{_n(dep.prefill_nodes, 'prefill node')} as {_n(p, 'server')} and "
        f"{_n(dep.decode_nodes, 'decode node')} as {_n(d, 'server')}, "
        f"{_n(dep.gpus_per_node, 'GPU')} per node (sized for "
        f"{GPU_OF[dep.quantization]}); {quant} checkpoint {dep.model}; KV cache "
        f"{dep.kv_dtype} in {DSA_PAGE_SIZE}-token pages on both sides; per decode rank "
        f"{ENV_DEV_CACHE}={n_g} and a host pool of {t} tokens (--max-total-tokens)."
    )


def render_script(dep: Deployment) -> str:
    """A bash script: ``bash SCRIPT NAME`` runs node NAME's line (on that machine)."""
    lines = launch_lines(dep)
    names = [line.name for line in lines]
    out = [
        "#!/usr/bin/env bash",
        f"# Generated by: {_command(dep)}",
        f"# {_summary(dep)}",
        f"# Run `bash THIS_SCRIPT NAME` on each machine, NAME one of: {' '.join(names)}",
        "# (the router after the servers; `server` is the non-PD alternative to all of them).",
        "set -euo pipefail",
        'case "${1:-}" in',
    ]
    for line in lines:
        body = "\n".join("    " + row for row in line.shell().splitlines())
        out += [f"  # {line.title}", f"  {line.name})", body, "    ;;"]
    out += ["  *)", f'    echo "usage: $0 {{{"|".join(names)}}}" >&2', "    exit 2", "    ;;"]
    return "\n".join([*out, "esac", ""])


def render_markdown(dep: Deployment) -> str:
    """The lines as documentation: one bash block per node, in start order."""
    lines = launch_lines(dep)
    n_g, t = dep.sizes("server")
    out = [
        "# SGLang launch lines for ECHO",
        "",
        f"Generated by `{_command(dep, '--markdown')}`: change the generator "
        "(`python/sglang_echo/sglang/launch_lines.py`), not this file "
        "(`tests/sglang/test_launch_lines.py` checks that the two agree).",
        "",
        _summary(dep),
        "Prefill nodes run plain sglang (`NSA_KV_OFFLOAD=0`: the plugin refuses prefill "
        "nodes); decode nodes run ECHO with DP attention, so its sizes are per rank. Both "
        "sides state `--page-size` and `--kv-cache-dtype`, which must match for the KV "
        "transfer. Start the servers, then the router; clients talk to the router.",
        "",
    ]
    for line in lines:
        out += [f"`{line.name}`: {line.title}.", "", "```bash", line.shell(), "```", ""]
    out += [
        f"The non-PD server's sizes ({ENV_DEV_CACHE}={n_g}, host pool {t} per rank) are "
        "smaller than a decode node's: it also keeps one prompt's rows (`--context-length`) "
        "on the device, and sglang leaves a non-PD server less of the GPU. The plugin checks "
        "every size at start-up and says what fits (README, docs/PLUGIN.md).",
        "",
        f"Other shapes: `--prefill-nodes 2 --decode-nodes 2` (two servers per side), "
        "`--decode-nodes-per-server 2` (one decode server over two nodes: `--nnodes`, "
        "`--node-rank`, `--dist-init-addr`), `--quantization w4` (the W4 checkpoint on "
        f"H20s); `{COMMAND} --help` lists every option. The same lines as a script: drop "
        "`--markdown`, then run `bash SCRIPT NAME` on each node.",
        "",
    ]
    return "\n".join(out)


# ------------------------------------------------------------------------------ CLI
class _DefaultsShown(argparse.HelpFormatter):
    """``(default: X)`` after each option that has one; None means a derived default,
    which the option's help states itself."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default not in (None, "", False, argparse.SUPPRESS):
            text += " (default: %(default)s)"
        return text


def _defaults_of(table: dict[tuple[str, str], tuple[str, int]], i: int) -> str:
    """A sizes table's defaults, for --help: "X (fp8 checkpoint, fp8_e4m3 rows); ..."."""
    return "; ".join(f"{v[i]} ({q}, {kv})" for (q, kv), v in table.items())


def build_parser() -> argparse.ArgumentParser:
    d = Deployment()
    p = argparse.ArgumentParser(
        prog=COMMAND,
        usage="%(prog)s [options]",
        description=(
            "Print the complete launch lines of an ECHO deployment on sglang 0.5.23: every "
            "prefill node (plain sglang), every decode node (NSA_KV_OFFLOAD=1, DP attention), "
            "the sglang_router PD router, and a non-PD server with DP attention, as a bash "
            "script (`bash SCRIPT NAME` on each node) or as markdown. Both sides of the PD "
            "pair get the same --page-size 64 and --kv-cache-dtype. Sizes are per "
            "attention-DP rank; their defaults depend on the checkpoint and the KV dtype "
            "(quantization, kv dtype) and fit that checkpoint's GPU."
        ),
        formatter_class=_DefaultsShown,
    )
    add = p.add_argument
    models = ", ".join(f"{v} ({k})" for k, v in DEFAULT_MODEL_PATH.items())
    add("--model-path", help=f"checkpoint path or hub id; default by --quantization: {models}")
    add(
        "--quantization",
        default=d.quantization,
        choices=list(QUANTIZATIONS),
        help="none: the fp8 DeepSeek-V3.2 checkpoint (sized for 8 x H200); w4: a 4-bit "
        "checkpoint, --quantization moe_wna16 (sized for 8 x H20)",
    )
    add(
        "--kv-cache-dtype",
        default=d.kv_cache_dtype,
        metavar="DTYPE",
        help=f"KV cache rows, the same on both sides: {', '.join(KV_DTYPES)} (not bf16 with w4)",
    )
    add("--prefill-nodes", type=int, default=d.prefill_nodes, metavar="N", help="prefill machines")
    add("--decode-nodes", type=int, default=d.decode_nodes, metavar="N", help="decode machines")
    add(
        "--prefill-nodes-per-server",
        type=int,
        default=1,
        metavar="N",
        help="machines one prefill server spans (>1: --nnodes, --node-rank, --dist-init-addr)",
    )
    add(
        "--decode-nodes-per-server",
        type=int,
        default=1,
        metavar="N",
        help="machines one decode server spans (its TP = DP attention = GPUs per node x N)",
    )
    add("--gpus-per-node", type=int, default=d.gpus_per_node, metavar="N", help="GPUs per machine")
    add(
        "--ib-device",
        metavar="DEV",
        help="InfiniBand device(s) for the mooncake transfer "
        "(sglang's --disaggregation-ib-device), e.g. mlx5_0; unset: mooncake's discovery",
    )
    add(
        "--dev-cache-size",
        metavar="N_G",
        help=f"decode ranks' {ENV_DEV_CACHE}, ECHO's "
        f"device cache in slots per layer; default {_defaults_of(DECODE_SIZES, 0)}",
    )
    add(
        "--max-total-tokens",
        dest="host_tokens",
        type=int,
        metavar="T",
        help=f"decode ranks' host pool in tokens; default {_defaults_of(DECODE_SIZES, 1)}",
    )
    add(
        "--server-dev-cache-size",
        metavar="N_G",
        help=f"the non-PD server's {ENV_DEV_CACHE}"
        f" per rank; default {_defaults_of(SERVER_SIZES, 0)}",
    )
    add(
        "--server-max-total-tokens",
        dest="server_host_tokens",
        type=int,
        metavar="T",
        help=f"the non-PD server's host pool per rank; default {_defaults_of(SERVER_SIZES, 1)}",
    )
    add(
        "--context-length",
        type=int,
        default=d.context_length,
        metavar="TOKENS",
        help="the non-PD server's --context-length (ECHO keeps one prompt's rows on the GPU)",
    )
    add(
        "--prefill-hosts",
        default="",
        metavar="H1,H2,...",
        help="address of each prefill node (default prefill-0,prefill-1,...)",
    )
    add(
        "--decode-hosts",
        default="",
        metavar="H1,H2,...",
        help="address of each decode node (default decode-0,decode-1,...)",
    )
    add("--server-host", default=d.server_host, metavar="HOST", help="the non-PD server's node")
    add("--router-host", default=d.router_host, metavar="HOST", help="the router's machine")
    for name, what in (
        ("prefill-port", "prefill servers' HTTP port"),
        ("decode-port", "decode servers' HTTP port"),
        ("server-port", "the non-PD server's HTTP port"),
        ("bootstrap-port", "prefill servers' KV bootstrap port (--disaggregation-bootstrap-port)"),
        ("dist-init-port", "--dist-init-addr's port on a multi-node server's first node"),
        ("router-port", "the router's HTTP port"),
    ):
        default = getattr(d, name.replace("-", "_"))
        add(f"--{name}", type=int, default=default, metavar="PORT", help=what)
    add("--markdown", action="store_true", help="print documentation blocks, not a script")
    add("--out", type=Path, metavar="FILE", help="write to FILE instead of stdout")
    return p


def deployment_from_args(ns: argparse.Namespace) -> Deployment:
    def hosts(text: str) -> tuple[str, ...]:
        return tuple(h.strip() for h in text.split(",")) if text.strip() else ()

    values = {f.name: getattr(ns, f.name) for f in fields(Deployment)}
    values.update(prefill_hosts=hosts(ns.prefill_hosts), decode_hosts=hosts(ns.decode_hosts))
    return Deployment(**values)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        dep = deployment_from_args(ns).check()
    except LaunchError as exc:  # every problem, without argparse's long usage block
        print(f"{COMMAND}: {exc}\n(see --help)", file=sys.stderr)
        return 2
    text = render_markdown(dep) if ns.markdown else render_script(dep)
    if ns.out is None:
        sys.stdout.write(text)
    else:
        ns.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
