"""The engine's CUDA stream: the decode step's work at the highest priority the device has.

Why: on a PD decode node a prompt's KV arrives while the running batch decodes. Over RDMA
that costs the decode GPU nothing; the fake transfer's emulation (runtime/fake_transfer.py)
generates and writes the rows with GPU kernels on a stream of the lowest priority (0).
With the engine's steps on the highest-priority stream, the GPU's block scheduler gives
the decode step's blocks the multiprocessors first and the transfer fills what is left,
instead of both sharing them equally. Graphs captured on this stream are replayed on it,
and a graph's kernels run at the priority of the stream it is launched into.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

# Lower numbers are higher priorities; torch clamps to the device's range (-5..0 on an
# H200), so this is the highest there is.
HIGHEST_PRIORITY = -100

_ENGINE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def engine_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The engine's stream on ``device`` (one per device and process); None off CUDA."""
    if device.type != "cuda":
        return None
    device = torch.device("cuda", device.index if device.index is not None else 0)
    stream = _ENGINE_STREAMS.get(device)
    if stream is None:
        stream = _ENGINE_STREAMS[device] = torch.cuda.Stream(device, priority=HIGHEST_PRIORITY)
    return stream


def on_engine_stream(device: torch.device) -> AbstractContextManager:
    """A context in which the current stream is the engine's (a no-op off CUDA)."""
    stream = engine_stream(device)
    return torch.cuda.stream(stream) if stream is not None else nullcontext()
