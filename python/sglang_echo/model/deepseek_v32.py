"""DeepSeek-V3.2 decoder: embeddings, MLA + indexer layers, dense/MoE FFNs, LM head.

Module names mirror the Hugging Face checkpoint so weights load by their own names.
"""

from __future__ import annotations

import torch
from torch import nn

from sglang_echo.model.attention import MLAttention, ModelKernels
from sglang_echo.model.config import DeepseekV32Config
from sglang_echo.model.forward_batch import ForwardBatch
from sglang_echo.model.kv_cache import KVCache
from sglang_echo.model.layers import GatedMLP, Linear, MoE, RMSNorm, set_batch_invariant
from sglang_echo.model.rope import RotaryTable


class DecoderLayer(nn.Module):
    def __init__(
        self, config: DeepseekV32Config, layer_id: int, kernels: ModelKernels | None = None
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.self_attn = MLAttention(config, kernels)
        if config.mlp_layer_types[layer_id] == "sparse":
            self.mlp: nn.Module = MoE(config)
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        attn = self.self_attn(
            self.input_layernorm(hidden), cos, sin, batch, kv_cache, self.layer_id
        )
        hidden = hidden + attn
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DeepseekV32Backbone(nn.Module):
    def __init__(self, config: DeepseekV32Config, kernels: ModelKernels | None = None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, kernels) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekV32ForCausalLM(nn.Module):
    """Inference-only; ``forward`` returns float32 logits for the batch's sampled rows.

    ``kernels``: the kernel choices (SGLANG_ECHO_SPARSE_MLA, SGLANG_ECHO_BATCH_INVARIANT),
    handed down by the entry point that builds the model; None: the registry's defaults."""

    def __init__(self, config: DeepseekV32Config, kernels: ModelKernels | None = None) -> None:
        super().__init__()
        self.config = config
        self.model = DeepseekV32Backbone(config, kernels)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self._rotary: RotaryTable | None = None
        if kernels is not None and kernels.batch_invariant:
            set_batch_invariant(self, True)  # every Linear, the router, the absorption

    def rotary(self) -> RotaryTable:
        device = self.lm_head.weight.device
        if self._rotary is None or self._rotary.inv_freq.device != device:
            self._rotary = RotaryTable(self.config.rope, self.config.qk_rope_head_dim, device)
        return self._rotary

    def set_graph_safe(self, enabled: bool) -> None:
        """Route MoE through its fixed-shape dispatch (needed inside CUDA graphs)."""
        for layer in self.model.layers:
            if isinstance(layer.mlp, MoE):
                layer.mlp.dense_dispatch = enabled

    def _layers(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        """Every position's hidden state after the decoder layers, before the final norm."""
        hidden = self.model.embed_tokens(batch.input_ids)
        cos, sin = self.rotary().cos_sin(batch.positions, hidden.dtype)
        for layer in self.model.layers:
            hidden = layer(hidden, cos, sin, batch, kv_cache)
        return hidden

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        hidden = self._layers(batch, kv_cache)
        if batch.logits_indices is not None:
            hidden = hidden[batch.logits_indices]
        return self.lm_head(self.model.norm(hidden)).float()

    @torch.inference_mode()
    def forward_with_hidden(
        self, batch: ForwardBatch, kv_cache: KVCache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(float32 logits of the sampled rows, every position's final-normed hidden state).

        Why: DeepSeek's NextN (MTP) layer drafts from the target's final-normed hidden state
        at each position (model/nextn.py), the prompt's positions included, so the whole
        sequence's states are kept, not only the sampled rows'. The logits are the same
        tensor ``forward`` returns."""
        normed = self.model.norm(self._layers(batch, kv_cache))
        rows = normed if batch.logits_indices is None else normed[batch.logits_indices]
        return self.lm_head(rows).float(), normed
