"""Pick the KV backend the environment asks for (plain pool or ECHO) and describe it."""

from __future__ import annotations

import torch

from sglang_echo.config import ConfigError, EchoConfig
from sglang_echo.model.config import DeepseekV32Config
from sglang_echo.model.kv_cache import KVCache, PlainKVCache
from sglang_echo.offload.echo_cache import EchoKVCache
from sglang_echo.offload.hisparse_cache import HiSparseKVCache


def echo_cache_for_model(
    echo: EchoConfig,
    model_config: DeepseekV32Config,
    host_tokens: int,
    dtype: torch.dtype,
    device: torch.device | str,
    kv_cache_dtype: str = "auto",
    **kwargs,
) -> EchoKVCache:
    """ECHO sized for the model: row widths and index-key dtype from its indexer mode, KV
    rows as ``--kv-cache-dtype`` stores them (kernels/fp8_kv.py)."""
    cfg = model_config
    width, stored = cfg.kv_storage(dtype, kv_cache_dtype)
    return EchoKVCache(
        echo,
        cfg.num_hidden_layers,
        host_tokens,
        width,
        cfg.index_row_dim,
        stored,
        device,
        index_dtype=cfg.index_row_dtype(dtype),
        kv_lora_rank=cfg.kv_lora_rank,
        **kwargs,
    )


def build_kv_cache(
    echo: EchoConfig,
    model_config: DeepseekV32Config,
    token_capacity: int,
    max_running_requests: int,
    chunked_prefill_size: int,
    dtype: torch.dtype,
    device: torch.device,
    kv_cache_dtype: str = "auto",
) -> KVCache:
    if not echo.offload:
        return PlainKVCache.for_model(model_config, token_capacity, dtype, device, kv_cache_dtype)
    echo.validate(
        host_tokens=token_capacity,
        max_running_requests=max_running_requests,
        topk=model_config.index_topk,
        chunk_size=min(chunked_prefill_size, token_capacity),
    )
    return echo_cache_for_model(
        echo, model_config, token_capacity, dtype, device, kv_cache_dtype=kv_cache_dtype
    )


def build_hisparse_cache(
    echo: EchoConfig,
    model_config: DeepseekV32Config,
    host_tokens: int,
    max_running_requests: int,
    buffer_size: int,
    dtype: torch.dtype,
    device: torch.device,
    kv_cache_dtype: str = "auto",
    pdl: bool = True,
) -> HiSparseKVCache:
    """The HiSparse-like backend; each request's buffer must hold one step's top-k.
    ``pdl``: SGLANG_ECHO_PDL, from the caller's settings (the server passes its own)."""
    if echo.offload:
        raise ConfigError(
            "NSA_KV_OFFLOAD=1 and --enable-hisparse pick two different offload policies; keep one"
        )
    topk = model_config.index_topk
    if buffer_size < topk:
        raise ConfigError(
            f"device_buffer_size {buffer_size} is smaller than one step's top-k ({topk}): a "
            f"request's buffer must hold its selections; set it to at least {topk}"
        )
    return HiSparseKVCache.for_model(
        model_config,
        host_tokens,
        max_running_requests,
        buffer_size,
        dtype,
        device,
        kv_cache_dtype=kv_cache_dtype,
        pdl=pdl,
    )


def describe_kv_cache(summary: dict) -> str:
    """Human-readable run summary; ECHO adds a per-layer hit-rate line."""
    kv = summary["kv"]
    lines = [
        f"requests {summary['requests']}  prompt tokens {summary['prompt_tokens']}  "
        f"output tokens {summary['output_tokens']}",
        f"prefill {summary['prefill_s']:.3f}s  decode {summary['decode_s']:.3f}s  "
        f"output {summary['output_tokens_per_s']} tok/s  total {summary['total_tokens_per_s']} tok/s"
        f"  ({summary['device']}, {summary['dtype']}"
        f"{', CUDA graphs' if summary.get('cuda_graph') else ''})",
    ]
    if kv["backend"] == "echo":
        rates = " ".join(f"{r:.3f}" for r in kv["hit_rate"])
        lines.append(
            f"kv: ECHO  host {kv['host_bytes'] / 2**20:.1f} MiB ({kv['host_tokens']} tokens, "
            f"pinned={kv['host_pinned']})  device {kv['device_bytes'] / 2**20:.1f} MiB "
            f"({kv['dev_cache_slots_per_layer']} slots/layer)"
        )
        lines.append(f"kv: hit rate per layer: {rates}")
        lines.append(
            f"kv: evictions {sum(kv['evictions'])}  recalled "
            f"{sum(kv['recalled_bytes']) / 2**20:.2f} MiB"
        )
        if sum(kv.get("prefetched_rows", [])):
            modes = " + ".join(kv.get("prefetch", [])) or "decode"
            # A resolve checks only the latest prefetch of its layer: with several prefill
            # blocks per chunk, the selected count is a lower bound.
            bound = "at least " if "prefill" in modes else ""
            lines.append(
                f"kv: {modes} prefetch {sum(kv['prefetched_rows'])} rows, "
                f"{bound}{sum(kv['prefetch_hits'])} of them then selected"
            )
    else:
        lines.append(f"kv: no-offload  {kv['kv_bytes'] / 2**20:.1f} MiB on {summary['device']}")
    return "\n".join(lines)
