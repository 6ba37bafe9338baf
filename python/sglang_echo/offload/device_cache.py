"""Per-layer bounded device cache of MLA rows and its fixed-size metadata.

Allocated once. Slot 0 is the padding sink (mapped to host row 0, never evicted); slots
1..N_G hold tokens; slot N_G + 1 is a scratch slot that masked writes land in. Likewise
host id N_H + 1 is a scratch entry of ``host_to_device``. All counters are device tensors,
so no operation needs to read them on the host.
"""

from __future__ import annotations

import torch

from sglang_echo.kernels.cache_layout import ABSENT, FREE
from sglang_echo.offload.footprint import device_cache_bytes

__all__ = ["ABSENT", "FREE", "DeviceCache"]


class DeviceCache:
    # Its bytes from sizes alone, for sizing before it exists (offload/footprint.py).
    bytes_for = staticmethod(device_cache_bytes)

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        host_tokens: int,
        row_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        eviction_reserve: int = 0,
    ) -> None:
        if not 0 <= eviction_reserve <= num_slots:
            raise ValueError(
                f"eviction_reserve must be in [0, {num_slots}] (the slots), got {eviction_reserve}"
            )
        self.num_layers = num_layers
        self.num_slots = num_slots  # N_G
        self.eviction_reserve = eviction_reserve
        self.host_tokens = host_tokens  # N_H
        self.row_dim = row_dim
        self.scratch_slot = num_slots + 1
        self.scratch_host = host_tokens + 1
        dev = torch.device(device)
        i32 = dict(dtype=torch.int32, device=dev)
        i64 = dict(dtype=torch.int64, device=dev)
        self.rows = torch.zeros(num_layers, num_slots + 2, row_dim, dtype=dtype, device=dev)
        self.host_to_device = torch.full((num_layers, host_tokens + 2), ABSENT, **i32)
        self.device_to_host = torch.full((num_layers, num_slots + 2), FREE, **i32)
        # Logical clocks are int64: an int32 clock would wrap after 2^31 resolves of a layer
        # (weeks of serving) and then evict the sink.
        self.priority = torch.full((num_layers, num_slots + 2), FREE, **i64)
        # Free-slot stack: entries [0, free_count) are free slots; the top is popped first.
        # One scratch entry past the end absorbs masked pushes.
        stack = torch.cat((torch.arange(num_slots, 0, -1, **i32), torch.zeros(1, **i32)))
        self.free_stack = stack.repeat(num_layers, 1)
        self.free_count = torch.full((num_layers,), num_slots, **i32)
        self.clock = torch.zeros(num_layers, **i64)
        # Slot 0 <-> host row 0: the sink that padded selections point at.
        self.host_to_device[:, 0] = 0
        self.device_to_host[:, 0] = 0
        self.priority[:, 0] = torch.iinfo(torch.int64).max
        # Telemetry, per layer.
        self.hits = torch.zeros(num_layers, **i64)
        self.misses = torch.zeros(num_layers, **i64)
        self.evictions = torch.zeros(num_layers, **i64)
        self.append_evictions = torch.zeros(num_layers, **i64)
        self.recalled_rows = torch.zeros(num_layers, **i64)

    @property
    def device(self) -> torch.device:
        return self.rows.device

    @property
    def nbytes(self) -> int:
        """Every tensor it allocated (rows, maps, stack, clock, counters)."""
        return sum(t.nbytes for t in vars(self).values() if isinstance(t, torch.Tensor))

    def reset_telemetry(self) -> None:
        for t in (
            self.hits,
            self.misses,
            self.evictions,
            self.append_evictions,
            self.recalled_rows,
        ):
            t.zero_()
