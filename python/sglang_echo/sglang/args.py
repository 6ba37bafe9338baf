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

At the late resolution step (``check_resolved``) the plan is also sized against the
GPU and the host (``sizing.py``: every byte per rank, sglang's static-fraction rule less
an estimated start-up overhead, the weights from the checkpoint's index or config.json),
and a plan that does not fit fails there, naming each total and the values that fit.
Each scheduler sizes it again, exactly, against what sglang measured (``measured_sizing``,
called by ``guards.profile_guard`` before sglang builds its pools).

Plain Python: reads an attribute view of the arguments (SGLang's resolving view, or any
namespace in tests) and returns declarations; ``install`` wires it into SGLang. Only the
sizing's inputs import sglang (lazily: its memory queries, model config, memory rule).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import logging
import os
from dataclasses import dataclass
from typing import Any

from sglang_echo.config import (
    ENV_DEV_CACHE,
    ENV_OFFLOAD,
    ConfigError,
    EchoConfig,
    decode_prefetch_mode,
    dev_cache_for,
    max_running,
    settings,
)
from sglang_echo.sglang import sizing

logger = logging.getLogger(__name__)

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
KV_DTYPES = ("auto", "bf16", "bfloat16", "fp8_e4m3")
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


def check_resolved(view: Any, plan: EchoPlan) -> list[str]:
    """After SGLang's own defaults: what the plan needs must still hold, and its pools
    must fit the GPU and the host (``memory_problems``)."""
    problems = incompatible_flags(_WithoutOwnConfig(view))
    for name, want in plan.declarations().items():
        got = getattr(view, name, None)
        if got != want:
            problems.append(
                f"{name} resolved to {got!r} but ECHO needs {want!r}; a flag or model "
                "default changed it after sglang-echo set it."
            )
    return problems + memory_problems(view, plan)


def memory_problems(view: Any, plan: EchoPlan) -> list[str]:
    """Start or say why: the plan's bytes on the GPU and the host against what sglang will
    have (sizing.py), at the late resolution step, where --mem-fraction-static is known.
    The totals are logged when they fit; a view that cannot tell the GPU's memory, the
    weights or the model (a CPU device, a test namespace) is logged and not checked."""
    inputs = sizing_inputs(view, plan)
    if isinstance(inputs, str):
        log = logger.info if getattr(view, "device", None) in (None, "cpu") else logger.warning
        log("%s: start-up sizing not checked: %s", SOURCE, inputs)
        return []
    result = sizing.check(plan.sizes(), *inputs)
    if result.fits:
        logger.info("%s: ECHO's pools fit:\n%s", SOURCE, result.summary())
        return []
    if not result.fits_device:  # sglang's default fraction moves with the decode graphs
        result = sizing.check(plan.sizes(), *inputs, graph_fractions(_record_of(view)))
    return [result.message()]


def sizing_inputs(view: Any, plan: EchoPlan) -> tuple[sizing.RankShape, sizing.Budget] | str:
    """The model's shape and the budget from sglang's resolved view (lazy sglang imports:
    its device-memory query, host-memory rule and model config), or why there are none."""
    device = getattr(view, "device", None)
    if device in (None, "cpu"):
        return "the KV pools are not on a GPU (--device cpu)"
    fraction = getattr(view, "mem_fraction_static", None)
    if not fraction:
        return "--mem-fraction-static is not resolved"
    try:
        from sglang.srt.arg_groups.overrides import model_config_of
        from sglang.srt.utils import common

        model_config = model_config_of(view)
        gpu_mib = common.get_device_memory_capacity(device)
        hf_config = model_config.hf_config
        config = _as_dict(getattr(model_config, "hf_text_config", None) or hf_config)
        quant = _as_dict(
            getattr(hf_config, "quantization_config", None) or config.get("quantization_config")
        )
    except Exception as exc:  # a namespace, not sglang's view; sglang's own errors
        return f"sglang cannot tell the model or the GPU ({type(exc).__name__}: {exc})"
    if not gpu_mib:
        return f"sglang cannot tell the memory of device {device!r}"
    if quant:
        config["quantization_config"] = quant
    parallel = sizing.Parallel(
        tp_size=int(getattr(view, "tp_size", 1) or 1),
        attn_dp_size=plan.attn_dp_size,
        nnodes=int(getattr(view, "nnodes", 1) or 1),
        enable_dp_lm_head=bool(getattr(view, "enable_dp_lm_head", False)),
        moe_dense_tp_size=getattr(view, "moe_dense_tp_size", None),
    )
    try:
        weights = weights_of(
            getattr(view, "model_path", None),
            config,
            parallel,
            getattr(view, "quantization", None),
        )
        shape = rank_shape(
            config,
            fp8=kv_is_fp8(view, quant),
            context_len=int(plan.context_len or model_config.context_len),
            extra_slots=(
                int(getattr(view, "disaggregation_decode_extra_slots", 0) or 0)
                if plan.pd_decode
                else 0
            ),
        )
    except (sizing.UnknownWeights, KeyError, TypeError, ValueError) as exc:
        return f"the weights' bytes are unknown ({exc})"
    budget = sizing.Budget(
        gpu_memory=int(gpu_mib * 2**20),
        mem_fraction_static=float(fraction),
        weights=weights,
        ranks_per_node=parallel.ranks_per_node,
        host_available=host_available_bytes(),
        host_reserve=host_reserve_bytes(),
    )
    return shape, budget


def rank_shape(config: dict, *, fp8: bool, context_len: int, extra_slots: int) -> sizing.RankShape:
    """What the bytes depend on besides the plan: the model's config, the KV dtype, the
    context, PD pre-allocation slots, and ECHO's settings (eviction reserve, prefetch)."""
    return sizing.RankShape(
        layers=int(config["num_hidden_layers"]),
        row_bytes=sizing.kv_row_bytes(config, fp8),
        index_row_bytes=sizing.index_row_bytes(config),
        context_len=context_len,
        extra_req_slots=extra_slots,
        eviction_reserve=settings().eviction_reserve,
        decode_prefetch=decode_prefetch_mode(settings().fuse_decode) == "1",
    )


def weights_of(
    model_path: str | None, config: dict, parallel: sizing.Parallel, quantization: str | None
) -> sizing.WeightBytes:
    """One GPU's share of the weights: the checkpoint's own bytes when ``model_path`` is a
    folder with ``model.safetensors.index.json`` and loads as stored
    (``sizing.checkpoint_weight_bytes``), else config.json's estimate (a hub name not yet
    downloaded; online quantization, ``--quantization`` over an unquantized checkpoint,
    where the loaded bytes are not the stored ones)."""
    online = bool(quantization) and not config.get("quantization_config")
    if model_path and not online and os.path.isdir(model_path):
        try:
            found = sizing.checkpoint_weight_bytes(model_path, config, parallel)
        except sizing.UnknownWeights as exc:
            logger.warning("%s: %s; estimating the weights from config.json", SOURCE, exc)
            found = None
        if found is not None:
            return found
    return sizing.weight_bytes(config, parallel, quantization)


def _record_of(view: Any) -> Any:
    """The server-args record behind sglang's resolving view (None for other views)."""
    try:
        return object.__getattribute__(view, "_server_args")
    except AttributeError:
        return None


def graph_fractions(record: Any) -> sizing.Graphs | None:
    """sglang's default --mem-fraction-static as a function of the decode graphs' max
    batch: its own rule (``handle_gpu_memory_settings``, which reserves memory per captured
    decode batch) run on a shallow copy of the resolved record whose only new declarations
    are that batch and an unset fraction; the record itself is not touched. None where the
    user set the fraction (the graphs do not move it), where the launch's fraction is not
    that rule's at its own batch, or where sglang cannot be probed. A probe that fails at
    some other batch answers the launch's fraction (no gain)."""
    declared = getattr(record, "_resolved_overrides", None)
    if record is None or declared is None:
        return None
    if getattr(record, "mem_fraction_static", None) is not None:
        return None  # the record's own field is the user's flag (declarations are apart)
    try:
        from sglang.srt.arg_groups import memory_hook
        from sglang.srt.arg_groups.overrides import resolving_view

        view = resolving_view(record)
        fraction = float(view.mem_fraction_static)
        graphs = view.cuda_graph_config
        max_bs = int(graphs.decode.max_bs)
    except Exception:  # an older or newer sglang: no probe, no graph advice
        return None

    def probe(bs: int) -> float:
        copied = copy.copy(record)
        config = copy.deepcopy(graphs)
        config.decode.max_bs, config.decode.bs = bs, None
        copied._resolved_overrides = [
            *declared,
            (f"{SOURCE} sizing probe", {"mem_fraction_static": None, "cuda_graph_config": config}),
        ]
        memory_hook.handle_gpu_memory_settings(copied)
        return float(resolving_view(copied).mem_fraction_static)

    try:
        if probe(max_bs) != fraction:
            return None
    except Exception:
        return None

    @functools.cache
    def fraction_at(bs: int) -> float:
        try:
            return probe(bs)
        except Exception:
            return fraction

    return sizing.Graphs(max_bs=max_bs, fraction_at=fraction_at)


def measured_sizing(
    configurator: Any, pre_model_load_memory: float, kv_bytes: int
) -> sizing.Sizing | None:
    """ECHO's plan against what sglang measured in this scheduler (``guards.profile_guard``,
    after ``KVCacheConfigurator._profile_available_bytes`` returned ``kv_bytes`` from
    ``pre_model_load_memory`` GiB free before loading): the plan from the resolved
    hisparse_config (N_G, T, S, top-k) and max_running_requests, the shape from the
    configurator's model and KV dtype. None where the record holds no ECHO plan."""
    from sglang.srt.mem_cache.sparsity import parse_hisparse_config
    from sglang.srt.runtime_context import get_disagg, get_schedule

    hisparse = parse_hisparse_config()
    extra = hisparse.sparse_extra_config
    if DEVICE_ROWS_KEY not in extra or HOST_TOKENS_KEY not in extra:
        return None
    n_g, rows = int(extra[ECHO_EXTRA_KEY]), int(extra[DEVICE_ROWS_KEY])
    top_k = int(hisparse.top_k)
    per_rank = int(get_schedule().max_running_requests) // max(1, int(configurator.attn_dp_size))
    # S = ceil64(N_G + 1) + 64 x running + prompt rows (plan_echo): the rest is prompt rows.
    prefill = rows - _ceil(n_g + 1, DSA_PAGE_SIZE) - DSA_PAGE_SIZE * per_rank
    if prefill < 0 or per_rank < 1:
        return None  # not the plan's shape: the coordinator's capacity guard reports it
    sizes = sizing.EchoSizes(
        dev_cache_size=n_g,
        host_tokens=int(extra[HOST_TOKENS_KEY]),
        top_k=top_k,
        prefill_rows=prefill,
        running=None if per_rank == max_running(n_g, top_k) else per_rank,  # default, or asked
    )
    model_config = configurator.model_config
    config = _as_dict(getattr(model_config, "hf_text_config", None) or model_config.hf_config)
    disagg = get_disagg()
    shape = rank_shape(
        config,
        fp8="float8" in str(configurator.kv_cache_dtype),
        context_len=int(model_config.context_len),
        extra_slots=(
            int(disagg.disaggregation_decode_extra_slots or 0)
            if disagg.disaggregation_mode == "decode"
            else 0
        ),
    )
    budget = sizing.MeasuredBudget.measured(
        free_before_load=int(pre_model_load_memory * sizing.GiB),
        kv_bytes=int(kv_bytes),
        fraction=float(get_schedule().mem_fraction_static),
        gpu_memory=_gpu_bytes(configurator.device),
    )
    budget = dataclasses.replace(budget, ranks_per_node=_ranks_per_node(configurator.server_args))
    result = sizing.check(sizes, shape, budget)
    if not result.fits_device:
        result = sizing.check(sizes, shape, budget, graph_fractions(configurator.server_args))
    return result


def _ranks_per_node(record: Any) -> int:
    """GPUs of a node, each with its own pinned pool (for the message's host total)."""
    try:
        from sglang.srt.arg_groups.overrides import resolving_view

        view = resolving_view(record)
        return sizing.Parallel(tp_size=int(view.tp_size), nnodes=int(view.nnodes)).ranks_per_node
    except Exception:
        return 1


def _gpu_bytes(device: str) -> int | None:
    """The device's capacity as sglang reads it (for the message only)."""
    try:
        from sglang.srt.utils import common

        mib = common.get_device_memory_capacity(device)
    except Exception:
        return None
    return int(mib * 2**20) if mib else None


def _as_dict(value: Any) -> dict:
    """A config (transformers' object, a quantization config object or a dict) as a dict."""
    if value is None:
        return {}
    if hasattr(value, "to_dict"):
        return dict(value.to_dict())
    return dict(value)


def kv_is_fp8(view: Any, quant: Any) -> bool:
    """fp8_e4m3 rows (656 B) or bf16 (1152 B): "auto" is the model's dtype unless the
    checkpoint quantizes its KV cache (sglang's configure_kv_cache_dtype)."""
    dtype = getattr(view, "kv_cache_dtype", "auto") or "auto"
    if dtype == "auto":
        algo = _as_dict(quant).get("kv_cache_quant_algo")
        return isinstance(algo, str) and algo.upper() == "FP8"
    return dtype == "fp8_e4m3"


def host_available_bytes() -> int | None:
    """The node's available memory as sglang's host pools check it (psutil's available,
    capped by the cgroup's headroom); None when sglang cannot tell."""
    try:
        from sglang.srt.mem_cache import host_memory

        return int(host_memory.available_host_memory_bytes(allow_cgroup_fallback=True))
    except Exception:  # no psutil, unreadable cgroup: the host is not checked
        return None


def host_reserve_bytes() -> int:
    """sglang's reserve of host memory that its host pools leave free."""
    try:
        from sglang.srt.mem_cache.pool_host import base

        return int(base.HICACHE_HOST_MEMORY_RESERVE_BYTES)
    except Exception:
        return sizing.HOST_RESERVE


class _WithoutOwnConfig:
    """A view whose hisparse_config reads unset (the plan wrote it, the user did not)."""

    def __init__(self, view: Any) -> None:
        self._view = view

    def __getattr__(self, name: str) -> Any:
        if name == "hisparse_config":
            return None
        return getattr(self._view, name)


def format_problems(problems: list[str]) -> str:
    lines = "\n".join(f"  - {p}" for p in problems)
    return f"{SOURCE} ({ENV_OFFLOAD}=1) cannot run with these settings:\n{lines}"
