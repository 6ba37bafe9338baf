"""Server arguments for ECHO: the user's flags -> a valid HiSparse-based configuration.

With ``NSA_KV_OFFLOAD=1`` the user states the host pool (``--max-total-tokens``, tokens
kept in pinned host memory) and the device cache (``NSA_DEV_CACHE_SIZE`` = N_G slots per
layer). SGLang's HiSparse sizes its pools differently: ``max_total_tokens`` = S device
rows, and ``hisparse_config.host_to_device_ratio`` = R, giving S x R logical (= host)
tokens. So the plan is

    S = ceil64(N_G + 1) + 64 x running per rank + (non-PD: one longest prompt, ceil64)
    R = ceil((T + 64) / S)

(sglang's host pool has S x R + 64 slots, of which ECHO keeps two pages, so S x R - 64
slots hold tokens: at least T.)

where each running request owns one 64-row page for its newest token, and a local
prefill keeps its prompt's rows on the device until the prompt is on the host. Running
requests are bounded by N_G // top-k: one decode step's selections must all be resident.

Under DP attention (``--tp-size 8 --dp-size 8 --enable-dp-attention``, the ECHO
artifact's deployment; sglang 0.5.23 turns it into ``attn_dp_size = 8``) every
attention-DP rank is a scheduler of its own with its own KV pools: sglang caps each
rank at ``max_running_requests // attn_dp_size`` requests and each rank's pool at
``--max-total-tokens``. So N_G, T and S are per rank, the N_G // top-k bound applies to
each rank's share, and the global ``max_running_requests`` is that share x attn_dp_size.

At the late resolution step (``args_sizing.check_resolved``) the plan must still hold and
is sized against the GPU and the host (``sizing.py``); ``args_sizing.py`` gathers the
sizing's inputs from sglang, here and in each scheduler.

Plain Python: reads an attribute view of the arguments (SGLang's resolving view, or any
namespace in tests) and returns declarations; ``install`` wires it into SGLang. It imports
no sglang (the sizing's inputs, which do, are in ``args_sizing.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sglang_echo.config import (
    ENV_DEV_CACHE,
    ENV_OFFLOAD,
    ConfigError,
    EchoConfig,
    dev_cache_for,
)
from sglang_echo.sglang import sizing

DSA_PAGE_SIZE = 64  # SGLang forces 64-token pages for DSA models
DEFAULT_TOP_K = 2048  # DeepSeek-V3.2's index_topk, when the model config is not readable
SOURCE = "sglang-echo"
# ECHO's entries in hisparse_config (sglang passes unknown keys on as sparse_extra_config):
ECHO_EXTRA_KEY = "echo_dev_cache"  # N_G
HOST_TOKENS_KEY = "echo_host_tokens"  # T, checked against the host pool sglang builds
DEVICE_ROWS_KEY = "echo_device_rows"  # S, checked against the rows left after profiling
# HiSparse's decode backends on CUDA, by KV cache dtype (sglang 0.5.23 hisparse_hook).
DECODE_BACKENDS = {
    "bfloat16": ("flashmla_sparse",),
    "fp8_e4m3": ("flashmla_kv", "flashinfer_sparse_mla"),
}
RETRACTION_BACKUP = "none"  # no copy: the plugin keeps the host ids (see declarations)


def _ceil(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class EchoPlan:
    dev_cache_size: int  # N_G, ECHO slots per layer
    host_tokens: int  # T, the user's --max-total-tokens
    top_k: int
    max_running_requests: int  # sglang's global cap: per_rank_running x attn_dp_size
    prefill_rows: int  # device rows kept for local prefills (0 on a PD decode node)
    device_rows: int  # S, HiSparse's max_total_tokens
    host_to_device_ratio: int  # R
    attn_dp_size: int = 1  # attention-DP ranks; each has its own pools of these sizes
    pd_decode: bool = False  # a PD decode node (prompt KV arrives in the host pool)
    context_len: int | None = None  # sglang's context length, when known
    running_asked: int | None = None  # per-rank requests the user asked for (else N_G // top-k)

    @property
    def per_rank_running(self) -> int:
        """Requests one attention-DP rank runs at once (what N_G // top-k bounds)."""
        return self.max_running_requests // self.attn_dp_size

    def sizes(self) -> sizing.EchoSizes:
        """The plan's inputs to the start-up sizing (sizing.py)."""
        return sizing.EchoSizes(
            dev_cache_size=self.dev_cache_size,
            host_tokens=self.host_tokens,
            top_k=self.top_k,
            prefill_rows=self.prefill_rows,
            running=self.running_asked,
        )

    def hisparse_config(self) -> str:
        return json.dumps(
            {
                "top_k": self.top_k,
                # HiSparse's per-request buffer is not used by ECHO; its minimum (top-k,
                # page-aligned) keeps the per-request tables ECHO frees small.
                "device_buffer_size": _ceil(self.top_k, DSA_PAGE_SIZE),
                "host_to_device_ratio": self.host_to_device_ratio,
                ECHO_EXTRA_KEY: self.dev_cache_size,
                HOST_TOKENS_KEY: self.host_tokens,
                DEVICE_ROWS_KEY: self.device_rows,
            },
            sort_keys=True,
        )

    def declarations(self) -> dict[str, Any]:
        """The fields the plugin sets (names: ``declared_fields``)."""
        fields: dict[str, Any] = {
            "enable_hisparse": True,
            "disable_radix_cache": True,
            "hisparse_config": self.hisparse_config(),
            "max_total_tokens": self.device_rows,
            "max_running_requests": self.max_running_requests,
        }
        if self.pd_decode:
            # Retraction on a PD decode node: sglang would back the request's KV up with
            # the device pool's get_cpu_copy (not implemented by the DSA pools; the
            # scheduler crashes). "none": no copy is made; the plugin's hooks keep the
            # request's host ids instead (its KV is all in the host pool) and resume it
            # with them (sglang/retraction.py), so it is neither copied nor aborted.
            fields["disaggregation_decode_retraction_backup"] = RETRACTION_BACKUP
        return fields


def declared_fields(pd_decode: bool) -> tuple[str, ...]:
    """The names of ``EchoPlan.declarations`` (the oracle sets each one explicitly)."""
    plan = EchoPlan(1, 1, 1, 1, 0, 1, 1, pd_decode=pd_decode)
    return tuple(plan.declarations())


def _is_set(value: Any) -> bool:
    return value is not None and str(value).upper() != "NONE"


def incompatible_flags(view: Any) -> list[str]:
    """One message per flag that ECHO cannot run with, naming the flag to change."""
    off = f"drop it, or launch without {ENV_OFFLOAD}=1"
    problems: list[str] = []

    def get(name: str, default: Any = None) -> Any:
        return getattr(view, name, default)

    if _is_set(get("speculative_algorithm")):
        problems.append(
            f"--speculative-algorithm {get('speculative_algorithm')}: speculative decoding "
            f"is not supported with ECHO; {off}."
        )
    if get("enable_mixed_chunk"):
        problems.append(f"--enable-mixed-chunk: not supported with HiSparse/ECHO; {off}.")
    if get("disaggregation_mode") == "prefill":
        problems.append(
            "--disaggregation-mode prefill: ECHO runs on decode nodes and on "
            f"non-disaggregated servers; launch the prefill node without {ENV_OFFLOAD}=1."
        )
    if get("disaggregation_decode_enable_radix_cache"):
        problems.append(
            "--disaggregation-decode-enable-radix-cache: the decode radix cache is not "
            f"supported with ECHO; {off}."
        )
    backup = get("disaggregation_decode_retraction_backup")
    if backup not in (None, RETRACTION_BACKUP):
        problems.append(
            f"--disaggregation-decode-retraction-backup {backup}: ECHO's KV lives in its "
            "host pool, which sglang's retraction backups cannot copy; drop the flag "
            f"(sglang-echo sets {RETRACTION_BACKUP!r} and keeps a retracted request's host "
            "KV, resuming it from there)."
        )
    if get("enable_hierarchical_cache"):
        problems.append(
            f"--enable-hierarchical-cache: HiCache and ECHO both own the host KV pool; {off}."
        )
    if get("enable_unified_memory"):
        problems.append(f"--enable-unified-memory: not supported with ECHO; {off}.")
    if get("enable_kv_cache_sharding"):
        problems.append(f"--enable-kv-cache-sharding: not supported with ECHO; {off}.")
    problems += untested_flags(get, off)
    for flag, name in (
        ("--pp-size", "pp_size"),
        ("--dcp-size", "dcp_size"),
        ("--attention-context-parallel-size", "attn_cp_size"),
    ):
        value = get(name, 1)
        if value is not None and int(value) > 1:
            problems.append(
                f"{flag} {value}: ECHO supports tensor parallelism and DP attention only; "
                f"set {flag} 1."
            )
    replicas = get("dp_size", 1)
    if replicas is not None and int(replicas) > 1 and not get("enable_dp_attention"):
        problems.append(
            f"--dp-size {replicas} without --enable-dp-attention starts {replicas} server "
            "replicas, which ECHO does not support; add --enable-dp-attention (attention "
            "DP, the ECHO deployment) or set --dp-size 1."
        )
    if get("hisparse_config") is not None:
        problems.append(
            "--hisparse-config: sglang-echo writes HiSparse's configuration itself; "
            f"drop the flag and size the device cache with {ENV_DEV_CACHE}."
        )
    page = get("page_size")
    if page is not None and int(page) != DSA_PAGE_SIZE:
        problems.append(f"--page-size {page}: DSA models use 64-token pages; set --page-size 64.")
    problems += backend_problems(get("kv_cache_dtype", "auto"), get("dsa_decode_backend"))
    return problems


def untested_flags(get: Any, off: str) -> list[str]:
    """Flags ECHO's coordinator was never run under: each changes how the decode step is
    captured or split, which the coordinator's resolve relies on (one batch at a time
    writes the static top-k table; sglang's own decode CUDA graphs capture the resolve)."""
    untested = "untested with ECHO's coordinator"
    problems = []
    if get("enable_torch_compile"):
        problems.append(
            f"--enable-torch-compile: {untested} (torch.compile traces the decode forward, "
            "ECHO's resolve included, and captures it in its own graphs, not the decode CUDA "
            f"graphs the coordinator's graph-capture assumptions were checked under); {off}."
        )
    if get("enable_two_batch_overlap"):
        problems.append(
            f"--enable-two-batch-overlap: {untested} (two micro-batches of one step would "
            "resolve into the same static top-k table and per-layer ECHO cache, which the "
            f"coordinator assumes one batch at a time owns: overlap assumptions); {off}."
        )
    if get("debug_cuda_graph"):
        problems.append(
            f"--debug-cuda-graph: {untested} (it switches the CUDA graphs to sglang's "
            "breakable debug backend, whose graph breaks the coordinator's graph-capture "
            f"assumptions were not checked under); {off} (to debug eagerly, "
            "--disable-cuda-graph is supported)."
        )
    return problems


def backend_problems(kv_cache_dtype: str | None, decode_backend: str | None) -> list[str]:
    """KV dtype and decode backend: HiSparse's CUDA pairs (FlashMLA reads ECHO's rows)."""
    dtype = kv_cache_dtype or "auto"
    if dtype == "bf16":
        dtype = "bfloat16"
    if dtype not in ("auto", *DECODE_BACKENDS):
        return [f"--kv-cache-dtype {kv_cache_dtype}: ECHO supports bfloat16 or fp8_e4m3."]
    allowed = DECODE_BACKENDS.get(dtype, sum(DECODE_BACKENDS.values(), ()))
    if decode_backend is not None and decode_backend not in allowed:
        return [
            f"--dsa-decode-backend {decode_backend}: ECHO's decode reads its rows with "
            f"{' or '.join(allowed)} (kv cache {dtype}); use one of them or omit the flag."
        ]
    return []


def attention_dp_size(view: Any) -> int:
    """Attention-DP ranks: ``attn_dp_size``, or the deprecated ``--dp-size N
    --enable-dp-attention`` spelling before sglang's first step translates it."""
    attn_dp = int(getattr(view, "attn_dp_size", 1) or 1)
    if attn_dp == 1 and getattr(view, "enable_dp_attention", False):
        attn_dp = int(getattr(view, "dp_size", 1) or 1)
    return attn_dp


def plan_echo(
    view: Any,
    config: EchoConfig,
    *,
    top_k: int,
    context_len: int | None,
) -> EchoPlan:
    """The sizes ECHO needs, or a ConfigError listing every incompatible flag."""
    problems = incompatible_flags(view)
    host_tokens = getattr(view, "max_total_tokens", None)
    if host_tokens is None:
        problems.append(
            f"--max-total-tokens is required with {ENV_OFFLOAD}=1: it sets the host pool "
            "(tokens kept in pinned host memory), e.g. --max-total-tokens 2000000."
        )
    pd_decode = getattr(view, "disaggregation_mode", "null") == "decode"
    prefill_rows = 0
    if not pd_decode:
        if not context_len:
            problems.append(
                "--context-length is needed on a non-disaggregated server (a local prefill "
                "keeps its prompt on the device until the prompt is on the host)."
            )
        else:
            prefill_rows = _ceil(int(context_len), DSA_PAGE_SIZE)
    if problems:
        raise ConfigError(format_problems(problems))

    attn_dp = attention_dp_size(view)
    cap = config.max_running(top_k)  # per attention-DP rank: the capacity rule
    asked = getattr(view, "max_running_requests", None)
    per_rank = cap if asked is None else int(asked) // attn_dp
    if cap < 1:
        problems.append(
            f"{ENV_DEV_CACHE}={config.dev_cache_size} cannot hold one request's "
            f"top-{top_k} selection; set {ENV_DEV_CACHE} >= {top_k}."
        )
    elif not 1 <= per_rank <= cap:
        problems.append(running_problem(int(asked), attn_dp, cap, top_k, config.dev_cache_size))
    if problems:
        raise ConfigError(format_problems(problems))
    sizes = sizing.EchoSizes(
        dev_cache_size=config.dev_cache_size,
        host_tokens=int(host_tokens),
        top_k=top_k,
        prefill_rows=prefill_rows,
        running=None if asked is None else per_rank,
    )
    return EchoPlan(
        dev_cache_size=config.dev_cache_size,
        host_tokens=int(host_tokens),
        top_k=top_k,
        max_running_requests=per_rank * attn_dp,
        prefill_rows=prefill_rows,
        device_rows=sizes.device_rows,
        host_to_device_ratio=sizes.ratio,
        attn_dp_size=attn_dp,
        pd_decode=pd_decode,
        context_len=int(context_len) if context_len else None,
        running_asked=sizes.running,
    )


def running_problem(asked: int, attn_dp: int, cap: int, top_k: int, dev_cache: int) -> str:
    """--max-running-requests outside what each rank's N_G slots can serve."""
    per_rank = asked // attn_dp
    where = "" if attn_dp == 1 else f" on each of the {attn_dp} attention-DP ranks"
    share = "" if attn_dp == 1 else f" ({asked} // {attn_dp} ranks = {per_rank} per rank)"
    low, high = attn_dp, cap * attn_dp + attn_dp - 1
    return (
        f"--max-running-requests {asked}{share}: one decode step{where} selects up to "
        f"{per_rank} x top-k {top_k} = {per_rank * top_k} tokens per layer and all must fit "
        f"the {ENV_DEV_CACHE}={dev_cache} slots; set --max-running-requests between {low} "
        f"and {high}, or {ENV_DEV_CACHE} >= {dev_cache_for(max(per_rank, 1), top_k)}."
    )


def format_problems(problems: list[str]) -> str:
    lines = "\n".join(f"  - {p}" for p in problems)
    return f"{SOURCE} ({ENV_OFFLOAD}=1) cannot run with these settings:\n{lines}"
