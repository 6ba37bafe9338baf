"""Prefill inter-query prefetch as the model's indexer sees it (docs/ARCHITECTURE.md
section 6; ``SGLANG_NSA_FUSE_LOGITS_RECALL_EXTEND=1``).

Per layer and prefill chunk, the indexer scores the chunk's queries block by block. After
each block's scores, ``launch`` runs the one-round 256-bin histogram
(kernels/prefill_prefetch.py): history tokens certain to be in some row's exact top-k and
not resident are mapped and start moving (EchoManager.prefetch: a side stream on CUDA)
while the exact top-k of this block and the scores of the next are computed. ``observe``
folds the block's exact k-th scores into the request's score offset, which narrows the
next block's ambiguous bin. The chunk's ``resolve`` then finds those rows resident.

Lossless by construction: the candidates are proven members of the top-k, and even a
wrong one would only waste a copy (resolve looks everything up again). Measured on the
H200 the side-stream work cost more than the recall it hid (benchmark/results/
prefill_prefetch.json; the evidence row "prefill prefetch"), so it is off by default.
"""

from __future__ import annotations

import torch

from sglang_echo.kernels.prefill_prefetch import (
    prefetch_cap,
    prefill_prefetch,
    prefill_prefetch_reference,
)
from sglang_echo.model.selection_hooks import PrefillSelectionHooks
from sglang_echo.offload.manager import EchoManager
from sglang_echo.offload.predictor import PrefillOffsetPredictor, layer_state, reset_layer_rows


class PrefillPrefetcher(PrefillSelectionHooks):
    def __init__(self, manager: EchoManager, max_rows: int, alpha: float = 0.5) -> None:
        self.manager = manager
        layers = manager.cache.num_layers
        self._offsets = layer_state(layers, max_rows, manager.device, 0.0)
        self.offsets = [
            PrefillOffsetPredictor(
                max_rows, manager.device, alpha, state=(self._offsets[0][i], self._offsets[1][i])
            )
            for i in range(layers)
        ]
        # Rows still allowed this chunk and layer: min(8192, N_G - 1 - Q), on the device.
        self.budget = torch.zeros(1, dtype=torch.int64, device=manager.device)
        self.cap = 0

    def begin_chunk(self, num_queries: int) -> None:
        """A layer starts a prefill chunk of ``num_queries`` query tokens."""
        self.cap = prefetch_cap(self.manager.cache.num_slots, num_queries)
        self.budget.fill_(self.cap)

    def launch(
        self,
        layer: int,
        scores: torch.Tensor,
        locs: torch.Tensor,
        query_pos: torch.Tensor,
        request_row: torch.Tensor,
        topk: int,
    ) -> None:
        """One query block's scores [R, L] over one request's history (column c = host id
        ``locs[c]``), the rows' positions [R] and the request's table row (0-d)."""
        if self.cap == 0:
            return
        rows = request_row.reshape(1).expand(scores.shape[0])
        offset, known = self.offsets[layer].predict(rows)
        offset = torch.where(known, offset, 0.0)
        find = prefill_prefetch if self.manager.use_kernels else prefill_prefetch_reference
        h2d = self.manager.cache.host_to_device[layer]
        found = find(scores, locs, h2d, topk, self.cap, offset, query_pos, self.budget)
        self.manager.prefetch(layer, found.ids.view(1, -1), found.count)

    def observe(self, layer: int, kth: torch.Tensor, request_row: torch.Tensor) -> None:
        """The block's exact k-th scores [R] (-inf where fewer than k keys are visible)."""
        rows = request_row.reshape(1).expand(kth.shape[0])
        self.offsets[layer].update(kth, rows)

    def reset_rows(self, rows: torch.Tensor | list[int]) -> None:
        """Every layer's offsets of ``rows`` back to "none yet" (two launches)."""
        reset_layer_rows(self._offsets, rows, 0.0)
