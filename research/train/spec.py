"""The trained model's dimensions, its configs, and a deterministic initialization.

Dimensions reuse ``TinySpec`` (the random-checkpoint writer's spec), so the trained model
has exactly the parameter names and config layout of every other checkpoint in the
project. Every layer uses a dense gated FFN (``dense_layers == layers``): at this size
MoE routing would add parameters and training time without changing what this model is
for, the indexer's top-k behaviour.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import nn

from scripts.make_tiny_checkpoint import TinySpec, hf_config
from sglang_echo.model.config import DeepseekV32Config
from sglang_echo.model.deepseek_v32 import DeepseekV32ForCausalLM

# ~12.5M parameters (25 MB in bfloat16); see README.md in the checkpoint for the layout.
TRAINED_SPEC = TinySpec(
    seed=0,
    layers=6,
    dense_layers=6,
    hidden=384,
    heads=8,
    q_lora_rank=192,
    kv_lora_rank=128,
    qk_nope_head_dim=64,
    qk_rope_head_dim=32,
    v_head_dim=96,
    intermediate=1024,
    moe_intermediate=64,
    experts=8,
    experts_per_tok=2,
    n_group=1,
    topk_group=1,
    shared_experts=1,
    index_heads=8,
    index_dim=64,
    index_topk=128,
    max_position=16384,
    rope="default",
    init_std=0.02,
)


class SpecError(ValueError):
    """The requested model dimensions cannot be trained by this code."""


def dense_spec(spec: TinySpec) -> TinySpec:
    """The same dimensions with every FFN dense (the trainer supports no MoE)."""
    return replace(spec, dense_layers=spec.layers)


def our_config(spec: TinySpec) -> DeepseekV32Config:
    """Our config, parsed from the exact dict transformers would write to config.json."""
    return DeepseekV32Config.from_dict(hf_config(spec).to_dict(), source="train spec")


def check_trainable(spec: TinySpec) -> None:
    if spec.dense_layers != spec.layers:
        raise SpecError(
            f"training supports dense FFNs only: dense_layers ({spec.dense_layers}) must equal "
            f"layers ({spec.layers})."
        )
    if spec.index_dim < spec.qk_rope_head_dim:
        raise SpecError("index_dim must be >= qk_rope_head_dim (the indexer ropes those dims).")
    for name in ("hidden", "heads", "q_lora_rank", "kv_lora_rank", "index_heads", "index_topk"):
        if getattr(spec, name) < 1:
            raise SpecError(f"{name} must be >= 1, got {getattr(spec, name)}")


def build_model(spec: TinySpec, seed: int, device: torch.device | str = "cpu") -> nn.Module:
    """Our ``DeepseekV32ForCausalLM``, initialized from ``seed`` alone (device-independent).

    Linear and embedding weights ~ N(0, init_std), residual-branch outputs (o_proj,
    down_proj) scaled by 1/sqrt(2 * layers) as in GPT-2; norms start at identity.
    """
    check_trainable(spec)
    config = our_config(spec)
    with torch.device("meta"):
        model = DeepseekV32ForCausalLM(config)
    model = model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(seed)
    out_std = spec.init_std / math.sqrt(2 * spec.layers)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                std = out_std if name.endswith(("o_proj.weight", "down_proj.weight")) else None
                param.normal_(0.0, std or spec.init_std, generator=gen)
        for buf in model.buffers():
            buf.zero_()
    return model.to(device)


def parameter_count(model: nn.Module) -> dict[str, int]:
    total = sum(p.numel() for p in model.parameters())
    embed = sum(
        p.numel() for n, p in model.named_parameters() if "embed_tokens" in n or "lm_head" in n
    )
    indexer = sum(p.numel() for n, p in model.named_parameters() if ".indexer." in n)
    return {"total": total, "non_embedding": total - embed, "indexer": indexer}
