"""The start-up that both composition roots share: ``generate.run`` (offline) and
``runtime/serving.build_serving`` (the server).

Both turn the same flags into the same engine parts: a device, a dtype, the process's
settings parsed once, the ECHO configuration and the kernel choices handed down from
them, a context length the model can take, a KV dtype its widths can store, and the KV
backend. Each of those rules is written once here, so the offline CLI and the server
cannot drift apart (what one refuses, the other refuses with the same words).

The entry points report refusals as their own error types (generate's ``InputError``,
the server's ``ServerArgError``), so every check takes the class to raise as ``error``;
the message is the same from both.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from sglang_echo.config import ENV_BATCH_INVARIANT, EchoConfig, EchoSettings, load_settings
from sglang_echo.model.attention import ModelKernels
from sglang_echo.model.config import DeepseekV32Config
from sglang_echo.model.deepseek_v32 import DeepseekV32ForCausalLM
from sglang_echo.model.kv_cache import KVCache
from sglang_echo.model.layers import set_batch_invariant
from sglang_echo.model.loader import load_nextn, model_dtype
from sglang_echo.model.nextn import NextNLayer
from sglang_echo.runtime.kv_factory import build_hisparse_cache, build_kv_cache

ErrorType = type[ValueError]


@dataclass(frozen=True)
class StartUp:
    """What a start-up resolves before the model is loaded: where it runs, in which dtype,
    and the settings (with what is derived from them) that every part below gets handed."""

    device: torch.device
    dtype_name: str  # as resolved ("auto" already replaced): reported by both entry points
    dtype: torch.dtype
    settings: EchoSettings
    echo: EchoConfig
    kernels: ModelKernels

    def cuda_graphs(self, disabled: bool) -> bool:
        """Decode steps replay CUDA graphs on CUDA unless ``--disable-cuda-graph``."""
        return self.device.type == "cuda" and not disabled


def load_draft(model_path: str, start: StartUp, target: DeepseekV32ForCausalLM) -> NextNLayer:
    """The checkpoint's MTP (NextN) layer on the start-up's device and dtype, with the
    target's kernel choices (batch-invariant GEMMs too, so its drafts round as the
    target's do)."""
    draft = load_nextn(model_path, start.device, start.dtype, target=target)
    set_batch_invariant(draft, start.kernels.batch_invariant)
    return draft


def resolve_device(name: str, error: ErrorType = ValueError) -> torch.device:
    """``--device``: ``auto`` is CUDA when there is one, else the CPU; an explicit ``cuda``
    without a device is refused here rather than failing later inside torch."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise error("--device cuda was given but no CUDA device is available")
    return torch.device(name)


def resolve_dtype_name(name: str, device: torch.device) -> str:
    """``--dtype auto`` (the server's default): bfloat16 on CUDA, float32 on the CPU; the
    resolved name is what both entry points report."""
    if name != "auto":
        return name
    return "bfloat16" if device.type == "cuda" else "float32"


def resolve_start_up(
    device_name: str,
    dtype_name: str,
    echo: EchoConfig | None = None,
    error: ErrorType = ValueError,
) -> StartUp:
    """Device, dtype, and every environment variable parsed once (env_settings.py's
    registry): the model and the caches get their kernel switches from these settings,
    handed down. ``echo`` overrides the environment's ECHO settings (tests build both
    kinds of backend in one process)."""
    device = resolve_device(device_name, error)
    dtype_name = resolve_dtype_name(dtype_name, device)
    dtype = model_dtype(dtype_name)
    settings = load_settings()
    echo = echo if echo is not None else EchoConfig.from_settings(settings)
    kernels = ModelKernels.from_settings(settings)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if kernels.batch_invariant and device.type != "cuda" and not interpreted:
        # refused here, not by the first decode step's GEMM (a served request would fail)
        raise error(
            f"{ENV_BATCH_INVARIANT}=1 runs every matmul through a Triton kernel: it needs a "
            f"CUDA device (here {device}), or TRITON_INTERPRET=1 on the CPU (slow; for "
            f"tests); unset {ENV_BATCH_INVARIANT} to use torch's GEMMs"
        )
    return StartUp(device, dtype_name, dtype, settings, echo, kernels)


def check_context(cfg: DeepseekV32Config, asked: int | None, error: ErrorType = ValueError) -> int:
    """The context length served: ``--context-length`` as asked, else the model's
    ``max_position_embeddings``, the longest the model was configured for, so a larger
    value is refused before any request table or pool is sized from it."""
    context = asked or cfg.max_position_embeddings
    if context > cfg.max_position_embeddings:
        raise error(
            f"--context-length {context} exceeds the model's max_position_embeddings "
            f"({cfg.max_position_embeddings}); lower it"
        )
    return context


def check_kv_dtype(
    cfg: DeepseekV32Config,
    dtype: torch.dtype,
    kv_cache_dtype: str,
    error: ErrorType = ValueError,
) -> None:
    """A ``--kv-cache-dtype`` the model's widths cannot take, refused before anything is
    sized or built (``kernels/fp8_kv.kv_storage`` says why)."""
    try:
        cfg.kv_storage(dtype, kv_cache_dtype)
    except ValueError as exc:
        raise error(str(exc)) from None


def build_kv_backend(
    start: StartUp,
    cfg: DeepseekV32Config,
    capacity: int,
    max_running: int,
    chunk: int,
    kv_cache_dtype: str,
    hisparse_buffer: int | None = None,
) -> KVCache:
    """The KV backend the settings and flags ask for: the plain pool or ECHO
    (``NSA_KV_OFFLOAD``), or HiSparse when the server gives a device buffer size; its
    kernel switch (``SGLANG_ECHO_PDL``) comes from this start-up's settings."""
    if hisparse_buffer is None:
        return build_kv_cache(
            start.echo, cfg, capacity, max_running, chunk, start.dtype, start.device, kv_cache_dtype
        )
    return build_hisparse_cache(
        start.echo,
        cfg,
        capacity,
        max_running,
        hisparse_buffer,
        start.dtype,
        start.device,
        kv_cache_dtype,
        pdl=start.settings.pdl,
    )
