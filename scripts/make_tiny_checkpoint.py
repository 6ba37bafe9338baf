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
    # DeepSeek's multi-token-prediction (NextN) layers after the decoder layers, as
    # model.layers.{layers + k}.* (0: none, and the files are what they were without it).
    num_nextn_predict_layers: int = 0


def hf_config(spec: TinySpec, layers: int | None = None):
    """transformers' config of ``spec`` (``layers``: that many decoder layers instead)."""
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
    extra = {}
    if spec.num_nextn_predict_layers:
        extra["num_nextn_predict_layers"] = spec.num_nextn_predict_layers
    return DeepseekV32Config(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        moe_intermediate_size=spec.moe_intermediate,
        num_hidden_layers=spec.layers if layers is None else layers,
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
        **extra,
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


# The NextN layers' weights draw from their own seed, so the target's stay as without them.
NEXTN_SEED_OFFSET = 1 << 20
NEXTN_FILE = "model-nextn.safetensors"


def nextn_tensors(spec: TinySpec, target) -> dict[str, torch.Tensor]:
    """The NextN layers' tensors by checkpoint name, as DeepSeek ships them: for index
    L = layers + k, the decoder layer that transformers' own classes build and save for
    index L (taken from a model with L + 1 layers, so its MoE/dense type and names are
    transformers'), random ``enorm``/``hnorm``/``shared_head.norm`` (not all ones, so
    that a swapped norm shows) and ``eh_proj``, and copies of ``target``'s embedding and
    LM head as ``embed_tokens`` and ``shared_head.head``."""
    import tempfile

    from safetensors.torch import load_file
    from transformers import DeepseekV32ForCausalLM

    n_layers = spec.layers + spec.num_nextn_predict_layers
    torch.manual_seed(spec.seed + NEXTN_SEED_OFFSET)
    donor = DeepseekV32ForCausalLM(hf_config(spec, layers=n_layers)).eval()
    with tempfile.TemporaryDirectory() as tmp:
        donor.save_pretrained(tmp)
        saved: dict[str, torch.Tensor] = {}
        for file in sorted(Path(tmp).glob("*.safetensors")):
            saved.update(load_file(str(file)))
    g = torch.Generator().manual_seed(spec.seed + NEXTN_SEED_OFFSET)
    hidden = spec.hidden
    out: dict[str, torch.Tensor] = {}
    for index in range(spec.layers, n_layers):
        prefix = f"model.layers.{index}."
        for name, tensor in saved.items():
            if name.startswith(prefix):
                out[name] = tensor.clone()
        gate_bias = prefix + "mlp.gate.e_score_correction_bias"
        if gate_bias in out:  # as build_hf_model does for the target's MoE layers
            out[gate_bias] = torch.randn(out[gate_bias].shape, generator=g) * 0.05
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            out[f"{prefix}{norm}.weight"] = 1.0 + 0.2 * torch.randn(hidden, generator=g)
        out[prefix + "eh_proj.weight"] = spec.init_std * torch.randn(
            hidden, 2 * hidden, generator=g
        )
        out[prefix + "embed_tokens.weight"] = target.model.embed_tokens.weight.detach().clone()
        out[prefix + "shared_head.head.weight"] = target.lm_head.weight.detach().clone()
    return {name: t.contiguous() for name, t in out.items()}


def _write_nextn(out: Path, spec: TinySpec, target) -> None:
    """The NextN tensors in a file of their own, listed in the shard index if there is one
    (transformers then loads them as unexpected keys, and drops them)."""
    from safetensors.torch import save_file

    tensors = nextn_tensors(spec, target)
    save_file(tensors, str(out / NEXTN_FILE), metadata={"format": "pt"})
    index_file = out / "model.safetensors.index.json"
    if index_file.is_file():
        index = json.loads(index_file.read_text())
        index["weight_map"].update(dict.fromkeys(tensors, NEXTN_FILE))
        index_file.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def make_tiny_checkpoint(out_dir: str | Path, spec: TinySpec | None = None) -> Path:
    spec = spec or TinySpec()
    if spec.num_nextn_predict_layers < 0:
        raise ValueError(
            f"num_nextn_predict_layers must be >= 0, got {spec.num_nextn_predict_layers}"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = build_hf_model(spec)
    model.save_pretrained(str(out), max_shard_size="15MB")
    if spec.num_nextn_predict_layers:
        _write_nextn(out, spec, model)
    save_byte_tokenizer(out)
    fields = asdict(spec)
    if not spec.num_nextn_predict_layers:  # the spec file as it was before the field
        del fields["num_nextn_predict_layers"]
    (out / "tiny_spec.json").write_text(json.dumps(fields, indent=2))
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
