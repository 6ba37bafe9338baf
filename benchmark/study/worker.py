"""The study's model: DeepSeek-V3.2 attention at full dimensions, one DP worker's MoE.

Why: ECHO's gain is a ratio of (batch / step time) between backends; the step time is set
by what a real worker reads per layer (attention and indexer projections, the routed
experts the global batch touches) and by the per-request attention work at 100K tokens.
A random checkpoint with DeepSeek-V3.2's real attention dimensions and ``LocalRoutedMoE``
in every layer reproduces both, in memory, with no checkpoint files. The first three
(dense) layers of DeepSeek-V3.2 and the 129K-entry LM head are left out: the ratios are
per layer (see benchmark/e2e_study.py).
"""

from __future__ import annotations

import torch

from benchmark.study.locality import favoured_directions, install_preference
from benchmark.study.moe import LocalRoutedMoE
from sglang_echo.config import settings
from sglang_echo.model.attention import ModelKernels
from sglang_echo.model.config import DeepseekV32Config
from sglang_echo.model.deepseek_v32 import DeepseekV32ForCausalLM

# DeepSeek-V3.2's attention and indexer dimensions.
DSV32_DIMS = dict(
    hidden_size=7168, num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, index_n_heads=64,
    index_head_dim=128, index_topk=2048,
)  # fmt: skip
DSV32_MOE = dict(intermediate=512, local_experts=32, global_experts=256, top_k=8, dp_ranks=8)
# A tiny configuration with the same structure, for CPU tests (--smoke).
SMOKE_DIMS = dict(
    hidden_size=64, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32,
    qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, index_n_heads=4,
    index_head_dim=32, index_topk=16,
)  # fmt: skip
# DeepSeek-V3.2's rope scaling (its cost does not depend on it; kept for fidelity).
YARN_ROPE = {
    "type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
    "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
}  # fmt: skip
SMOKE_MOE = dict(intermediate=16, local_experts=4, global_experts=16, top_k=2, dp_ranks=4)


def study_config(
    dims: dict, layers: int, vocab_size: int, max_position: int, indexer_mode: str
) -> DeepseekV32Config:
    """A DeepSeek-V3.2 config with ``dims`` and dense placeholder FFNs (replaced)."""
    cfg = dict(
        model_type="deepseek_v32",
        architectures=["DeepseekV32ForCausalLM"],
        vocab_size=vocab_size,
        num_hidden_layers=layers,
        intermediate_size=16,  # placeholder dense FFN, replaced by LocalRoutedMoE
        mlp_layer_types=["dense"] * layers,
        max_position_embeddings=max_position,
        rope_theta=10000.0,
        rope_scaling=YARN_ROPE,
        indexer_mode=indexer_mode,
        eos_token_id=None,
        **dims,
    )
    return DeepseekV32Config.from_dict(cfg, source="study")


@torch.no_grad()
def build_worker(
    config: DeepseekV32Config,
    moe: dict,
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int = 0,
) -> tuple[DeepseekV32ForCausalLM, torch.Tensor]:
    """A random model on ``device``: every layer's FFN a ``LocalRoutedMoE``, every indexer
    with its favoured direction (locality.install_preference). Returns (model, directions
    [L, D]) so synthetic keys can use the same directions."""
    torch.manual_seed(seed)
    device = torch.device(device)
    kernels = ModelKernels.from_settings(settings())
    with device:
        model = DeepseekV32ForCausalLM(config, kernels)
    model = model.to(dtype)
    for i, layer in enumerate(model.model.layers):
        layer.mlp = LocalRoutedMoE(
            config.hidden_size, seed=seed + 1 + i, device=device, dtype=dtype, **moe
        )
    kernels.apply(model)  # the MoE built after the model takes its batch-invariant mode too
    directions = favoured_directions(
        config.num_hidden_layers, config.index_head_dim, config.qk_rope_head_dim, seed
    )
    install_preference(model, directions)
    return model.eval(), directions
