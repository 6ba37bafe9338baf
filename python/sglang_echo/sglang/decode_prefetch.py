"""Decode prefetch in sglang (``SGLANG_NSA_FUSE_LOGITS_RECALL_DECODE=1``): stage the
predicted misses from sglang's own indexer logits while its exact top-k runs.

Why this shape: a decode step's top-k must stay the one sglang computes from DeepGEMM's
paged logits, or outputs would differ from the same server without ECHO. So nothing here
computes logits or changes the top-k. Between the logits and the top-k (sglang's
``metadata.topk_transform``), the chunked staged design of
``offload/decode_prefetcher.py`` runs with one chunk (sglang's logits come from one
DeepGEMM launch, which cannot be split into chunks from here):

1. On a side stream, select each request's keys that score above its predicted threshold
   (EMA of its previous k-th scores) and are not resident.
2. Copy their rows from the pinned host pool into the staging buffer, on a bounded grid.
   Nothing is allocated.
3. sglang's top-k runs beside them.
4. The thresholds learn the k-th scores of that top-k.
5. The layer's resolve (``swap_in_selected_pages``) takes staged rows device to device
   and recalls the rest over PCIe (``EchoManager.resolve``).

The exact top-k still decides every row attention reads, so this is lossless by
construction. The copy overlaps only the top-k here, not the logits (the runtime's chunked
logits overlap both), so it pays only where many selections miss.

The hook: an AROUND hook on ``Indexer._get_topk_paged`` hands the real metadata's
``topk_transform`` through a proxy for decode batches. Padding rows of a graph batch
(past the real requests) stage nothing and teach no threshold: their predictor row is the
scratch row. The newest position of each request is left out: its row is written this step
and is not on the host yet. Its lookup never reads a host row either (``topk_resolve``).

``auto`` needs two decode graphs per batch size (with and without the prefetch), which the
runtime's graph runner keeps and sglang's does not: the plugin runs ``auto`` as ``0``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from sglang_echo.offload.decode_prefetcher import DecodePrefetcher
from sglang_echo.sglang.sizing import PLUGIN_STAGE_CHUNKS

logger = logging.getLogger(__name__)

INDEXER_TARGET = "sglang.srt.layers.attention.dsa.dsa_indexer.Indexer._get_topk_paged"
# The coordinator of this process whose decode steps prefetch (None: the switch is off).
_ACTIVE: PluginDecodePrefetch | None = None
_installed = False


class PluginDecodePrefetch:
    """The staged decode prefetch over one coordinator's cache and host-id table."""

    def __init__(
        self, manager, req_to_host: torch.Tensor, num_real_reqs: torch.Tensor, max_rows: int
    ) -> None:
        """``req_to_host`` [request slots, positions] host ids (-1 none), sglang's
        ``req_to_host_pool``; ``num_real_reqs`` the step's real request count (a device
        scalar the model runner fills); ``max_rows`` the request slots."""
        self.prefetcher = DecodePrefetcher(manager, max_rows, chunks=PLUGIN_STAGE_CHUNKS)
        self.req_to_host = req_to_host
        self.num_real_reqs = num_real_reqs
        self.scratch_row = self.prefetcher.predictors[0].scratch_row
        # Whether sglang's Indexer._get_topk_paged is wrapped (install_decode_prefetch).
        self.hook_applied = False
        # The current forward's tables (_step_tables) and the last layer that asked.
        self._tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._last_layer = -1

    @property
    def nbytes(self) -> int:
        return self.prefetcher.nbytes

    def reset_row(self, req_pool_idx: int) -> None:
        """A request took this slot: no prediction until its first top-k."""
        self.prefetcher.reset_rows([req_pool_idx])

    def around_topk(
        self,
        layer: int,
        logits: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        run_topk: Callable[[], torch.Tensor],
    ) -> torch.Tensor:
        """Stage, run sglang's top-k (``run_topk``) unchanged, learn from it. ``logits``
        [rows, positions] float32, row i of request ``req_pool_indices[i]`` of length
        ``seq_lens[i]`` (the current token included)."""
        n = min(logits.shape[0], req_pool_indices.shape[0])
        if n == 0:
            return run_topk()
        rows, locs, visible = self._step_tables(layer, n, logits, req_pool_indices, seq_lens)
        scores = logits[:n]
        theta = self.prefetcher.theta(layer, rows)
        self.prefetcher.stage(layer, 0, scores, locs, visible, theta, 0, locs.shape[1])
        result = run_topk()
        positions = result[:n].to(torch.int64)
        self.prefetcher.finish(layer, scores, positions, rows)
        return result

    def _step_tables(
        self,
        layer: int,
        n: int,
        logits: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step's predictor rows [n], host-id table [n, positions] and staged lengths
        [n]. They do not change between a step's layers, so they are built at its first
        layer (a layer id not above the previous call's: a new forward, eager or being
        captured) and reused by the later ones, instead of gathering the host-id rows once
        per layer."""
        if self._tables is None or layer <= self._last_layer:
            device = logits.device
            real = torch.arange(n, device=device) < self.num_real_reqs.to(device).reshape(1)
            slots = req_pool_indices[:n].to(device, torch.int64)
            width = min(logits.shape[1], self.req_to_host.shape[1])
            locs = self.req_to_host[slots, :width].to(torch.int64)
            self._tables = (
                torch.where(real, slots, self.scratch_row),
                torch.where(locs >= 0, locs, 0),
                # Positions before the newest one, real rows only (the rest stage nothing).
                torch.where(real, seq_lens[:n].to(device, torch.int64) - 1, 0).clamp(min=0),
            )
        self._last_layer = layer
        return self._tables


class _StagingMetadata:
    """sglang's indexer metadata with a ``topk_transform`` that stages around it; every
    other attribute is the real metadata's."""

    def __init__(self, inner: Any, prefetch: PluginDecodePrefetch, layer: int, batch: Any):
        self._inner, self._prefetch, self._layer, self._batch = inner, prefetch, layer, batch

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def topk_transform(self, logits: torch.Tensor, topk: int, **kwargs: Any) -> torch.Tensor:
        b = self._batch
        return self._prefetch.around_topk(
            self._layer,
            logits,
            b.req_pool_indices,
            b.seq_lens,
            lambda: self._inner.topk_transform(logits, topk, **kwargs),
        )


def topk_with_decode_prefetch(
    original, indexer, forward_batch, layer_id, q_fp8, weights, metadata, *args, **kwargs
):
    """AROUND ``Indexer._get_topk_paged``: decode batches of a prefetching coordinator
    stage around their top-k; everything else runs sglang's path untouched."""
    prefetch = _ACTIVE
    if prefetch is not None and forward_batch.forward_mode.is_decode():
        metadata = _StagingMetadata(metadata, prefetch, layer_id, forward_batch)
    return original(indexer, forward_batch, layer_id, q_fp8, weights, metadata, *args, **kwargs)


def install_decode_prefetch(coordinator) -> PluginDecodePrefetch:
    """Make ``coordinator``'s decode steps prefetch: register the indexer hook once per
    process. Where sglang cannot apply it (it only logs that), the prefetch object still
    serves the hook function (``hook_applied`` False) but sglang's decode never calls it,
    so decode runs the exact top-k, then ECHO's resolve, lossless as always; the log says
    so."""
    global _ACTIVE, _installed
    from sglang.srt.plugins.hook_registry import HookRegistry, HookSource, HookType

    if not _installed:
        source = HookSource(plugin_name="echo", dist_name="sglang-echo")
        HookRegistry.register(
            INDEXER_TARGET, topk_with_decode_prefetch, HookType.AROUND, source=source
        )
        HookRegistry.apply_hooks()
        _installed = True
    _ACTIVE = PluginDecodePrefetch(
        coordinator.manager,
        coordinator.req_to_host_pool,
        coordinator.num_real_reqs,
        coordinator.req_to_token_pool.req_to_token.shape[0],
    )
    _ACTIVE.hook_applied = INDEXER_TARGET in HookRegistry._patched
    if not _ACTIVE.hook_applied:
        logger.warning(
            "sglang-echo: could not wrap %s; SGLANG_NSA_FUSE_LOGITS_RECALL_DECODE=1 has no "
            "effect: decode runs the exact top-k, then ECHO's resolve.",
            INDEXER_TARGET,
        )
    return _ACTIVE


def uninstall_decode_prefetch() -> None:
    """No coordinator of this process prefetches (a coordinator built with the switch off;
    tests build several in one process)."""
    global _ACTIVE
    _ACTIVE = None
