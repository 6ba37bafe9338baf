"""Seam for ECHO's fused decode prefetch at ``Indexer._get_topk_paged``.

With ``SGLANG_NSA_FUSE_LOGITS_RECALL_DECODE=1`` the decode indexer should compute its
logits and, in the same pass, start recalling likely misses (score above the request's
predicted k-th score) into ECHO's cache; the exact top-k still decides, so output is
unchanged. The kernel is ``fused_logits_recall_decode`` in
``sglang_echo.kernels.fused_prefetch`` (not written yet). Contract, so that the hook
below needs no change when it lands:

    fused_logits_recall_decode(original, indexer, forward_batch, layer_id, q_fp8,
                               weights, metadata, coordinator) -> topk

returns exactly what ``original(indexer, forward_batch, layer_id, q_fp8, weights,
metadata)`` returns, having prefetched into ``coordinator.manager``'s cache for
``layer_id``. Until the module exists the flag is accepted and the log says the path is
unfused. No sglang import here.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

TARGET = "sglang.srt.layers.attention.dsa.dsa_indexer.Indexer._get_topk_paged"
KERNEL_MODULE = "sglang_echo.kernels.fused_prefetch"
KERNEL_NAME = "fused_logits_recall_decode"


def find_decode_kernel() -> Callable[..., Any] | None:
    """The fused decode kernel, or None while it does not exist."""
    try:
        module = importlib.import_module(KERNEL_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name != KERNEL_MODULE:
            raise  # the module exists but one of its imports is missing: say so
        return None
    return getattr(module, KERNEL_NAME, None)


def make_topk_paged_hook(kernel: Callable[..., Any]) -> Callable[..., Any]:
    """An AROUND hook for ``Indexer._get_topk_paged``: decode batches that carry an ECHO
    coordinator go through ``kernel``; everything else runs the original."""

    def topk_paged(original, indexer, forward_batch, layer_id, q_fp8, weights, metadata):
        coordinator = getattr(forward_batch, "hisparse_coordinator", None)
        if coordinator is None or not hasattr(coordinator, "manager"):
            return original(indexer, forward_batch, layer_id, q_fp8, weights, metadata)
        if not forward_batch.forward_mode.is_decode():
            return original(indexer, forward_batch, layer_id, q_fp8, weights, metadata)
        return kernel(
            original, indexer, forward_batch, layer_id, q_fp8, weights, metadata, coordinator
        )

    return topk_paged


def decode_prefetch_hook(requested: bool) -> Callable[..., Any] | None:
    """The hook to register, or None; logs what happens to the flag either way."""
    if not requested:
        return None
    kernel = find_decode_kernel()
    if kernel is None:
        logger.warning(
            "sglang-echo: SGLANG_NSA_FUSE_LOGITS_RECALL_DECODE=1 accepted, but the fused "
            "logits+recall decode kernel is not available yet (%s.%s); decode runs the "
            "unfused path: exact top-k, then ECHO resolve.",
            KERNEL_MODULE,
            KERNEL_NAME,
        )
        return None
    logger.info("sglang-echo: fused decode prefetch on (%s.%s)", KERNEL_MODULE, KERNEL_NAME)
    return make_topk_paged_hook(kernel)


def log_extend_prefetch(requested: bool) -> None:
    if requested:
        logger.warning(
            "sglang-echo: SGLANG_NSA_FUSE_LOGITS_RECALL_EXTEND=1 accepted, but prefill "
            "prefetch does not apply here: a local prefill keeps its prompt on the device."
        )
