"""ECHO's cache operations: append, resolve (look up, protect, evict, allocate, recall)
and release.

Allocation semantics live in kernels/alloc.py (bucketed-LRU victims, misses served in lane
order, duplicates allocated once): its Triton kernels on CUDA, its torch reference on the
CPU, bit-identical to each other. ``append`` and ``resolve`` use fixed shapes and keep
every count on the device: no host synchronisation, so a decode step can be captured in a
CUDA graph. Masked-off lanes write to scratch entries (slot N_G + 1, host id N_H + 1).
"""

from __future__ import annotations

import torch

from sglang_echo.kernels.alloc import (
    Allocation,
    AllocWorkspace,
    allocate_kernel,
    allocate_reference,
)
from sglang_echo.offload.device_cache import ABSENT, FREE, DeviceCache
from sglang_echo.offload.host_pool import HostKVPool


class EchoManager:
    def __init__(
        self, host: HostKVPool, cache: DeviceCache, use_kernels: bool | None = None
    ) -> None:
        if host.num_tokens != cache.host_tokens or host.num_layers != cache.num_layers:
            raise ValueError("host pool and device cache disagree on tokens or layers")
        self.host = host
        self.cache = cache
        self.device = cache.device
        # Kernels on the cache's device read/write host rows through this view; None means
        # host-side copies (correct, but they synchronise and cannot be graph-captured).
        self.host_view = host.view_for(self.device)
        # On CUDA the Triton recall kernel moves the rows; the torch path is the reference.
        self.use_kernels = (
            use_kernels if use_kernels is not None else self.device.type == "cuda"
        ) and self.host_view is not None
        self._workspace: AllocWorkspace | None = None

    @property
    def graph_safe(self) -> bool:
        return self.host_view is not None

    # ------------------------------------------------------------------ host I/O
    def _write_host(self, layer: int, locs: torch.Tensor, rows: torch.Tensor) -> None:
        if self.host_view is not None:
            self.host_view[layer].index_copy_(0, locs, rows.to(self.host_view.dtype))
        else:
            self.host.rows[layer].index_copy_(0, locs.cpu(), rows.to("cpu", self.host.rows.dtype))

    def _read_host(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        if self.host_view is not None:
            return self.host_view[layer].index_select(0, ids)
        return self.host.rows[layer].index_select(0, ids.cpu()).to(self.device)

    def _check_lanes(self, op: str, lanes: int) -> None:
        """Shape-only guard (no device read): more lanes than slots could need more
        victims than exist. EchoConfig.validate makes this unreachable from the runtime."""
        if lanes > self.cache.num_slots:
            raise ValueError(
                f"ECHO {op} of {lanes} tokens exceeds the {self.cache.num_slots}-slot device "
                "cache; split it (chunked prefill) or raise NSA_DEV_CACHE_SIZE"
            )

    # ------------------------------------------------------------------ allocation
    def _allocate(self, layer: int, ids: torch.Tensor, append: bool) -> Allocation:
        """Look up, protect, evict, allocate and map (kernels/alloc.py): the Triton kernels
        on CUDA, their torch reference elsewhere; both leave bit-identical state."""
        if not self.use_kernels:
            return allocate_reference(self.cache, layer, ids, append)
        if self._workspace is None:
            self._workspace = AllocWorkspace(self.cache, max_lanes=self.cache.num_slots)
        return allocate_kernel(self.cache, layer, ids, append, self._workspace)

    # -------------------------------------------------------------------- append
    def append(self, layer: int, locs: torch.Tensor, rows: torch.Tensor) -> None:
        """New tokens (host ids not yet resident) -> host rows and fresh device slots."""
        c = self.cache
        self._check_lanes("append", locs.numel())
        self._write_host(layer, locs, rows)
        alloc = self._allocate(layer, locs.reshape(-1).to(torch.int64), append=True)
        c.rows[layer].index_copy_(0, alloc.slots, rows.to(c.rows.dtype))

    # ------------------------------------------------------------------- resolve
    def resolve(self, layer: int, locs: torch.Tensor) -> torch.Tensor:
        """Selected host ids [Q, K] (-1 = none) -> device slots [Q, K] (-1 = none).

        Afterwards every selected token is resident and its device row equals its host row.
        """
        self._check_lanes("resolve", locs.numel())
        alloc = self._allocate(layer, locs.reshape(-1).to(torch.int64), append=False)
        self._recall(layer, alloc)
        return alloc.slots.view(locs.shape)

    def _recall(self, layer: int, alloc: Allocation) -> None:
        """Copy the rows of the served misses (the first ``miss_count`` of the list)."""
        c = self.cache
        if self.use_kernels:
            from sglang_echo.kernels.recall import recall_rows  # triton only where used

            recall_rows(
                self.host_view[layer], c.rows[layer], alloc.miss_ids, alloc.miss_slots,
                alloc.miss_count,
            )  # fmt: skip
            return
        live = torch.arange(alloc.miss_ids.shape[0], device=self.device) < alloc.miss_count
        fetch = torch.where(live, alloc.miss_ids, c.scratch_host)
        slots = torch.where(live, alloc.miss_slots, c.scratch_slot)
        c.rows[layer].index_copy_(0, slots, self._read_host(layer, fetch).to(c.rows.dtype))

    # ------------------------------------------------------------------- release
    def release(self, locs: torch.Tensor) -> None:
        """Host ids being freed: unmap them in every layer and push their slots back."""
        c = self.cache
        for layer in range(c.num_layers):
            slot = c.host_to_device[layer][locs].to(torch.int64)
            resident = slot != ABSENT
            rank = torch.cumsum(resident.to(torch.int64), 0) - 1
            free = c.free_count[layer].to(torch.int64)
            push_pos = torch.where(resident, free + rank, torch.full_like(rank, c.num_slots))
            c.free_stack[layer].scatter_(
                0, push_pos, torch.where(resident, slot, 0).to(torch.int32)
            )
            target = torch.where(resident, slot, torch.full_like(slot, c.scratch_slot))
            c.device_to_host[layer].scatter_(
                0, target, torch.full_like(target, FREE, dtype=torch.int32)
            )
            c.priority[layer].scatter_(0, target, torch.full_like(target, FREE))
            c.host_to_device[layer].index_fill_(0, locs, ABSENT)
            c.free_count[layer] = (free + resident.sum()).to(torch.int32)
