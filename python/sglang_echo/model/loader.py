"""Build the model from a checkpoint folder: config.json + *.safetensors, by tensor name."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from sglang_echo.model.attention import ModelKernels
from sglang_echo.model.config import DeepseekV32Config, ModelConfigError, load_config
from sglang_echo.model.deepseek_v32 import DeepseekV32ForCausalLM
from sglang_echo.model.nextn import NextNLayer

# Kept in float32 whatever the model dtype, as in the reference implementation.
FP32_PARAM_PATTERNS = (r"\.e_score_correction_bias$", r"\.indexer\.weights_proj\.weight$")
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
_PACKED_EXPERTS_RE = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
FP8_BLOCK = 128


def _weight_files(model_path: str | Path) -> list[Path]:
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise ModelConfigError(f"{str(model_path)!r} has no *.safetensors weight files.")
    return files


def _read_tensors(files: list[Path], keep: Callable[[str], bool]) -> dict[str, torch.Tensor]:
    """The tensors whose checkpoint name ``keep`` accepts (the others are never read)."""
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                    if keep(name):
                        tensors[name] = handle.get_tensor(name)
        except Exception as exc:  # safetensors raises its own error types
            raise ModelConfigError(f"cannot read weights file {file}: {exc}") from exc
    return tensors


def _layer_index(name: str) -> int | None:
    m = _LAYER_RE.match(name)
    return int(m.group(1)) if m else None


def _to_checkpoint_layout(tensors: dict[str, torch.Tensor]) -> None:
    """Packed experts unpacked and fp8 blocks dequantized, in place, by checkpoint name."""
    _unpack_experts(tensors)
    _dequantize_fp8_blocks(tensors)


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


def _state_for(
    expected: dict[str, torch.Tensor],
    tensors: dict[str, torch.Tensor],
    device: torch.device | str,
    dtype: torch.dtype,
    what: str,
    prefix: str = "",
) -> dict[str, torch.Tensor]:
    """``tensors`` (by module name) checked against a meta module's ``expected`` state and
    cast to ``dtype`` on ``device``, FP32_PARAM_PATTERNS kept in float32. ``prefix`` turns
    a module name back into its checkpoint name, for messages and the fp32 patterns;
    ``what`` names the checkpoint part in a missing-tensor message."""
    missing = sorted(prefix + n for n in set(expected) - set(tensors))
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ModelConfigError(
            f"{what} lacks {len(missing)} tensors the config implies (e.g. {shown}); is "
            "config.json from the same model as the weights?"
        )
    state = {}
    for name, ref in expected.items():
        t = tensors[name]
        if tuple(t.shape) != tuple(ref.shape):
            raise ModelConfigError(
                f"tensor {prefix + name} has shape {tuple(t.shape)} but config.json implies "
                f"{tuple(ref.shape)}."
            )
        keep_fp32 = any(re.search(p, prefix + name) for p in FP32_PARAM_PATTERNS)
        state[name] = t.to(device=device, dtype=torch.float32 if keep_fp32 else dtype)
    return state


def load_model(
    model_path: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    kernels: ModelKernels | None = None,
) -> DeepseekV32ForCausalLM:
    """The target model; the NextN layers' tensors are not read (``load_nextn``).
    ``kernels``: its kernel choices (the entry points pass their settings'); None: the
    registry's defaults."""
    config = load_config(model_path)
    files = _weight_files(model_path)
    n_layers = config.num_hidden_layers
    tensors = _read_tensors(files, lambda n: (i := _layer_index(n)) is None or i < n_layers)
    _to_checkpoint_layout(tensors)
    if config.tie_word_embeddings and "lm_head.weight" not in tensors:
        tensors["lm_head.weight"] = tensors.get("model.embed_tokens.weight")

    with torch.device("meta"):
        model = DeepseekV32ForCausalLM(config, kernels)
    state = _state_for(
        model.state_dict(), tensors, device, dtype, f"checkpoint {str(model_path)!r}"
    )
    model.load_state_dict(state, assign=True, strict=True)
    return model.eval()


# The target's tensors a NextN layer uses when the checkpoint has no copy of its own.
_NEXTN_FALLBACKS = {
    "embed_tokens.weight": "model.embed_tokens.weight",
    "shared_head.head.weight": "lm_head.weight",
}


def load_nextn(
    model_path: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    target: DeepseekV32ForCausalLM | None = None,
) -> NextNLayer:
    """The checkpoint's first NextN (MTP) layer, from its ``model.layers.{L}.*`` tensors
    (L = num_hidden_layers), laid out and cast as the target's tensors are.

    Without a copy of its own, ``embed_tokens`` / ``shared_head.head`` take the target's
    ``model.embed_tokens`` / ``lm_head`` weights: ``target``'s (shared, not copied), or
    read from the checkpoint. A copy equal to ``target``'s is shared too, so DeepSeek's
    duplicated vocabulary matrices are held once.
    """
    config = load_config(model_path)
    if config.num_nextn_predict_layers < 1:
        raise ModelConfigError(
            f"checkpoint {str(model_path)!r} has no NextN (multi-token-prediction) layer: "
            "its config.json sets no num_nextn_predict_layers >= 1."
        )
    files = _weight_files(model_path)
    prefix = f"model.layers.{config.num_hidden_layers}."
    fallbacks = set(_NEXTN_FALLBACKS.values()) if target is None else set()
    tensors = _read_tensors(files, lambda n: n.startswith(prefix) or n in fallbacks)
    _to_checkpoint_layout(tensors)
    own = {n[len(prefix) :]: t for n, t in tensors.items() if n.startswith(prefix)}
    if not own:
        raise ModelConfigError(
            f"checkpoint {str(model_path)!r}: config.json declares "
            f"num_nextn_predict_layers={config.num_nextn_predict_layers} but the weights "
            f"hold no {prefix}* tensors (was the checkpoint saved without its MTP layer?)."
        )
    if target is None and config.tie_word_embeddings and "lm_head.weight" not in tensors:
        tensors["lm_head.weight"] = tensors.get("model.embed_tokens.weight")
    for name, target_name in _NEXTN_FALLBACKS.items():
        theirs = _target_weight(target, target_name) if target is not None else None
        if name not in own:
            found = theirs if theirs is not None else tensors.get(target_name)
            if found is not None:
                own[name] = found
        elif theirs is not None and _same(own[name], theirs, dtype):
            own[name] = theirs

    with torch.device("meta"):
        layer = NextNLayer(config)
    state = _state_for(
        layer.state_dict(),
        own,
        device,
        dtype,
        f"checkpoint {str(model_path)!r} (its NextN layer)",
        prefix,
    )
    layer.load_state_dict(state, assign=True, strict=True)
    return layer.eval()


def _target_weight(target: DeepseekV32ForCausalLM, name: str) -> torch.Tensor:
    return target.model.embed_tokens.weight if name.startswith("model.") else target.lm_head.weight


def _same(ours: torch.Tensor, theirs: torch.Tensor, dtype: torch.dtype) -> bool:
    """A checkpoint copy equal to the target's weight once cast as the loader casts it."""
    if ours.shape != theirs.shape or theirs.dtype != dtype:
        return False
    return torch.equal(ours.to(device=theirs.device, dtype=dtype), theirs.detach())


def model_dtype(name: str) -> torch.dtype:
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in table:
        raise ValueError(f"--dtype must be one of {sorted(table)}, got {name!r}")
    return table[name]


__all__ = ["DeepseekV32Config", "load_model", "load_nextn", "model_dtype"]
