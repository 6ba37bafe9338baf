"""The description of an ECHO deployment on sglang 0.5.23 that sglang/launch_lines.py
writes the launch lines from: node counts, hosts, ports, the checkpoint, the KV dtype and
the per-rank sizes (their defaults by checkpoint and KV dtype), and the checks that a
description can give working lines (LaunchError lists every problem).

Pure Python (no torch, no sglang), as launch_lines.py, which imports it (never the other
way); ``tests/sglang/test_launch_lines.py`` resolves the lines of these descriptions.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from sglang_echo.config import ENV_DEV_CACHE, ConfigError, parse_size
from sglang_echo.sglang.args import DEFAULT_TOP_K

ATTENTION_HEADS = 128  # DeepSeek-V3.2's: a server's TP size must divide them
# --kv-cache-dtype spellings accepted -> the one emitted (ECHO stores bf16 or fp8_e4m3).
KV_DTYPES = {"fp8_e4m3": "fp8_e4m3", "bf16": "bfloat16", "bfloat16": "bfloat16"}
# Checkpoint kinds -> sglang's --quantization ("none": the fp8 checkpoint as published).
QUANTIZATIONS = {"none": None, "w4": "moe_wna16"}
# README's checkpoints: the published fp8 one (8 x H200), a W4 one (8 x H20) by a
# placeholder path.
DEFAULT_MODEL_PATH = {"none": "deepseek-ai/DeepSeek-V3.2", "w4": "/path/to/DeepSeek-V3.2-W4"}
GPU_OF = {"none": "H200", "w4": "H20"}
# Default (NSA_DEV_CACHE_SIZE, --max-total-tokens) per rank, by (checkpoint, KV dtype):
# what the plugin's start-up sizing admits on that checkpoint's GPU for a one-node server
# (test_launch_lines.py resolves each with the GPU's memory). Decode: README's sizes.
DECODE_SIZES = {
    ("none", "fp8_e4m3"): ("260_000", 2_000_000),
    ("none", "bfloat16"): ("260_000", 2_000_000),
    ("w4", "fp8_e4m3"): ("214_000", 800_000),
}
SERVER_SIZES = {
    ("none", "fp8_e4m3"): ("260_000", 1_500_000),
    ("none", "bfloat16"): ("130_000", 1_000_000),
    ("w4", "fp8_e4m3"): ("32_768", 400_000),
}


class LaunchError(ValueError):
    """A description that cannot give working lines; the message names each option."""


@dataclass(frozen=True)
class Deployment:
    """What the lines are generated from. Node counts are machines; a server spans
    ``*_nodes_per_server`` of them (sglang's ``--nnodes``). Sizes left None take the
    defaults above for the checkpoint and KV dtype."""

    model_path: str | None = None
    prefill_nodes: int = 1
    decode_nodes: int = 1
    prefill_nodes_per_server: int = 1
    decode_nodes_per_server: int = 1
    gpus_per_node: int = 8
    kv_cache_dtype: str = "fp8_e4m3"
    quantization: str = "none"
    ib_device: str | None = None
    dev_cache_size: str | None = None  # decode ranks' NSA_DEV_CACHE_SIZE, as written
    host_tokens: int | None = None  # decode ranks' --max-total-tokens
    server_dev_cache_size: str | None = None  # the non-PD server's, per rank
    server_host_tokens: int | None = None
    context_length: int = 131072  # the non-PD server's (ECHO plans one prompt's rows)
    prefill_hosts: tuple[str, ...] = ()  # one per prefill node; (): prefill-0, prefill-1...
    decode_hosts: tuple[str, ...] = ()
    server_host: str = "server-0"  # the non-PD server's node
    router_host: str = "router-0"  # where the router runs (it binds 0.0.0.0)
    prefill_port: int = 30000
    decode_port: int = 30001
    server_port: int = 30000
    bootstrap_port: int = 8998
    dist_init_port: int = 5000
    router_port: int = 8000

    # ------------------------------------------------------------------ derived values
    @property
    def kv_dtype(self) -> str:
        return KV_DTYPES.get(self.kv_cache_dtype, self.kv_cache_dtype)

    @property
    def model(self) -> str:
        return self.model_path or DEFAULT_MODEL_PATH.get(self.quantization, "")

    def sizes(self, role: str) -> tuple[str, int]:
        """(NSA_DEV_CACHE_SIZE, --max-total-tokens) per rank of a decode or non-PD server."""
        table, n_g, t = (
            (DECODE_SIZES, self.dev_cache_size, self.host_tokens)
            if role == "decode"
            else (SERVER_SIZES, self.server_dev_cache_size, self.server_host_tokens)
        )
        default = table.get((self.quantization, self.kv_dtype), ("", 0))  # ("", 0): refused
        return (default[0] if n_g is None else n_g), (default[1] if t is None else t)

    def hosts(self, role: str) -> tuple[str, ...]:
        given = self.prefill_hosts if role == "prefill" else self.decode_hosts
        count = self.prefill_nodes if role == "prefill" else self.decode_nodes
        return given or tuple(f"{role}-{i}" for i in range(count))

    def per_server(self, role: str) -> int:
        return self.prefill_nodes_per_server if role == "prefill" else self.decode_nodes_per_server

    # -------------------------------------------------------------------- validation
    def problems(self) -> list[str]:
        """One message per option that cannot give a working deployment."""
        out: list[str] = []
        if self.model_path is not None and not self.model_path.strip():
            out.append("--model-path is empty: name the checkpoint (a path or a hub id).")
        if self.kv_cache_dtype not in KV_DTYPES:
            out.append(
                f"--kv-cache-dtype {self.kv_cache_dtype}: ECHO stores fp8_e4m3 or bfloat16 "
                f"rows; use one of {', '.join(KV_DTYPES)}."
            )
        if self.quantization not in QUANTIZATIONS:
            out.append(
                f"--quantization {self.quantization}: use none (the fp8 DeepSeek-V3.2 "
                "checkpoint) or w4 (a 4-bit checkpoint loaded with --quantization moe_wna16)."
            )
        elif self.quantization == "w4" and self.kv_dtype == "bfloat16":
            out.append(
                "--quantization w4 with --kv-cache-dtype bf16: the W4 checkpoint is sized for "
                "8 x H20, where bf16 rows (1152 B per token and layer against fp8_e4m3's 656 B) "
                "leave no non-PD plan with a useful device cache at a 131072-token context; "
                "use --kv-cache-dtype fp8_e4m3, as README's W4 line does."
            )
        if self.gpus_per_node < 1:
            out.append(f"--gpus-per-node {self.gpus_per_node}: a node needs at least 1 GPU.")
        for role in ("prefill", "decode"):
            out += self._role_problems(role)
        out += self._size_problems()
        out += self._port_problems()
        for option, host in (
            ("--server-host", self.server_host),
            ("--router-host", self.router_host),
        ):
            out += _host_problems(option, host)
        return out

    def _role_problems(self, role: str) -> list[str]:
        count = self.prefill_nodes if role == "prefill" else self.decode_nodes
        per = self.per_server(role)
        if count < 1:
            return [f"--{role}-nodes {count}: a PD deployment needs at least 1 {role} node."]
        if per < 1:
            return [f"--{role}-nodes-per-server {per}: a server spans at least 1 node."]
        out: list[str] = []
        if count % per:
            out.append(
                f"--{role}-nodes {count} is not divisible by --{role}-nodes-per-server {per}: "
                f"every {role} server spans {per} node(s); use a multiple of {per}."
            )
        tp = self.gpus_per_node * per
        if self.gpus_per_node >= 1 and (tp & (tp - 1) or ATTENTION_HEADS % tp):
            out.append(
                f"--gpus-per-node {self.gpus_per_node} x --{role}-nodes-per-server {per} = "
                f"TP {tp}, which does not divide DeepSeek-V3.2's {ATTENTION_HEADS} attention "
                "heads; use a power of two up to 128 GPUs per server."
            )
        given = self.prefill_hosts if role == "prefill" else self.decode_hosts
        if given and len(given) != count:
            out.append(
                f"--{role}-hosts names {len(given)} host(s) but --{role}-nodes is {count}: "
                f"give one address per {role} node."
            )
        if len(set(given)) != len(given):
            out.append(f"--{role}-hosts names a host twice: each node is its own machine.")
        for host in given:
            out += _host_problems(f"--{role}-hosts", host)
        return out

    def _size_problems(self) -> list[str]:
        out: list[str] = []
        if (self.quantization, self.kv_dtype) not in DECODE_SIZES:
            return out  # a combination refused above: its sizes mean nothing yet
        for role, prefix in (("decode", ""), ("server", "server-")):
            n_g, t = self.sizes(role)
            try:
                value = parse_size(ENV_DEV_CACHE, n_g)
            except ConfigError as exc:
                out.append(f"--{prefix}dev-cache-size: {exc}")
            else:
                if value < DEFAULT_TOP_K:
                    out.append(
                        f"--{prefix}dev-cache-size {n_g}: ECHO's device cache must hold one "
                        f"request's top-{DEFAULT_TOP_K} selection; use at least {DEFAULT_TOP_K}."
                    )
            if t < 1:
                out.append(
                    f"--{prefix}max-total-tokens {t}: the host pool holds at least 1 token per "
                    "rank (e.g. 2000000)."
                )
        if self.context_length < 1:
            out.append(f"--context-length {self.context_length}: must be at least 1 token.")
        return out

    def _port_problems(self) -> list[str]:
        ports = {f.name: getattr(self, f.name) for f in fields(self) if f.name.endswith("_port")}
        out = [
            f"--{name.replace('_', '-')} {port}: a TCP port is 1..65535."
            for name, port in ports.items()
            if not 1 <= port <= 65535
        ]
        # The ports that one node's processes bind must differ.
        for role in ("prefill", "decode", "server"):
            same = [f"{role}_port"] + (["dist_init_port"] if role != "server" else [])
            same += ["bootstrap_port"] if role == "prefill" else []
            values = [ports[name] for name in same]
            if len(set(values)) != len(values):
                names = ", ".join(f"--{n.replace('_', '-')} {ports[n]}" for n in same)
                out.append(f"a {role} node binds {names}: they must differ.")
        return out

    def check(self) -> Deployment:
        """The deployment, or LaunchError listing every problem."""
        problems = self.problems()
        if problems:
            raise LaunchError(
                "cannot generate launch lines:\n" + "\n".join(f"  - {p}" for p in problems)
            )
        return self


def _host_problems(option: str, host: str) -> list[str]:
    if not host or any(c.isspace() for c in host) or any(c in host for c in "/,"):
        return [f"{option} {host!r}: give a host name or IP address (no scheme, path or space)."]
    return []
