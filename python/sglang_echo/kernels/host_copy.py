"""Host tensors onto the device without making the host wait, and pinned host memory seen
as a CUDA tensor (UVA), so device kernels read and write it directly.

Why: ``host.to("cuda")`` from pageable memory is synchronous: the host waits until the copy
has run, i.e. until every kernel already queued on the stream (a whole decode step) has
finished. Admission, a request's release and a prefetcher's row reset each did one such
copy on the engine thread, which spun there for a step's time. Staged through pinned
memory the copy is queued like a kernel and the host goes on; torch's pinned allocator
keeps the staging buffer until the copy has run.
"""

from __future__ import annotations

import torch


def upload(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``host`` on ``device``, queued without waiting on CUDA (a plain ``to`` elsewhere, and
    the tensor itself when it is already there)."""
    device = torch.device(device)
    if device.type != "cuda" or host.device.type != "cpu":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def cuda_alias_of_pinned(host: torch.Tensor) -> torch.Tensor | None:
    """A CUDA tensor over the same pinned bytes, or None where UVA aliasing is unavailable."""
    if not (torch.cuda.is_available() and host.is_pinned()):
        return None
    flat = host.view(-1).view(torch.uint8)

    class _Interface:
        __cuda_array_interface__ = {  # noqa: RUF012 - read once by torch.as_tensor
            "shape": (flat.numel(),),
            "typestr": "|u1",
            "data": (flat.data_ptr(), False),
            "version": 3,
            "strides": None,
        }

    try:
        alias = torch.as_tensor(_Interface(), device="cuda")
    except (RuntimeError, TypeError, ValueError):
        return None
    return alias.view(host.dtype).view(host.shape)
