"""A deterministic stand-in for a DSA model's decode step, for the plugin's GPU harness.

The harness checks the plugin's KV machinery, not a model: what matters is that every
byte the resolve hands to attention reaches the output, and that the selections move
from step to step as an indexer's do (mostly the same tokens, some churn), so that the
ECHO cache hits, misses and evicts. So each piece is the smallest thing with that
property:

- KV rows: a token's latent and rope parts are table rows picked by (token + position),
  written by sglang's own ``set_mla_kv_buffer`` (its fp8 quantisation for fp8 rows);
- the indexer: a score per earlier position from a fixed per-position term, a term of the
  token at that position and a small term of the current token, then an exact top-k;
- attention: the selected rows' bytes (read as numbers) weighted by a softmax of their
  scores, projected to a small hidden vector, summed over layers; greedy argmax of a
  fixed unembedding gives the next token.

Both loops of the harness (ECHO and the plain pool) call the same functions on the same
shapes in the same order, so their logits are bit-identical exactly when every row read
through ECHO's table holds the bytes the plain pool holds for that position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KV_LORA, ROPE = 512, 64


@dataclass(frozen=True)
class ToyShape:
    layers: int
    top_k: int
    vocab: int
    max_context: int
    row_width: int  # elements of one stored row (656 bytes fp8, 576 bf16)
    hidden: int = 64


class ToyModel:
    def __init__(self, shape: ToyShape, device: torch.device | str, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        s = shape
        self.shape = s
        self.device = torch.device(device)

        def put(t: torch.Tensor) -> torch.Tensor:
            return t.to(self.device)

        self.nope = put(torch.randn(s.layers, s.vocab, KV_LORA, generator=g).to(torch.bfloat16))
        self.rope = put(torch.randn(s.layers, s.vocab, ROPE, generator=g).to(torch.bfloat16))
        self.position_score = put(torch.rand(s.layers, s.max_context, generator=g))
        self.token_score = put(0.5 * torch.rand(s.layers, s.vocab, generator=g))
        self.query_score = put(0.8 * torch.rand(s.layers, s.vocab, generator=g))
        self.wave = put(torch.cos(0.37 * torch.arange(s.max_context, dtype=torch.float32)))
        self.project = put(torch.randn(s.row_width, s.hidden, generator=g) / s.row_width)
        self.unembed = put(torch.randn(s.hidden, s.vocab, generator=g))
        self.positions = put(torch.arange(s.max_context))

    def kv(self, layer: int, tokens: torch.Tensor, positions: torch.Tensor):
        """The latent [n, 1, 512] and rope [n, 1, 64] parts (bf16) of new tokens."""
        pick = (tokens + positions) % self.shape.vocab
        return self.nope[layer, pick].unsqueeze(1), self.rope[layer, pick].unsqueeze(1)

    def select(
        self, layer: int, context_tokens: torch.Tensor, seq_lens: torch.Tensor,
        current: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Top-k positions [bs, K] int32 (-1: none; sequences shorter than K) and their
        softmax weights [bs, K] float32, over positions < seq_len (current one included)."""
        scores = self.scores(layer, context_tokens, seq_lens, current)
        positions = self.top(scores)
        return positions, self.weights(scores, positions)

    def scores(
        self, layer: int, context_tokens: torch.Tensor, seq_lens: torch.Tensor,
        current: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """The indexer's logits [bs, max_context] float32 (-inf past each sequence)."""
        scores = (
            self.position_score[layer][None, :]
            + self.token_score[layer][context_tokens]
            + self.query_score[layer][current][:, None] * self.wave[None, :]
        )
        live = self.positions[None, :] < seq_lens[:, None]
        return torch.where(live, scores, torch.full_like(scores, float("-inf")))

    def top(self, scores: torch.Tensor) -> torch.Tensor:
        """The exact top-k positions [bs, K] int32 of ``scores`` (-1: fewer live keys)."""
        values, positions = torch.topk(scores, self.shape.top_k, dim=1, sorted=True)
        picked = values > float("-inf")
        return torch.where(picked, positions, torch.full_like(positions, -1)).to(torch.int32)

    def weights(self, scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Softmax weights [bs, K] float32 of the selected positions' scores (0: none)."""
        picked = positions >= 0
        values = torch.gather(scores, 1, positions.clamp(min=0).to(torch.int64))
        weights = torch.softmax(torch.where(picked, values, torch.full_like(values, -1e30)), 1)
        return torch.where(picked, weights, torch.zeros_like(weights))

    def attend(self, rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """rows [bs, K, W] (any dtype; read as numbers, zero where nothing was selected),
        weights [bs, K] -> this layer's contribution [bs, hidden]."""
        pooled = (weights.unsqueeze(-1) * rows.to(torch.float32)).sum(1)
        return pooled @ self.project

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.unembed

    def first_token(self, prompt: list[int]) -> int:
        """The prefill's output token (the harness checks decode, not prefill)."""
        return (sum(prompt) * 31 + len(prompt)) % self.shape.vocab
