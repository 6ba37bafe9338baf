"""Sentinel values of the device cache's maps, and the shape of the cache state the
kernels work on; shared by the kernels and the cache.

``CacheState`` is a structural type: ``offload.device_cache.DeviceCache`` (and the SGLang
adapter built on it) provides these attributes. The protocol lives here so that
kernels/alloc.py can name what it reads and writes without importing offload/, which
depends on kernels/ (docs/ARCHITECTURE.md section 1).
"""

from __future__ import annotations

from typing import Protocol

import torch

ABSENT = 2**31 - 1  # host_to_device value of a token not on the device (int32 max)
FREE = -1  # device_to_host / priority value of a free slot


class CacheState(Protocol):
    """Per-layer maps, free stack, clock and counters of a device cache (layer = dim 0)."""

    num_slots: int  # N_G; slot 0 is the sink, slot N_G + 1 the scratch slot
    scratch_slot: int
    scratch_host: int  # host id N_H + 1, the scratch entry of host_to_device
    host_to_device: torch.Tensor  # [layers, N_H + 2] int32
    device_to_host: torch.Tensor  # [layers, N_G + 2] int32
    priority: torch.Tensor  # [layers, N_G + 2] int64
    free_stack: torch.Tensor  # [layers, N_G + 1] int32
    free_count: torch.Tensor  # [layers] int32
    # Extra victims taken whenever a step evicts at all, left on the free stack (0: exactly
    # the misses' worth); the slot scans then run once per several steps, not every step.
    eviction_reserve: int
    clock: torch.Tensor  # [layers] int64
    hits: torch.Tensor  # [layers] int64, and the telemetry below likewise
    misses: torch.Tensor
    evictions: torch.Tensor
    append_evictions: torch.Tensor
    recalled_rows: torch.Tensor

    @property
    def device(self) -> torch.device: ...


def byte_rows(rows: torch.Tensor, what: str) -> torch.Tensor:
    """KV rows [rows, row_dim] as bytes: the copy kernels (recall, staging) move rows as
    bytes, so bf16 rows and SGLang's fp8 layout share one kernel."""
    if rows.dim() != 2 or rows.stride(1) != 1:
        raise ValueError(f"{what} expects [rows, row_dim] tensors with contiguous rows")
    return rows.view(torch.uint8)


def byte_vector(row_bytes: int) -> int:
    """The widest power-of-two piece (<= 16 bytes) that divides a row: the copy kernels'
    load and store width."""
    vec = 16
    while row_bytes % vec:
        vec //= 2
    return vec
