"""Write a random DeepSeek-V3.2 checkpoint built with transformers' own classes; see ``--help``.

Deterministic by seed; sized by arguments; ships a byte-level tokenizer so text prompts
work end to end. The repository's scripts own it (outside the wheel, no ``research/``
import): ``make demo DEMO_MODEL=demo/tiny-dsv32`` and the e2e and serving sweeps run it as
``python scripts/make_tiny_checkpoint.py``; the tests (their oracle fixtures), ``research.train``
and the benchmarks import it as ``scripts.make_tiny_checkpoint`` with the repository root
on the path.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from sglang_echo.tokenizer import BYTE_VOCAB_SIZE, save_byte_tokenizer


@dataclass
class TinySpec:
    seed: int = 0
    layers: int = 3
    dense_layers: int = 1
    hidden: int = 64
    heads: int = 4
    q_lora_rank: int = 48
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 16
    v_head_dim: int = 16
    intermediate: int = 128
    moe_intermediate: int = 32
    experts: int = 8
    experts_per_tok: int = 2
    n_group: int = 2
    topk_group: int = 1
    shared_experts: int = 1
    index_heads: int = 8
    index_dim: int = 32
    index_topk: int = 16
    vocab_size: int = BYTE_VOCAB_SIZE
    max_position: int = 4096
    rope: str = "default"  # or "yarn"
    yarn_factor: float = 4.0
    init_std: float = 0.08


def hf_config(spec: TinySpec):
    from transformers import DeepseekV32Config

    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if spec.rope == "yarn":
        original = max(64, spec.max_position // int(spec.yarn_factor))
        rope = {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": spec.yarn_factor,
            "original_max_position_embeddings": original,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        }
    elif spec.rope != "default":
        raise ValueError(f"rope must be 'default' or 'yarn', got {spec.rope!r}")
    return DeepseekV32Config(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        moe_intermediate_size=spec.moe_intermediate,
        num_hidden_layers=spec.layers,
        first_k_dense_replace=spec.dense_layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.heads,
        q_lora_rank=spec.q_lora_rank,
        kv_lora_rank=spec.kv_lora_rank,
        qk_nope_head_dim=spec.qk_nope_head_dim,
        qk_rope_head_dim=spec.qk_rope_head_dim,
        v_head_dim=spec.v_head_dim,
        n_routed_experts=spec.experts,
        num_experts_per_tok=spec.experts_per_tok,
        n_group=spec.n_group,
        topk_group=spec.topk_group,
        n_shared_experts=spec.shared_experts,
        index_n_heads=spec.index_heads,
        index_head_dim=spec.index_dim,
        index_topk=spec.index_topk,
        max_position_embeddings=spec.max_position,
        rope_parameters=rope,
        initializer_range=spec.init_std,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )


def build_hf_model(spec: TinySpec):
    from transformers import DeepseekV32ForCausalLM

    torch.manual_seed(spec.seed)
    model = DeepseekV32ForCausalLM(hf_config(spec)).eval()
    with torch.no_grad():
        # Random routing-bias values exercise the bias-corrected expert choice.
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.e_score_correction_bias.normal_(0.0, 0.05)
    return model


def make_tiny_checkpoint(out_dir: str | Path, spec: TinySpec | None = None) -> Path:
    spec = spec or TinySpec()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = build_hf_model(spec)
    model.save_pretrained(str(out), max_shard_size="15MB")
    save_byte_tokenizer(out)
    (out / "tiny_spec.json").write_text(json.dumps(asdict(spec), indent=2))
    return out


def main(argv: list[str] | None = None) -> None:
    defaults = TinySpec()
    parser = argparse.ArgumentParser(
        description="Write a random tiny DeepSeek-V3.2 checkpoint (config.json, safetensors, "
        "byte-level tokenizer), deterministic by seed. Needs transformers.",
    )
    parser.add_argument("--out", required=True, help="output folder")
    for field, value in asdict(defaults).items():
        flag = "--" + field.replace("_", "-")
        kwargs = {"default": value, "help": f"default: {value}"}
        if field == "rope":
            kwargs["choices"] = ["default", "yarn"]
        parser.add_argument(flag, type=type(value), **kwargs)
    args = parser.parse_args(argv)
    spec = TinySpec(**{k: getattr(args, k) for k in asdict(defaults)})
    path = make_tiny_checkpoint(args.out, spec)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
