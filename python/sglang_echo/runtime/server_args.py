"""``launch_server`` flags: named and behaving as SGLang's where they overlap.

SGLang flags that need a multi-GPU deployment (tensor/data parallelism, PD
disaggregation, quantized MoE...) are refused with a pointer to the SGLang plugin, which
runs ECHO inside SGLang itself. MTP speculative decoding (``--speculative-algorithm
NEXTN``) runs here, validated as ``generate`` validates it (runtime/speculative_flags.py). Values that cannot work fail here,
at start-up, with the flag to change.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass

from sglang_echo.config import ConfigError, HelpFormatter, help_epilog, parse_size
from sglang_echo.kernels.fp8_kv import KV_CACHE_DTYPES
from sglang_echo.runtime.speculative_flags import add_speculative_flags, speculative_steps

PLUGIN_HINT = (
    "this single-node runtime serves one model on one device; for {flag} run SGLang with "
    "the ECHO plugin instead (pip install sglang-echo, then NSA_KV_OFFLOAD=1 python -m "
    "sglang.launch_server ...; see python/sglang_echo/sglang/)"
)
# A separate draft model: the server drafts with the checkpoint's own MTP layer only.
SPECULATIVE_HINT = (
    "the draft is the checkpoint's own MTP (NextN) layer: use --speculative-algorithm "
    "NEXTN without a draft model path (docs/USAGE.md)"
)
# SGLang flags that take a value; accepted only at their single-device setting.
_SINGLE_DEVICE_ONLY = {"--tp": "1", "--tp-size": "1", "--dp": "1", "--dp-size": "1"}
_SINGLE_DEVICE_ONLY |= {"--pp-size": "1", "--ep-size": "1", "--nnodes": "1"}
# SGLang flags this runtime does not implement (with or without a value).
_UNSUPPORTED_WITH_VALUE = {
    "--disaggregation-bootstrap-port",
    "--quantization",
    "--speculative-draft-model-path",
    "--load-balance-method",
    "--dist-init-addr",
    "--node-rank",
    "--attention-backend",
}
_UNSUPPORTED_SWITCHES = {
    "--enable-dp-attention",
    "--enable-hierarchical-cache",
    "--enable-mixed-chunk",
    "--prefill-round-robin-balance",
}
_MODEL_LOADER_SPEC = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")
# Benchmark knobs that alter the served model's weights: not server flags (a model loader's).
_LOADER_FLAGS = {
    "--fake-kv-locality": "--fake-kv-locality is not a server flag: it alters the served "
    "model's weights (it biases every indexer toward the synthetic hot keys), so it belongs "
    "to a benchmark's model loader. In the repository: --model-loader "
    'benchmark.study.loader:load --model-loader-args="--fake-kv-locality P" (repository '
    "root on PYTHONPATH; python -m benchmark.study.loader --help)",
}
# SGLang switches that describe what this runtime already does (or does not do): accepted.
_HARMLESS_SWITCHES = {"--trust-remote-code"}


class ServerArgError(ValueError):
    """A flag or flag value the server cannot run with; the message says what to change."""


@dataclass
class ServerArgs:
    model_path: str
    host: str = "127.0.0.1"
    port: int = 30000
    device: str = "auto"
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    context_length: int | None = None
    max_total_tokens: int | None = None
    mem_fraction_static: float | None = None
    chunked_prefill_size: int | None = None
    max_running_requests: int | None = None
    cuda_graph_max_bs: int = 48
    disable_cuda_graph: bool = False
    disable_overlap_schedule: bool = False
    disable_radix_cache: bool = False  # accepted: there is no prefix cache to disable
    served_model_name: str | None = None
    log_level: str = "info"
    skip_server_warmup: bool = False
    max_request_bytes: int = 32 << 20
    # A PD decode node benchmarked alone (SGLang's --disaggregation-transfer-backend fake):
    # prompts' KV is synthesized on the node instead of transferred from a prefill node.
    disaggregation_mode: str = "null"
    disaggregation_transfer_backend: str | None = None
    # The one extension point for what is served (runtime/model_loader.py): MODULE:FUNCTION
    # builds the model instead of loading --model-path's checkpoint; its own flags as one
    # shell-quoted string.
    model_loader: str | None = None
    model_loader_args: str | None = None
    # HiSparse's policy as a third KV backend (offload/hisparse_cache.py), SGLang's flags.
    enable_hisparse: bool = False
    hisparse_config: str | None = None
    # The engine (model, KV cache, scheduler) in a process of its own behind the HTTP front
    # (runtime/engine_process.py), instead of a thread of the server's process.
    engine_process: bool = False
    # MTP speculative decoding (runtime/speculative_flags.py validates them).
    speculative_algorithm: str | None = None
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_num_draft_tokens: int | None = None


def _size(text: str) -> int:
    """Token counts as SGLang scripts write them, underscores allowed (1_800_000)."""
    try:
        return parse_size("value", text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number") from exc


def _chunk(text: str) -> int:
    if text.strip() == "-1":
        return -1
    return _size(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sglang_echo.launch_server",
        description="Serve a DeepSeek-V3.2 checkpoint over HTTP (SGLang's /generate and "
        "OpenAI's /v1 APIs) with continuous batching. NSA_KV_OFFLOAD=1 turns ECHO on "
        "(NSA_DEV_CACHE_SIZE = device cache slots per layer).",
        epilog=help_epilog(),
        formatter_class=HelpFormatter,
    )
    p.add_argument("--model-path", "--model", dest="model_path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="auto = bfloat16 on CUDA, float32 on CPU",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=list(KV_CACHE_DTYPES),
        help="how the MLA KV rows are stored (SGLang's names): auto = the model dtype; "
        "fp8_e4m3 = 656-byte rows at DeepSeek-V3.2's widths (e4m3 latent in tiles of 128 "
        "with float32 scales, bf16 rope), on the device pool and ECHO's host pool and cache alike",
    )
    p.add_argument(
        "--context-length", type=_size, default=None, help="default: max_position_embeddings"
    )
    p.add_argument(
        "--max-total-tokens",
        type=_size,
        default=None,
        help="KV pool tokens (the host pool under ECHO); default: from --mem-fraction-static",
    )
    p.add_argument(
        "--mem-fraction-static",
        type=float,
        default=None,
        help="share of device memory for weights + KV (default 0.88 on CUDA, 0.25 on CPU)",
    )
    p.add_argument(
        "--chunked-prefill-size",
        type=_chunk,
        default=None,
        help="prompt tokens per prefill forward; -1 = no chunking (default 8192, capped "
        "at NSA_DEV_CACHE_SIZE under ECHO)",
    )
    p.add_argument(
        "--max-running-requests",
        type=_size,
        default=None,
        help="default 64 (under ECHO at most NSA_DEV_CACHE_SIZE // index_topk)",
    )
    p.add_argument("--cuda-graph-max-bs", type=_size, default=48)
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument(
        "--disable-overlap-schedule",
        action="store_true",
        help="read each decode step's tokens before launching the next (by default the next "
        "step is launched first, from the tokens still on the device, so the host's work on "
        "a step runs while the device runs the next; outputs are the same either way)",
    )
    p.add_argument(
        "--disable-radix-cache", action="store_true", help="accepted (no prefix cache here)"
    )
    p.add_argument("--served-model-name", default=None, help="default: the model path")
    p.add_argument(
        "--engine-process",
        action="store_true",
        help="run the engine (model, KV cache, scheduler) in a process of its own, behind "
        "the HTTP front over ZeroMQ, so HTTP parsing and streaming do not share a GIL with "
        "the engine (needs pyzmq)",
    )
    p.add_argument(
        "--skip-server-warmup",
        action="store_true",
        help="announce readiness without first serving the warmup requests (a short one; "
        "on an ECHO server that prefills, also one long enough to compile the multi-launch "
        "append a batched prefill takes)",
    )
    p.add_argument(
        "--max-request-bytes",
        type=_size,
        default=32 << 20,
        help="largest request body accepted (default 32 MiB); larger ones get HTTP 413",
    )
    p.add_argument(
        "--disaggregation-mode",
        default="null",
        help="null (serve prefill and decode) or decode: a PD decode node; this runtime has "
        "no prefill node or transfer engine, so decode needs --disaggregation-transfer-backend "
        "fake (each prompt's KV is synthesized on the node, deterministic by prompt, and the "
        "request decodes at once; its output is meaningless, its speed is the point)",
    )
    p.add_argument(
        "--disaggregation-transfer-backend",
        default=None,
        help="fake (with --disaggregation-mode decode); real transfer engines need SGLang",
    )
    p.add_argument(
        "--model-loader",
        default=None,
        metavar="MODULE:FUNCTION",
        help="build the served model with this function instead of loading the checkpoint "
        "at --model-path (the module must be on PYTHONPATH; the contract: "
        "sglang_echo/runtime/model_loader.py). The repository's e2e benchmarks serve their "
        "study worker folders with benchmark.study.loader:load",
    )
    p.add_argument(
        "--model-loader-args",
        default=None,
        metavar="'FLAGS'",
        help="the --model-loader function's own flags, as one shell-quoted string "
        '(--model-loader-args="--flag value"); its module\'s --help lists them',
    )
    p.add_argument(
        "--enable-hisparse",
        action="store_true",
        help="HiSparse's policy instead of ECHO's: every token's MLA rows in the host pool "
        "(--max-total-tokens), a private LRU device buffer per request and layer; not with "
        "NSA_KV_OFFLOAD=1",
    )
    p.add_argument(
        "--hisparse-config",
        default=None,
        help='JSON, as SGLang\'s: {"device_buffer_size": 4096} (rows per request and layer; '
        "at least the model's index_topk)",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_speculative_flags(p)
    return p


def _check_foreign(unknown: list[str]) -> None:
    i = 0
    while i < len(unknown):
        raw = unknown[i]
        flag, eq, value = raw.partition("=")
        if flag in _HARMLESS_SWITCHES:
            i += 1
            continue
        if flag in _SINGLE_DEVICE_ONLY or flag in _UNSUPPORTED_WITH_VALUE:
            if not eq:
                value = unknown[i + 1] if i + 1 < len(unknown) else ""
                i += 1
            if flag in _SINGLE_DEVICE_ONLY and value.strip() == _SINGLE_DEVICE_ONLY[flag]:
                i += 1
                continue
            shown = f"{flag} {value}".strip()
            if flag.startswith("--speculative-"):
                raise ServerArgError(f"{shown} is not supported by this server: {SPECULATIVE_HINT}")
            raise ServerArgError(f"{shown} is not supported: " + PLUGIN_HINT.format(flag=shown))
        if flag in _UNSUPPORTED_SWITCHES:
            raise ServerArgError(f"{flag} is not supported: " + PLUGIN_HINT.format(flag=flag))
        if flag in _LOADER_FLAGS:
            raise ServerArgError(_LOADER_FLAGS[flag])
        raise ServerArgError(
            f"unknown flag {raw!r}; see python -m sglang_echo.launch_server --help"
        )


def parse_server_args(argv: list[str] | None = None) -> ServerArgs:
    parser = build_parser()
    ns, unknown = parser.parse_known_args(argv)
    _check_foreign(unknown)
    args = ServerArgs(**vars(ns))
    if not 0 < args.port < 65536:
        raise ServerArgError(f"--port {args.port} is not a TCP port (1-65535)")
    if args.mem_fraction_static is not None and not 0 < args.mem_fraction_static <= 1:
        raise ServerArgError(f"--mem-fraction-static {args.mem_fraction_static} must be in (0, 1]")
    _check_disaggregation(args)
    _check_model_loader(args)
    hisparse_buffer_size(args)  # a malformed --hisparse-config fails here, at start-up
    speculative_num_steps(args)
    return args


def speculative_num_steps(args: ServerArgs) -> int | None:
    """S under ``--speculative-algorithm`` (else None), validated as ``generate`` does;
    what the server cannot combine with it is refused with the reason."""
    steps = speculative_steps(args, ServerArgError)
    if steps is None:
        return None
    shown = f"--speculative-algorithm {args.speculative_algorithm}"
    if args.enable_hisparse:
        raise ServerArgError(
            f"{shown} is not supported with --enable-hisparse: verify steps are implemented "
            "for the plain pool and ECHO only; use ECHO (NSA_KV_OFFLOAD=1) or the plain pool"
        )
    return steps


def hisparse_buffer_size(args: ServerArgs) -> int | None:
    """The HiSparse-like backend's rows per request and layer, or None when it is off."""
    if args.hisparse_config is not None and not args.enable_hisparse:
        raise ServerArgError("--hisparse-config needs --enable-hisparse")
    if not args.enable_hisparse:
        return None
    from sglang_echo.offload.hisparse_cache import DEFAULT_DEVICE_BUFFER_SIZE

    if args.hisparse_config is None:
        return DEFAULT_DEVICE_BUFFER_SIZE
    try:
        cfg = json.loads(args.hisparse_config)
    except json.JSONDecodeError as exc:
        raise ServerArgError(f"--hisparse-config is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict) or set(cfg) - {"device_buffer_size"}:
        raise ServerArgError(
            '--hisparse-config takes {"device_buffer_size": N}; got ' + args.hisparse_config
        )
    size = cfg.get("device_buffer_size", DEFAULT_DEVICE_BUFFER_SIZE)
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ServerArgError(f"device_buffer_size must be a positive integer, got {size!r}")
    return size


def _check_disaggregation(args: ServerArgs) -> None:
    mode, backend = args.disaggregation_mode, args.disaggregation_transfer_backend
    if mode == "prefill":
        flag = "--disaggregation-mode prefill"
        raise ServerArgError(f"{flag} is not supported: " + PLUGIN_HINT.format(flag=flag))
    if mode not in ("null", "decode"):
        raise ServerArgError(f"--disaggregation-mode {mode!r} must be null or decode")
    if mode == "decode" and backend != "fake":
        raise ServerArgError(
            "--disaggregation-mode decode needs --disaggregation-transfer-backend fake here "
            f"(got {backend!r}): this runtime has no transfer engine; for a real PD "
            "deployment run SGLang with the ECHO plugin"
        )
    if mode == "null" and backend is not None:
        raise ServerArgError(
            f"--disaggregation-transfer-backend {backend} needs --disaggregation-mode decode"
        )


def check_model_loader_spec(spec: str) -> None:
    """MODULE:FUNCTION, checked at start-up; the import waits for build_serving."""
    if not _MODEL_LOADER_SPEC.fullmatch(spec):
        raise ServerArgError(f"--model-loader {spec!r} must be MODULE:FUNCTION (pkg.mod:load)")


def _check_model_loader(args: ServerArgs) -> None:
    if args.model_loader_args is not None and args.model_loader is None:
        raise ServerArgError("--model-loader-args needs --model-loader")
    if args.model_loader is not None:
        check_model_loader_spec(args.model_loader)
