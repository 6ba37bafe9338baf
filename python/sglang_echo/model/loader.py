"""Build the model from a checkpoint folder: config.json + *.safetensors, by tensor name."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open

from sglang_echo.model.config import DeepseekV32Config, ModelConfigError, load_config
from sglang_echo.model.deepseek_v32 import DeepseekV32ForCausalLM

# Kept in float32 whatever the model dtype, as in the reference implementation.
FP32_PARAM_PATTERNS = (r"\.e_score_correction_bias$", r"\.indexer\.weights_proj\.weight$")
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
_PACKED_EXPERTS_RE = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
FP8_BLOCK = 128


def _read_tensors(files: list[Path], num_layers: int) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                    m = _LAYER_RE.match(name)
                    if m and int(m.group(1)) >= num_layers:
                        continue  # multi-token-prediction layers: not used for serving
                    tensors[name] = handle.get_tensor(name)
        except Exception as exc:  # safetensors raises its own error types
            raise ModelConfigError(f"cannot read weights file {file}: {exc}") from exc
    return tensors


def _unpack_experts(tensors: dict[str, torch.Tensor]) -> None:
    """transformers-style packed experts [E, 2I, H] / [E, H, I] -> per-expert checkpoint names."""
    for name in [n for n in tensors if _PACKED_EXPERTS_RE.match(n)]:
        prefix, kind = _PACKED_EXPERTS_RE.match(name).groups()
        packed = tensors.pop(name)
        for e in range(packed.shape[0]):
            if kind == "gate_up_proj":
                gate, up = packed[e].chunk(2, dim=0)
                tensors[f"{prefix}.{e}.gate_proj.weight"] = gate
                tensors[f"{prefix}.{e}.up_proj.weight"] = up
            else:
                tensors[f"{prefix}.{e}.down_proj.weight"] = packed[e]


def _dequantize_fp8_blocks(tensors: dict[str, torch.Tensor]) -> None:
    """DeepSeek's released fp8 weights: 128x128 blocks, each with an fp32 inverse scale."""
    for scale_name in [n for n in tensors if n.endswith(".weight_scale_inv")]:
        weight_name = scale_name[: -len("_scale_inv")]
        scale = tensors.pop(scale_name).float()
        weight = tensors[weight_name].float()
        rows, cols = weight.shape
        expanded = scale.repeat_interleave(FP8_BLOCK, 0)[:rows].repeat_interleave(FP8_BLOCK, 1)
        tensors[weight_name] = (weight * expanded[:, :cols]).to(torch.bfloat16)


def load_model(
    model_path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> DeepseekV32ForCausalLM:
    config = load_config(model_path)
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise ModelConfigError(f"{str(model_path)!r} has no *.safetensors weight files.")
    tensors = _read_tensors(files, config.num_hidden_layers)
    _unpack_experts(tensors)
    _dequantize_fp8_blocks(tensors)
    if config.tie_word_embeddings and "lm_head.weight" not in tensors:
        tensors["lm_head.weight"] = tensors.get("model.embed_tokens.weight")

    with torch.device("meta"):
        model = DeepseekV32ForCausalLM(config)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors))
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ModelConfigError(
            f"checkpoint {str(model_path)!r} lacks {len(missing)} tensors the config implies "
            f"(e.g. {shown}); is config.json from the same model as the weights?"
        )
    state = {}
    for name, ref in expected.items():
        t = tensors[name]
        if tuple(t.shape) != tuple(ref.shape):
            raise ModelConfigError(
                f"tensor {name} has shape {tuple(t.shape)} but config.json implies "
                f"{tuple(ref.shape)}."
            )
        keep_fp32 = any(re.search(p, name) for p in FP32_PARAM_PATTERNS)
        state[name] = t.to(device=device, dtype=torch.float32 if keep_fp32 else dtype)
    model.load_state_dict(state, assign=True, strict=True)
    return model.eval()


def model_dtype(name: str) -> torch.dtype:
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in table:
        raise ValueError(f"--dtype must be one of {sorted(table)}, got {name!r}")
    return table[name]


__all__ = ["DeepseekV32Config", "load_model", "model_dtype"]
