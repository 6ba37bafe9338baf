"""The late resolution step's check (``check_resolved``, after sglang's own defaults) and
ECHO's start-up sizing glue: the inputs ``sizing.py`` needs, gathered from sglang.

At the late resolution step the plan must still hold (the declarations ``args.plan_echo``
made) and is sized against the GPU and the host (``sizing.py``: every byte per rank,
``sizing_budget.py``: sglang's static-fraction rule less an estimated start-up overhead,
``sizing_weights.py``: the weights from the checkpoint's index or config.json); a plan that does
not fit fails there, naming each total and the values that fit. Each scheduler sizes it
again, exactly, against what sglang measured (``measured_sizing``, called by
``guards.profile_guard`` before sglang builds its pools).

Apart from ``args.py`` (flag planning, no sglang import) because this is where sglang is
read: its memory queries, model config and memory rule, each imported lazily.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import os
from typing import Any

from sglang_echo.config import decode_prefetch_mode, max_running, settings
from sglang_echo.sglang import sizing
from sglang_echo.sglang.args import (
    DEVICE_ROWS_KEY,
    DSA_PAGE_SIZE,
    ECHO_EXTRA_KEY,
    HOST_TOKENS_KEY,
    SOURCE,
    EchoPlan,
    incompatible_flags,
)
from sglang_echo.sglang.sizing_budget import HOST_RESERVE, Budget, Graphs, MeasuredBudget
from sglang_echo.sglang.sizing_weights import (
    GiB,
    Parallel,
    UnknownWeights,
    WeightBytes,
    checkpoint_weight_bytes,
    weight_bytes,
)

logger = logging.getLogger(__name__)


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


def sizing_inputs(view: Any, plan: EchoPlan) -> tuple[sizing.RankShape, Budget] | str:
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
    parallel = Parallel(
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
    except (UnknownWeights, KeyError, TypeError, ValueError) as exc:
        return f"the weights' bytes are unknown ({exc})"
    budget = Budget(
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
    model_path: str | None, config: dict, parallel: Parallel, quantization: str | None
) -> WeightBytes:
    """One GPU's share of the weights: the checkpoint's own bytes when ``model_path`` is a
    folder with ``model.safetensors.index.json`` and loads as stored
    (``checkpoint_weight_bytes``), else config.json's estimate (a hub name not yet
    downloaded; online quantization, ``--quantization`` over an unquantized checkpoint,
    where the loaded bytes are not the stored ones)."""
    online = bool(quantization) and not config.get("quantization_config")
    if model_path and not online and os.path.isdir(model_path):
        try:
            found = checkpoint_weight_bytes(model_path, config, parallel)
        except UnknownWeights as exc:
            logger.warning("%s: %s; estimating the weights from config.json", SOURCE, exc)
            found = None
        if found is not None:
            return found
    return weight_bytes(config, parallel, quantization)


def _record_of(view: Any) -> Any:
    """The server-args record behind sglang's resolving view (None for other views)."""
    try:
        return object.__getattribute__(view, "_server_args")
    except AttributeError:
        return None


def graph_fractions(record: Any) -> Graphs | None:
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

    return Graphs(max_bs=max_bs, fraction_at=fraction_at)


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
    prefill = rows - sizing.ceil_to(n_g + 1, DSA_PAGE_SIZE) - DSA_PAGE_SIZE * per_rank
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
    budget = MeasuredBudget.measured(
        free_before_load=int(pre_model_load_memory * GiB),
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
        return Parallel(tp_size=int(view.tp_size), nnodes=int(view.nnodes)).ranks_per_node
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
        return HOST_RESERVE


class _WithoutOwnConfig:
    """A view whose hisparse_config reads unset (the plan wrote it, the user did not)."""

    def __init__(self, view: Any) -> None:
        self._view = view

    def __getattr__(self, name: str) -> Any:
        if name == "hisparse_config":
            return None
        return getattr(self._view, name)
