"""A copy of a KV backend's small mutable state, put back in place later.

Why: a server captures its decode graphs at start-up by running each shape once on a
dummy batch (runtime/cuda_graph.py). Those steps touch only the padding sink's rows, but
they move the backend's bookkeeping: clocks, the sink's stamps, hit and miss counters,
prefetch thresholds, the prefetch rule's step counts. The checkpoint copies every tensor
and plain number of the backend's objects (walked through their attributes, this
package's objects only) except the data buffers named to it (KV rows, index keys, staging
rows: the dummy steps write the sink's row only), and ``restore`` copies them back into the
same tensors, so captured graphs keep their addresses and the cache is as a fresh one.

Both the copy and the restore run on whatever stream is current (a server's engine
stream), while the state was written, and is read next, on others (the default stream
that built it, the test or scheduler that reads it after start-up): the device is settled
before the copy and after the restore. A race here was seen on the H200 (counters read
non-zero right after start-up, zero a moment later); at start-up the wait costs nothing.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

_PACKAGE = "sglang_echo."


def _ours(value: object) -> bool:
    return type(value).__module__.startswith(_PACKAGE) and hasattr(value, "__dict__")


def _settle(tensors: Iterable[torch.Tensor]) -> None:
    """Wait for every stream of each CUDA device these tensors live on."""
    for device in {t.device for t in tensors if t.is_cuda}:
        torch.cuda.synchronize(device)


class StateCheckpoint:
    def __init__(self, roots: Iterable[object], data: Iterable[torch.Tensor | None]) -> None:
        skip = {t.data_ptr() for t in data if t is not None and t.numel()}
        found: list[torch.Tensor] = []
        self._numbers: list[tuple[object, str, bool | int | float]] = []
        seen: set[int] = set()
        stack = [r for r in roots if r is not None]
        while stack:
            obj = stack.pop()
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            for name, value in vars(obj).items():
                if isinstance(value, (bool, int, float)):
                    self._numbers.append((obj, name, value))
                    continue
                # A part of ours (a predictor, a workspace), or a list of them or of tensors.
                items = value if isinstance(value, (list, tuple)) else (value,)
                for item in items:
                    if isinstance(item, torch.Tensor):
                        if item.numel() and item.data_ptr() not in skip:
                            skip.add(item.data_ptr())  # one copy of a shared tensor
                            found.append(item)
                    elif _ours(item):
                        stack.append(item)
        _settle(found)
        self._tensors = [(t, t.clone()) for t in found]

    def restore(self) -> None:
        for tensor, saved in self._tensors:
            tensor.copy_(saved)
        _settle(t for t, _ in self._tensors)
        for obj, name, value in self._numbers:
            object.__setattr__(obj, name, value)  # frozen dataclasses hold the same value
