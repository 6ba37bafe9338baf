"""ECHO's cache operations in plain torch: append, resolve (look up, protect, evict,
allocate, recall) and release.

These are the reference semantics that the Triton kernels must reproduce bit for bit, so
every choice is deterministic: duplicates are resolved once, misses take free slots from
the top of the stack first and then victims in (priority, slot) order. ``append`` and
``resolve`` use fixed shapes and keep every count on the device: no host synchronisation,
so a decode step can be captured in a CUDA graph. Masked-off lanes write to scratch
entries (slot N_G + 1, host id N_H + 1) instead of being filtered out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sglang_echo.offload.device_cache import ABSENT, FREE, DeviceCache
from sglang_echo.offload.host_pool import HostKVPool

_NEVER = torch.iinfo(torch.int64).max  # victim key of slots that may not be evicted


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
        slots = torch.arange(cache.num_slots + 2, device=self.device)
        self._token_slot = (slots >= 1) & (slots <= cache.num_slots)

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

    # ---------------------------------------------------------------- allocation
    def _allocate(
        self,
        layer: int,
        ids: torch.Tensor,
        need: torch.Tensor,
        evictable: torch.Tensor,
        stamp: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Give each ``need`` lane of ``ids`` a slot; map both ways; stamp its priority.

        Lanes are served in order: the first ``free_count`` from the free stack (top first),
        the rest by evicting ``evictable`` slots, least recently used (then lowest slot)
        first. Returns the slots (scratch for lanes not served) and the evicting lanes.
        """
        c = self.cache
        h2d, d2h, prio = c.host_to_device[layer], c.device_to_host[layer], c.priority[layer]
        lanes = ids.shape[0]
        victim_key = torch.where(evictable, prio, torch.full_like(prio, _NEVER))
        victims = torch.sort(victim_key, stable=True).indices[: min(lanes, victim_key.shape[0])]
        rank = torch.cumsum(need.to(torch.int64), 0) - 1
        free = c.free_count[layer].to(torch.int64)
        from_stack = rank < free
        stack_pos = (free - 1 - rank).clamp(min=0, max=c.num_slots - 1)
        victim_pos = (rank - free).clamp(min=0, max=victims.shape[0] - 1)
        slot = torch.where(
            from_stack, c.free_stack[layer][stack_pos].to(torch.int64), victims[victim_pos]
        )
        slot = torch.where(need, slot, torch.full_like(slot, c.scratch_slot))
        evicting = need & ~from_stack

        scratch_host = torch.full_like(ids, c.scratch_host)
        old_host = d2h[slot].to(torch.int64)
        h2d.scatter_(
            0,
            torch.where(evicting, old_host, scratch_host),
            torch.full_like(slot, ABSENT, dtype=torch.int32),
        )
        h2d.scatter_(0, torch.where(need, ids, scratch_host), slot.to(torch.int32))
        d2h.scatter_(0, slot, torch.where(need, ids, torch.full_like(ids, FREE)).to(torch.int32))
        prio.scatter_(0, slot, stamp.expand(lanes))
        c.free_count[layer] = (free - need.sum()).clamp(min=0).to(torch.int32)
        return slot, evicting

    # -------------------------------------------------------------------- append
    def append(self, layer: int, locs: torch.Tensor, rows: torch.Tensor) -> None:
        """New tokens (host ids not yet resident) -> host rows and fresh device slots."""
        c = self.cache
        self._check_lanes("append", locs.numel())
        self._write_host(layer, locs, rows)
        need = torch.ones_like(locs, dtype=torch.bool)
        occupied = (c.device_to_host[layer] >= 1) & self._token_slot
        stamp = c.clock[layer]
        slot, evicting = self._allocate(layer, locs, need, occupied, stamp)
        c.rows[layer].index_copy_(0, slot, rows.to(c.rows.dtype))
        c.append_evictions[layer] += evicting.sum()

    # ------------------------------------------------------------------- resolve
    def resolve(self, layer: int, locs: torch.Tensor) -> torch.Tensor:
        """Selected host ids [Q, K] (-1 = none) -> device slots [Q, K] (-1 = none).

        Afterwards every selected token is resident and its device row equals its host row.
        """
        c = self.cache
        shape = locs.shape
        flat = locs.reshape(-1)
        lanes = flat.shape[0]
        self._check_lanes("resolve", lanes)
        c.clock[layer] += 1
        stamp = c.clock[layer]

        key = torch.where(flat >= 0, flat, torch.full_like(flat, c.scratch_host))
        ids, order = torch.sort(key, stable=True)
        valid = ids != c.scratch_host
        first = valid & (ids != F.pad(ids[:-1], (1, 0), value=-1))
        slot = c.host_to_device[layer][ids].to(torch.int64)
        hit = first & (slot != ABSENT)
        miss = first & (slot == ABSENT)

        prio = c.priority[layer]
        prio.scatter_(
            0, torch.where(hit, slot, torch.full_like(slot, c.scratch_slot)), stamp.expand(lanes)
        )
        evictable = (c.device_to_host[layer] >= 1) & self._token_slot & (prio < stamp)
        new_slot, evicting = self._allocate(layer, ids, miss, evictable, stamp)
        self._recall(layer, ids, new_slot, miss)

        resolved = torch.where(hit, slot, new_slot)
        lane = torch.arange(lanes, device=flat.device)
        group_first = torch.cummax(torch.where(first, lane, torch.zeros_like(lane)), 0).values
        rows_sorted = torch.where(valid, resolved[group_first], torch.full_like(resolved, -1))
        out = torch.empty_like(rows_sorted).scatter_(0, order, rows_sorted)

        n_miss = miss.sum()
        c.hits[layer] += hit.sum()
        c.misses[layer] += n_miss
        c.evictions[layer] += evicting.sum()
        c.recalled_rows[layer] += n_miss
        return out.view(shape)

    def _recall(
        self, layer: int, ids: torch.Tensor, slots: torch.Tensor, miss: torch.Tensor
    ) -> None:
        c = self.cache
        if self.use_kernels:
            # Compact the misses to the front; the kernel copies the first ``count`` lanes.
            lanes = ids.shape[0]
            dest = torch.where(miss, torch.cumsum(miss.to(torch.int64), 0) - 1, lanes)
            miss_ids = torch.zeros(lanes + 1, dtype=torch.int64, device=ids.device)
            miss_slots = torch.zeros_like(miss_ids)
            miss_ids.scatter_(0, dest, ids)
            miss_slots.scatter_(0, dest, slots)
            count = miss.sum().view(1)
            from sglang_echo.kernels.recall import recall_rows  # triton only where used

            recall_rows(self.host_view[layer], c.rows[layer], miss_ids, miss_slots, count)
            return
        fetch = torch.where(miss, ids, torch.full_like(ids, c.scratch_host))
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
