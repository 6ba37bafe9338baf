"""A decode step's small integer inputs, uploaded in one copy that does not block the host.

Why: a decode step needs four int64 vectors on the device (token ids, positions, output
locations, request rows). Made one ``torch.tensor(...).to(device)`` at a time they are four
pageable host-to-device copies, each of which makes the engine thread wait for the copy
(and so for the stream). Here the host packs them into one row-major block of a pinned
buffer and enqueues a single non-blocking copy into a persistent device block; the views
of that block are the step's inputs. Two pinned blocks alternate, so packing step N+1
never overwrites a block whose copy for step N may still be queued.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch

FIELDS = 4  # ids, positions, out_locs, request rows


class DecodeInputStaging:
    def __init__(self, max_batch: int, device: torch.device) -> None:
        self.max_batch = max_batch
        self.device = device
        self.pinned = device.type == "cuda"
        shape = (2, FIELDS * max_batch)
        self._host = torch.zeros(shape, dtype=torch.int64, pin_memory=self.pinned)
        self._device = torch.zeros(shape, dtype=torch.int64, device=device)
        self._turn = 0

    def upload(self, columns: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """``columns`` (each of the batch's length) -> device int64 views, in order."""
        n = len(columns[0])
        if n > self.max_batch or len(columns) > FIELDS:
            raise ValueError(
                f"{len(columns)} x {n} inputs exceed the {FIELDS} x {self.max_batch} staging"
            )
        flat = array("q")
        for col in columns:
            flat.extend(col)
        turn, self._turn = self._turn, 1 - self._turn
        host = self._host[turn, : len(flat)]
        host.copy_(torch.frombuffer(flat, dtype=torch.int64))
        dev = self._device[turn, : len(flat)]
        dev.copy_(host, non_blocking=self.pinned)
        return [dev[i * n : (i + 1) * n] for i in range(len(columns))]
