"""Decode intra-query prefetch as the model's indexer sees it (docs/ARCHITECTURE.md
section 6).

Per decode step and layer, the indexer (model/indexer.py) asks for each request's
threshold, flags the misses that score above it while computing the logits
(kernels/decode_prefetch.py), hands them to ``launch`` (EchoManager.prefetch: slots are
mapped and the rows start moving on a side stream), takes the exact top-k, and reports
each request's k-th score to ``observe``. ``resolve`` then finds the prefetched tokens
resident and recalls only what is still missing.

Thresholds are per layer (each layer's indexer has its own score scale) and per request
row of the request table; ``reset_rows`` clears a row when a new request takes it. All
state has fixed shapes and every step-time call is a plain tensor op, so a decode step
with prefetch is capturable in a CUDA graph.
"""

from __future__ import annotations

import torch

from sglang_echo.offload.manager import EchoManager
from sglang_echo.offload.predictor import DecodeThresholdPredictor

# Candidates per request and layer. ECHO suggests ~64 growing with context; at top-k 2048
# a request misses ~(1 - hit rate) x 2048 of its selections, so 512 covers hit rates
# down to ~0.75 while bounding what a bad threshold can waste in one step.
DEFAULT_DECODE_PREFETCH_CAP = 512


class DecodePrefetcher:
    def __init__(
        self,
        manager: EchoManager,
        max_rows: int,
        cap: int = DEFAULT_DECODE_PREFETCH_CAP,
        alpha: float = 0.5,
    ) -> None:
        if cap < 1:
            raise ValueError(f"decode prefetch cap must be >= 1 candidate per request, got {cap}")
        self.manager = manager
        self.cap = int(cap)
        self.max_rows = int(max_rows)
        layers = manager.cache.num_layers
        self.predictors = [
            DecodeThresholdPredictor(max_rows, manager.device, alpha) for _ in range(layers)
        ]

    def cap_for(self, topk: int) -> int:
        """Candidates per request: at most top-k, so a step's list (B x cap lanes) fits
        the cache whenever its selections do."""
        return max(1, min(self.cap, topk))

    def theta(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """Thresholds [B] float32 of the requests in ``rows`` (+inf: no prediction yet)."""
        return self.predictors[layer].predict(rows)

    def host_to_device(self, layer: int) -> torch.Tensor:
        return self.manager.cache.host_to_device[layer]

    def launch(self, layer: int, candidate_ids: torch.Tensor, counts: torch.Tensor) -> None:
        """Candidates [B, cap] (-1 past counts[b], as kernels/decode_prefetch.py writes
        them, so the counts need no masking pass here)."""
        del counts
        self.manager.prefetch(layer, candidate_ids)

    def observe(self, layer: int, kth: torch.Tensor, rows: torch.Tensor) -> None:
        """This step's exact k-th scores [B] (-inf: fewer than k visible keys) of the
        requests in ``rows`` (distinct). With the cache kernels, one launch."""
        p = self.predictors[layer]
        if not self.manager.use_kernels:
            p.update(kth, rows)
            return
        from sglang_echo.kernels.decode_prefetch import update_thresholds

        update_thresholds(p.theta, p.finite, kth, rows, p.alpha)

    def reset_rows(self, rows: torch.Tensor | list[int]) -> None:
        for p in self.predictors:
            p.reset(rows)
