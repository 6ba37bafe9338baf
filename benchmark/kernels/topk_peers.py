"""Peers of the radix top-k, measured beside it (issue 15, item 7). Benchmarks only.

FlashInfer's radix top-k (``flashinfer.top_k``, its native kernels: carry ``.peer/`` and
install it on the GPU machine as ``benchmark/device_session.sh`` stage ``topk_peer`` does,
with ``FLASHINFER_TOPK_ALGO=default``, since the bundle leaves the CUB backend out) in the
three modes a decode step could use: as fast as it goes, deterministic with ties to the
lower index (the set our kernel returns), and that again on its CUDA-graph-safe path.
Where FlashInfer does not import, the peer is reported as missing with the reason, never
as zero.

What could make a peer the CUDA default (the project's rule: offload and no-offload stay
bit-identical, and the selection stays exact with ties to the lower position): its set
must equal ours on any input, ties included (``same_set``), and its order must be
repeatable (deterministic mode), so that both sides attend the same rows in the same
order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# name -> flashinfer.top_k keyword arguments (tie_break 1: prefer smaller indices)
FLASHINFER_MODES = {
    "fast": dict(deterministic=False, tie_break=0, dsa_graph_safe=False),
    "deterministic_ties_low": dict(deterministic=True, tie_break=1, dsa_graph_safe=False),
    "graph_safe_deterministic_ties_low": dict(deterministic=True, tie_break=1, dsa_graph_safe=True),
}

# (scores [R, L] float32, k) -> indices [R, k] int64, in the peer's own order
TopK = Callable[[torch.Tensor, int], torch.Tensor]


def flashinfer_topk(mode: str) -> TopK | str:
    """FlashInfer's top-k in ``mode`` (a key of FLASHINFER_MODES), or why it cannot run."""
    if mode not in FLASHINFER_MODES:
        raise ValueError(
            f"unknown FlashInfer top-k mode {mode!r}; choose one of {list(FLASHINFER_MODES)}"
        )
    try:
        import flashinfer
    except Exception as exc:  # optional: absent, or built for another torch/CUDA
        return f"flashinfer does not import: {type(exc).__name__}: {str(exc)[:200]}"
    kwargs = FLASHINFER_MODES[mode]

    def run(scores: torch.Tensor, k: int) -> torch.Tensor:
        return flashinfer.top_k(scores, k, **kwargs)[1]

    return run


def same_set(ours: torch.Tensor, peer: torch.Tensor) -> bool:
    """Whether a peer's indices [R, k] (any order) are exactly our positions [R, k]
    (ascending, as kernels/topk.py returns them on rows of at least k keys)."""
    return ours.shape == peer.shape and torch.equal(ours, peer.sort(dim=1).values)


def tie_heavy(scores: torch.Tensor, step: float = 0.25) -> torch.Tensor:
    """The scores on a grid of ``step``: many keys tie at every value, the k-th's too, so
    only an index tie-break gives one set."""
    return (scores / step).round() * step
