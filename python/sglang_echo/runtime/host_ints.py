"""Python int lists -> int64 tensors, fast enough for 100K-token prompts.

Why: a decode node admits 100K-token prompts, and ``torch.tensor(list)`` converts element
by element (milliseconds per 100K-token prompt), several times per admission (the table
row, the transfer's locations, the release), on the engine thread that every running
request waits for. ``array('q', list)`` makes the same int64 buffer in a C loop several
times faster, and ``torch.frombuffer`` wraps it without a copy (keeping the array alive).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch

from sglang_echo.kernels.host_copy import upload


def int64_tensor(values: Sequence[int], device: torch.device | str | None = None) -> torch.Tensor:
    """``torch.tensor(values, dtype=torch.int64, device=device)``, the same values and
    errors (an int outside int64 raises OverflowError, a non-int TypeError)."""
    if len(values) == 0:
        return torch.zeros(0, dtype=torch.int64, device=device)
    host = torch.frombuffer(array("q", values), dtype=torch.int64)
    return host if device is None else upload(host, device)  # queued on CUDA, no host wait
