"""Which token locations are free, and which locations hold each request's positions.

Two small jobs kept apart (as SGLang's mem_cache does): ``TokenSlotAllocator`` hands out
token locations of the KV pool (the host pool under ECHO, the GPU pool otherwise), and
``RequestTable`` maps (request row, position) -> token location. Neither holds KV bytes.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch

from sglang_echo.runtime.host_ints import int64_tensor


class CapacityError(RuntimeError):
    """Not enough free token locations or request rows; the caller should queue or fail."""


class TokenSlotAllocator:
    """Locations 1..capacity; 0 is the padding sink and is never handed out.

    Locations are handed out and taken back as ``array('q')`` (C int64 arrays), not Python
    lists. Why: a decode node admits 100K-token prompts, and their locations cross the
    engine thread several times (the table row, the transfer, the release); as arrays each
    crossing is a memcpy and the tensor is a view of the buffer, where a list cost a Python
    loop or an element-by-element conversion each time."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"token capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        # A stack whose top is its end: the most recently freed locations are reused first.
        # ``alloc`` takes the top n as they lie and ``free`` pushes them back as given, so
        # both are one copy: a freed prompt's ascending run comes back ascending, and the
        # first prompts get 1..n ascending (long runs: offload/host_extents.py copies them
        # by copy engine). Reversing them to hand out "the top first" cost a 100K-token
        # admission and its release a pass over every location each, on the engine thread.
        self._free = array("q", range(1, capacity + 1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> array:
        if n > len(self._free):
            raise CapacityError(f"asked for {n} token locations, {len(self._free)} free")
        if n <= 0:
            return array("q")
        taken = self._free[-n:]
        del self._free[-n:]
        return taken

    def free(self, locs: Sequence[int]) -> None:
        same = isinstance(locs, array) and locs.typecode == "q"
        self._free.extend(locs if same else array("q", locs))


class RequestTable:
    """[max_requests, max_context] int64 table on the device, plus free request rows."""

    def __init__(self, max_requests: int, max_context: int, device: torch.device | str) -> None:
        self.max_context = max_context
        self.table = torch.zeros(max_requests, max_context, dtype=torch.int64, device=device)
        self._free_rows = list(range(max_requests - 1, -1, -1))

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def alloc_row(self) -> int:
        if not self._free_rows:
            raise CapacityError("no free request rows")
        return self._free_rows.pop()

    def free_row(self, row: int) -> None:
        self.table[row].zero_()
        self._free_rows.append(row)

    def assign(self, row: int, start: int, locs: list[int] | torch.Tensor) -> None:
        if start + len(locs) > self.max_context:
            raise CapacityError(
                f"request needs {start + len(locs)} positions, table width is {self.max_context}"
            )
        if not isinstance(locs, torch.Tensor):
            locs = int64_tensor(locs)
        self.table[row, start : start + len(locs)] = locs.to(self.table.device)

    def assign_next_on_device(
        self, rows: torch.Tensor, positions: torch.Tensor, locs: torch.Tensor, top: int
    ) -> None:
        """One new position per request, from device tensors (no host copy); ``top`` is
        the largest position, checked on the host."""
        if top >= self.max_context:
            raise CapacityError(
                f"request needs {top + 1} positions, table width is {self.max_context}"
            )
        self.table[rows, positions] = locs
