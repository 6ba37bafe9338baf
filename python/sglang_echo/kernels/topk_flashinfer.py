"""FlashInfer's radix top-k behind ``topk_positions``' contract (issue 15, item 7).

FlashInfer (an optional dependency; sglang already depends on it) ships a radix top-k
for DSA's second stage, ``top_k_ragged_transform``: each row is scored over its first
``lengths[i]`` keys, which is exactly our causal mask (keys at positions <= the query's).
With ``tie_break=1`` (ties at the k-th score go to the lower index) it picks the same set
as ``kernels/topk.py``. Its output order is its own, so the picks are sorted ascending,
with -1 last, and -inf picks (a row with fewer than k finite visible scores) turned into
-1: the result is then the very tensor ``topk_positions`` returns, whatever FlashInfer's
internal order, batch split or version. That is what keeps offload and no-offload (and
any batch composition) bit-identical, and it is tested on the H200 against the radix
select, ties and short rows included (tests/test_topk_flashinfer.py).

``SGLANG_ECHO_TOPK`` picks the kernel top-k on CUDA: ``auto`` (the default) takes
FlashInfer where it imports, the radix select otherwise; ``radix`` forces ours (the
fallback and the reference); ``flashinfer`` requires FlashInfer and fails at the first
selection, with the reason, where it cannot run. The interpreter (CPU tests) always runs
the radix select: FlashInfer has no CPU path.
"""

from __future__ import annotations

import functools
import os

import torch

ENV_TOPK = "SGLANG_ECHO_TOPK"
TOPK_BACKENDS = ("auto", "radix", "flashinfer")
# FlashInfer's TopKTieBreak: 1 = prefer smaller indices (our tie order).
TIE_BREAK_LOW = 1
# Its CUDA-graph-safe path (FilteredTopK, one key per load): a decode step replays from a
# CUDA graph, and the default path's choices are not promised to survive a replay.
GRAPH_SAFE = True
# Its graph-safe path serves k <= 2048 (FILTERED_TOPK_MAX_K in FlashInfer's topk.cuh);
# a larger top-k takes the radix select.
MAX_TOPK = 2048
# ``auto`` takes FlashInfer from this many score rows (requests in a decode step, query
# tokens in a prefill chunk): below it the radix select is faster. On the H200 at 100K
# keys (benchmark/results/topk_peers.json, ``by_rows``) ... (set from the sweep).
FLASHINFER_MIN_ROWS = 16
_NOT_PICKED = 1 << 62  # sorts after every position


def topk_backend(environ: dict | None = None) -> str:
    """``SGLANG_ECHO_TOPK`` (default ``auto``); a bad value is an error naming the allowed
    ones."""
    raw = (os.environ if environ is None else environ).get(ENV_TOPK, "")
    value = raw.strip().lower() or "auto"
    if value not in TOPK_BACKENDS:
        raise ValueError(
            f"{ENV_TOPK}={raw!r} is not understood; set it to one of "
            f"{', '.join(TOPK_BACKENDS)} (or leave it unset for auto)."
        )
    return value


@functools.cache
def flashinfer_unavailable() -> str | None:
    """Why FlashInfer's top-k cannot run in this process, or None where it can."""
    try:
        import flashinfer
    except Exception as exc:  # absent, or built for another torch/CUDA
        return f"flashinfer does not import ({type(exc).__name__}: {str(exc)[:160]})"
    if not hasattr(flashinfer, "top_k_ragged_transform"):
        version = getattr(flashinfer, "__version__", "?")
        return f"flashinfer {version} has no top_k_ragged_transform (0.7.2 or newer has)"
    return None


def use_flashinfer(scores: torch.Tensor, topk: int, environ: dict | None = None) -> bool:
    """Whether this selection runs on FlashInfer: CUDA, compiled (not the interpreter),
    top-k within its graph-safe path, and ``SGLANG_ECHO_TOPK`` ``flashinfer``, or ``auto``
    with at least FLASHINFER_MIN_ROWS rows. Either backend returns the same tensor, so the
    choice changes speed only. Where ``flashinfer`` was asked for and cannot serve, the
    error says why and what to change."""
    backend = topk_backend(environ)
    if backend == "radix" or (backend == "auto" and scores.shape[0] < FLASHINFER_MIN_ROWS):
        return False
    compiled = scores.is_cuda and os.environ.get("TRITON_INTERPRET") != "1"
    reason = flashinfer_unavailable() if compiled else "the scores are not on a CUDA device"
    if reason is None and topk > MAX_TOPK:
        reason = f"top-k {topk} is above its graph-safe path's {MAX_TOPK}"
    if reason is None:
        return True
    if backend == "flashinfer":
        raise RuntimeError(
            f"{ENV_TOPK}=flashinfer, but FlashInfer's top-k cannot serve: {reason}. Install "
            f"flashinfer-python 0.7.2 or newer on a CUDA machine, or set {ENV_TOPK}=auto "
            "(FlashInfer where it can serve, the radix select elsewhere)."
        )
    return False


def topk_positions_flashinfer(
    scores: torch.Tensor,
    query_pos: torch.Tensor,
    topk: int,
    deterministic: bool = False,
    graph_safe: bool = GRAPH_SAFE,
) -> torch.Tensor:
    """scores [R, L] fp32, query_pos [R] -> positions [R, topk], the tensor
    ``kernels.topk.topk_positions`` returns (ascending, -1 for masked or missing).
    ``deterministic``: FlashInfer's repeatable-order mode (the sort below makes the order
    ours either way, so it changes speed only)."""
    import flashinfer

    if scores.dim() != 2 or scores.dtype != torch.float32:
        raise ValueError("scores must be a float32 [rows, keys] tensor")
    rows, n_cols = scores.shape
    if rows == 0 or n_cols == 0:
        return torch.full((rows, topk), -1, dtype=torch.int64, device=scores.device)
    lengths = (query_pos.to(torch.int64) + 1).clamp(0, n_cols).to(torch.int32)
    offsets = torch.zeros(rows, dtype=torch.int32, device=scores.device)
    picks = flashinfer.top_k_ragged_transform(
        scores.contiguous(), offsets, lengths, topk,
        deterministic=deterministic, tie_break=TIE_BREAK_LOW, dsa_graph_safe=graph_safe,
    )  # fmt: skip
    return ascending_picks(scores, picks)


def ascending_picks(scores: torch.Tensor, picks: torch.Tensor) -> torch.Tensor:
    """A top-k's picks [R, k] in any order (-1 = none) -> our form: int64, ascending, -1
    last, and a pick whose score is -inf dropped to -1 (the radix select never returns a
    masked key's position)."""
    picks = picks.to(torch.int64)
    picked = torch.gather(scores, 1, picks.clamp(min=0))
    kept = (picks >= 0) & (picked != float("-inf"))
    ordered = torch.where(kept, picks, _NOT_PICKED).sort(dim=1).values
    return torch.where(ordered == _NOT_PICKED, -1, ordered)


def describe_topk(environ: dict | None = None) -> dict:
    """Which kernel top-k serves a CUDA selection in this process, for benchmark records."""
    reason = flashinfer_unavailable()
    backend = topk_backend(environ)
    if backend == "radix" or reason is not None:
        served = "radix select (kernels/topk.py) at every row count"
    elif backend == "flashinfer":
        served = f"FlashInfer's ragged top-k at every row count (top-k <= {MAX_TOPK})"
    else:
        served = (
            f"FlashInfer's ragged top-k from {FLASHINFER_MIN_ROWS} rows (top-k <= {MAX_TOPK}), "
            "the radix select below"
        )
    version = None
    if reason is None:
        import flashinfer

        version = getattr(flashinfer, "__version__", None)
    return {ENV_TOPK: backend, "served": served, "flashinfer": version or reason}
