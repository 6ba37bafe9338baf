"""DeepSeek's multi-token-prediction (NextN) layer: the draft model of MTP speculation.

A DeepSeek-V3.2 checkpoint ships ``num_nextn_predict_layers`` of them after its decoder
layers, as ``model.layers.{L}.*`` with L = num_hidden_layers. For each token the layer
takes the token id t that follows the position (the one the target just produced or
verified there) and the target's last hidden state h at that position, after the target's
final norm, and predicts the token after t:

    x = eh_proj(cat([enorm(embed_tokens(t)), hnorm(h)]))
    x = DecoderLayer(x)               # MLA + its own lightning indexer, MoE/dense MLP
    out_hidden = shared_head.norm(x)
    logits = shared_head.head(out_hidden)

The decoder layer is the target's own ``DecoderLayer`` class, so its parameters carry the
checkpoint's names (``self_attn``, ``mlp``, ``input_layernorm``, ...) directly on this
module, and its state dict is the checkpoint's ``model.layers.{L}.`` tensors with that
prefix dropped. It attends over a KV pool of its own with one layer (layer id 0): build
it with ``PlainKVCache.for_model(layer.config, ...)``.
"""

from __future__ import annotations

import torch
from torch import nn

from sglang_echo.model.config import DeepseekV32Config
from sglang_echo.model.deepseek_v32 import DecoderLayer
from sglang_echo.model.forward_batch import ForwardBatch
from sglang_echo.model.kv_cache import KVCache
from sglang_echo.model.layers import Linear, MoE, RMSNorm
from sglang_echo.model.rope import RotaryTable


class SharedHead(nn.Module):
    """The checkpoint's ``shared_head``: the final norm and the vocabulary projection."""

    def __init__(self, config: DeepseekV32Config) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = Linear(config.hidden_size, config.vocab_size, bias=False)


class NextNLayer(DecoderLayer):
    """The first NextN layer of ``target_config`` (layer index L = num_hidden_layers).

    ``config`` is the one-layer view of it (``DeepseekV32Config.nextn_layer_config``):
    the MLP type of index L, one KV layer. ``embed_tokens`` and ``shared_head.head`` are
    the checkpoint's own copies, or the target's modules' weights when it has none (the
    loader shares them then, no second copy).
    """

    def __init__(self, target_config: DeepseekV32Config) -> None:
        config = target_config.nextn_layer_config()
        super().__init__(config, layer_id=0)
        self.config = config
        self.target_layer_index = target_config.num_hidden_layers
        hidden = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden)
        self.enorm = RMSNorm(hidden, config.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, config.rms_norm_eps)
        self.eh_proj = Linear(2 * hidden, hidden, bias=False)
        self.shared_head = SharedHead(config)
        self._rotary: RotaryTable | None = None

    def rotary(self) -> RotaryTable:
        """The rope table, on the weights' device (built on first use, as the target's)."""
        device = self.eh_proj.weight.device
        if self._rotary is None or self._rotary.inv_freq.device != device:
            self._rotary = RotaryTable(self.config.rope, self.config.qk_rope_head_dim, device)
        return self._rotary

    def set_graph_safe(self, enabled: bool) -> None:
        """Route the MoE through its fixed-shape dispatch (needed inside CUDA graphs)."""
        if isinstance(self.mlp, MoE):
            self.mlp.dense_dispatch = enabled

    @torch.inference_mode()
    def forward(  # type: ignore[override]  # a draft step, not DecoderLayer's signature
        self, batch: ForwardBatch, target_hidden: torch.Tensor, kv_cache: KVCache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step over ``batch`` -> (float32 logits, out_hidden).

        ``batch.input_ids`` [T] are the next token ids t, one per position in
        ``batch.positions``; ``target_hidden`` [T, hidden] is the target's final-normed
        hidden state at those positions (or, for a further draft step, the out_hidden of
        the step before). Each token's KV rows are written at ``batch.out_locs`` in layer
        0 of ``kv_cache``. Both results keep only the rows of ``batch.logits_indices``
        (all T when None), as the target's forward does: out_hidden [R, hidden] is the h
        of the next draft step for those rows.
        """
        embedded = self.embed_tokens(batch.input_ids)
        hidden = target_hidden.to(embedded.dtype)
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        cos, sin = self.rotary().cos_sin(batch.positions, x.dtype)
        x = super().forward(x, cos, sin, batch, kv_cache)
        if batch.logits_indices is not None:
            x = x[batch.logits_indices]
        out_hidden = self.shared_head.norm(x)
        return self.shared_head.head(out_hidden).float(), out_hidden


__all__ = ["NextNLayer", "SharedHead"]
