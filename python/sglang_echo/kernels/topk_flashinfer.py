"""FlashInfer's radix top-k behind ``topk_positions``' contract (issue 15, item 7).

FlashInfer (an optional dependency; sglang already depends on it) ships a radix top-k,
``top_k``, and a form for DSA's second stage, ``top_k_ragged_transform``, which scores each
row over its first ``lengths[i]`` keys: exactly our causal mask (keys at positions <= the
query's). The plain form needs the mask applied first (one elementwise pass). With
``tie_break=1`` (ties at the k-th score go to the lower index) either picks the same set as
``kernels/topk.py``. Its output order is its own, so the picks are sorted ascending, with
-1 last, and -inf picks (a row with fewer than k finite visible scores) turned into -1: the
result is then the very tensor ``topk_positions`` returns, whatever FlashInfer's internal
order, batch split or version. That is what keeps offload and no-offload (and any batch
composition) bit-identical, and it is tested on the H200 against the radix select, ties,
short rows and a graph's replay included (tests/test_topk_flashinfer.py).

``SGLANG_ECHO_TOPK`` picks the kernel top-k on CUDA: ``radix`` (the default) or
``flashinfer``, which requires FlashInfer and fails at the first selection, with the
reason, where it cannot run. The variable is parsed once, by ``sglang_echo.config``
(kernels import nothing above themselves): callers pass its value in as ``backend``. The radix select is the default because it measured faster
under this contract on the H200 (benchmark/results/topk_peers.json; the evidence row
"top-k peer (FlashInfer, issue 15)"): FlashInfer alone is faster at 48 x 100K, on its
deterministic path with ties low and on its graph-safe one, but its time barely falls with
fewer rows while ours does, and with the finish (kernels/sort_picks.py) the ragged
graph-safe form took about the same at every row count from 1 to 48 (``by_rows``); its
non-graph-safe path beat ours only at 48 rows, never at 32K keys. At the sweep's row
counts nearest the end-to-end study's batches of 3 and 17 (2-4 and 16 rows) ours is
faster, by up to several times. The interpreter (CPU tests) always runs the radix
select: FlashInfer has no CPU path.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from sglang_echo.kernels.sort_picks import sort_picks, sort_picks_reference

# FlashInfer's TopKTieBreak: 1 = prefer smaller indices (our tie order).
TIE_BREAK_LOW = 1
# Its CUDA-graph-safe path (FilteredTopK, one key per load): a decode step replays from a
# CUDA graph, and the default path's choices are not promised to survive a replay.
GRAPH_SAFE = True
# Its graph-safe path serves k <= 2048 (FILTERED_TOPK_MAX_K in FlashInfer's topk.cuh);
# a larger top-k takes the radix select.
MAX_TOPK = 2048
# Which FlashInfer form serves SGLANG_ECHO_TOPK=flashinfer: the ragged transform (per-row
# lengths) or the plain top-k after the mask (see ``topk_positions_flashinfer``).
RAGGED = True


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


def use_flashinfer(scores: torch.Tensor, topk: int, backend: str = "radix") -> bool:
    """Whether this selection runs on FlashInfer: ``backend`` is ``flashinfer``. It is
    ``SGLANG_ECHO_TOPK`` handed down: the entry point that builds the model (the server,
    ``generate``, a benchmark) reads it from ``settings()`` and passes it as the model's
    ``ModelKernels.topk`` (model/attention.py), and the indexer passes it here. Either
    backend returns the same tensor, so the choice changes speed only. Where FlashInfer
    cannot serve (not CUDA, the interpreter, not importable, a top-k above its graph-safe
    path's), the error says why and what to change."""
    if backend == "radix":
        return False
    compiled = scores.is_cuda and os.environ.get("TRITON_INTERPRET") != "1"
    reason = flashinfer_unavailable() if compiled else "the scores are not on a CUDA device"
    if reason is None and topk > MAX_TOPK:
        reason = f"top-k {topk} is above its graph-safe path's {MAX_TOPK}"
    if reason is None:
        return True
    raise RuntimeError(
        f"SGLANG_ECHO_TOPK=flashinfer, but FlashInfer's top-k cannot serve: {reason}. "
        "Install flashinfer-python 0.7.2 or newer on a CUDA machine, or unset "
        "SGLANG_ECHO_TOPK (the radix select serves everywhere)."
    )


def topk_positions_flashinfer(
    scores: torch.Tensor,
    query_pos: torch.Tensor,
    topk: int,
    deterministic: bool = False,
    graph_safe: bool = GRAPH_SAFE,
    ragged: bool = RAGGED,
) -> torch.Tensor:
    """scores [R, L] fp32, query_pos [R] -> positions [R, topk], the tensor
    ``kernels.topk.topk_positions`` returns (ascending, -1 for masked or missing).
    ``ragged``: FlashInfer's ragged transform with each row's length; otherwise keys past
    each query are set to -inf and its plain top-k runs. ``deterministic``: its
    repeatable-order mode (the sort makes the order ours either way: speed only)."""
    import flashinfer

    if scores.dim() != 2 or scores.dtype != torch.float32:
        raise ValueError("scores must be a float32 [rows, keys] tensor")
    rows, n_cols = scores.shape
    if rows == 0 or n_cols == 0:
        return torch.full((rows, topk), -1, dtype=torch.int64, device=scores.device)
    modes = dict(deterministic=deterministic, tie_break=TIE_BREAK_LOW, dsa_graph_safe=graph_safe)
    if ragged:
        lengths = (query_pos.to(torch.int64) + 1).clamp(0, n_cols).to(torch.int32)
        offsets = torch.zeros(rows, dtype=torch.int32, device=scores.device)
        picks = flashinfer.top_k_ragged_transform(
            scores.contiguous(), offsets, lengths, topk, **modes
        )
        return ascending_picks(scores, picks)
    cols = torch.arange(n_cols, device=scores.device)
    masked = scores.masked_fill(cols > query_pos.view(-1, 1), float("-inf"))
    if topk >= n_cols:  # every key is picked: FlashInfer's top-k wants k below the width
        picks = cols.expand(rows, n_cols)
    else:
        picks = flashinfer.top_k(masked, topk, **modes)[1]
    return ascending_picks(masked, F.pad(picks, (0, topk - picks.shape[1]), value=-1))


def ascending_picks(scores: torch.Tensor, picks: torch.Tensor) -> torch.Tensor:
    """A top-k's picks [R, k] in any order (-1 = none) -> our form: int64, ascending, -1
    last, and a pick whose score is -inf dropped to -1 (the radix select never returns a
    masked key's position). On CUDA one Triton launch (kernels/sort_picks.py), elsewhere
    its torch reference."""
    if scores.is_cuda:
        return sort_picks(scores, picks)
    return sort_picks_reference(scores, picks)


def describe_topk(backend: str) -> dict:
    """Which kernel top-k serves a CUDA selection under ``backend`` (the process's
    ``SGLANG_ECHO_TOPK``), for benchmark records."""
    reason = flashinfer_unavailable()
    version = None
    if reason is None:
        import flashinfer

        version = getattr(flashinfer, "__version__", None)
    served = "radix select (kernels/topk.py)"
    if backend == "flashinfer":
        form = "ragged transform" if RAGGED else "top-k after the mask"
        served = f"FlashInfer's {form} (kernels/topk_flashinfer.py)"
    return {"SGLANG_ECHO_TOPK": backend, "served": served, "flashinfer": version or reason}
