"""What the indexer offers a KV backend while it selects: the selection hooks.

Why: a backend that offloads KV (ECHO) can move bytes earlier if it sees the indexer's
scores before the exact top-k is known (logits ready) and learns from the top-k once it is
(top-k ready). The model declares these moments here and calls them; ``offload/``
implements them (its decode and prefill prefetchers). The model never imports ``offload/``,
and a backend without hooks (``KVCache.decode_prefetch`` / ``prefill_prefetch`` None)
makes the indexer take its plain path. The exact top-k decides what attention reads
either way: a hook may only copy bytes, never change a result.
"""

from __future__ import annotations

import torch


class DecodeSelectionHooks:
    """A decode step's hooks, per layer: the indexer asks for each request's threshold,
    splits the logits into the chunks the hooks ask for, hands each chunk's scores over as
    soon as they are computed (logits ready), and reports the exact top-k (top-k ready)."""

    def theta(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """Thresholds [B] float32 of the requests in request-table rows ``rows``."""
        raise NotImplementedError

    def chunk_bounds(self, length: int, span: int) -> list[tuple[int, int]]:
        """[start, end) of each chunk of a [B, length] score table (starts aligned to
        ``span``, the logits kernel's key span per program)."""
        raise NotImplementedError

    def stage(
        self,
        layer: int,
        chunk: int,
        scores: torch.Tensor,
        locs: torch.Tensor,
        seq_lens: torch.Tensor,
        theta: torch.Tensor,
        start: int,
        end: int,
    ) -> None:
        """Logits ready: the scores of key positions [start, end) of chunk ``chunk``
        (``locs``: their token locations, ``seq_lens`` each request's keys)."""
        raise NotImplementedError

    def finish(
        self, layer: int, scores: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor
    ) -> None:
        """Top-k ready: the step's scores and its exact top-k ``positions``."""
        raise NotImplementedError


class PrefillSelectionHooks:
    """A prefill chunk's hooks, per layer and query block: the block's scores as soon as
    they are computed (logits ready), then its exact k-th scores (top-k ready)."""

    def begin_chunk(self, num_queries: int) -> None:
        """A layer starts a prefill chunk of ``num_queries`` query tokens."""
        raise NotImplementedError

    def launch(
        self,
        layer: int,
        scores: torch.Tensor,
        locs: torch.Tensor,
        query_pos: torch.Tensor,
        request_row: torch.Tensor,
        topk: int,
    ) -> None:
        """Logits ready: one query block's scores [R, L] over one request's history
        (column c = token location ``locs[c]``), the rows' positions and the request's
        table row."""
        raise NotImplementedError

    def observe(self, layer: int, kth: torch.Tensor, request_row: torch.Tensor) -> None:
        """Top-k ready: the block's exact k-th scores [R]."""
        raise NotImplementedError
