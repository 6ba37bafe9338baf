"""Facts about the GPU that launch grids are sized by, read once per device."""

from __future__ import annotations

import functools

import torch


@functools.cache
def sm_count(index: int | None) -> int:
    """Streaming multiprocessors of CUDA device ``index`` (None: device 0)."""
    return torch.cuda.get_device_properties(index or 0).multi_processor_count
