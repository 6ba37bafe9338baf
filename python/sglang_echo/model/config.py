"""DeepSeek-V3.2 model configuration read from a Hugging Face ``config.json``.

Only the fields the inference path needs are kept, validated up front so that a wrong
checkpoint fails here with a message instead of deep inside a matmul.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from sglang_echo.kernels.fp8_kv import kv_storage

SUPPORTED_MODEL_TYPES = ("deepseek_v32",)
SUPPORTED_ARCHITECTURES = ("DeepseekV32ForCausalLM",)
INDEXER_MODES = ("bf16", "fp8_hadamard")


class ModelConfigError(ValueError):
    """The checkpoint's configuration cannot be served by this model code."""


def fp8_row_bytes(dim: int) -> int:
    """Bytes the model caches per fp8 index key: D key bytes + a 4-byte scale, padded to a
    multiple of 16. On an H200 the decode logits kernel took about twice as long over
    SGLang's unpadded 132-byte rows as over 144-byte rows at 48 x 100K, in each of three
    runs (benchmark/results/indexer.json; the evidence row "fp8 indexer logits (decode)"):
    a 132-byte stride leaves rows only 4-byte aligned, so no vector loads.
    The 12 bytes are a small share of a token's per-layer cache (656 B of MLA KV + the
    key)."""
    return (dim + 4 + 15) // 16 * 16


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (``default`` or ``yarn``)."""

    rope_type: str
    theta: float
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class DeepseekV32Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    mlp_layer_types: tuple[str, ...]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    rope_interleave: bool = True
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = 0
    eos_token_ids: tuple[int, ...] = (1,)
    indexer_mode: str = "bf16"
    # Layers at index >= this are MoE; it extends the MLP rule past the decoder layers, to
    # the multi-token-prediction (NextN) layers (``mlp_layer_type``).
    first_k_dense_replace: int = 3
    # DeepSeek's NextN (MTP) layers, stored after the decoder layers as model.layers.{L}.*
    # with L = num_hidden_layers; the target model never runs them (model/nextn.py).
    num_nextn_predict_layers: int = 0
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_row_dim(self) -> int:
        """Values cached per token per layer: the latent plus the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def index_row_dim(self) -> int:
        """Elements cached per token for the indexer: D values, or in fp8 mode D key bytes +
        4 scale bytes padded to a multiple of 16 (``fp8_row_bytes``)."""
        if self.indexer_mode == "fp8_hadamard":
            return fp8_row_bytes(self.index_head_dim)
        return self.index_head_dim

    def mlp_layer_type(self, layer_id: int) -> str:
        """'dense' or 'sparse' (MoE) for layer index ``layer_id``: the decoder layers' own
        entry, and past them (the NextN layers) the rule the config derives them by."""
        if layer_id < 0:
            raise ValueError(f"layer index must be >= 0, got {layer_id}")
        if layer_id < self.num_hidden_layers:
            return self.mlp_layer_types[layer_id]
        return "sparse" if layer_id >= self.first_k_dense_replace else "dense"

    def nextn_layer_config(self) -> DeepseekV32Config:
        """The config of the first NextN layer seen as a one-layer model: its MLP type at
        index ``num_hidden_layers`` becomes layer 0's, so the ordinary ``DecoderLayer``
        builds it and ``PlainKVCache.for_model`` sizes its own one-layer KV pool."""
        if self.num_nextn_predict_layers < 1:
            raise ModelConfigError(
                "the config has no NextN (multi-token-prediction) layer: "
                "num_nextn_predict_layers is 0."
            )
        kind = self.mlp_layer_type(self.num_hidden_layers)
        return replace(
            self, num_hidden_layers=1, mlp_layer_types=(kind,), num_nextn_predict_layers=0
        )

    def index_row_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return torch.uint8 if self.indexer_mode == "fp8_hadamard" else model_dtype

    def kv_storage(self, model_dtype: torch.dtype, kv_cache_dtype: str) -> tuple[int, torch.dtype]:
        """(row width, tensor dtype) of a KV pool for ``--kv-cache-dtype`` (fp8 rows are
        bytes); raises ValueError, saying what to use, for widths fp8 tiles cannot cover."""
        return kv_storage(self.kv_lora_rank, self.qk_rope_head_dim, model_dtype, kv_cache_dtype)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], source: str = "config") -> DeepseekV32Config:
        model_type = cfg.get("model_type")
        architectures = cfg.get("architectures") or []
        if model_type not in SUPPORTED_MODEL_TYPES:
            arch = ", ".join(architectures) or "unknown architecture"
            raise ModelConfigError(
                f"{source}: model_type {model_type!r} ({arch}) is not a DeepSeek-V3.2 (DSA) "
                f"model; sglang-echo serves model_type 'deepseek_v32' "
                f"({', '.join(SUPPORTED_ARCHITECTURES)}) only."
            )
        required = [
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "kv_lora_rank",
            "q_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
            "index_n_heads",
            "index_head_dim",
            "index_topk",
        ]
        missing = [k for k in required if cfg.get(k) is None]
        if missing:
            raise ModelConfigError(f"{source}: missing required DeepSeek-V3.2 fields {missing}.")

        nextn = cfg.get("num_nextn_predict_layers", 0)
        if nextn is None:
            nextn = 0
        if isinstance(nextn, bool) or not isinstance(nextn, int) or nextn < 0:
            raise ModelConfigError(
                f"{source}: num_nextn_predict_layers must be an integer >= 0 (the count of "
                f"multi-token-prediction layers after the decoder layers), got {nextn!r}."
            )
        n_layers = int(cfg["num_hidden_layers"])
        layer_types = cfg.get("mlp_layer_types")
        first_dense = cfg.get("first_k_dense_replace")
        if layer_types is None:
            first_dense = 3 if first_dense is None else int(first_dense)
            n_dense = min(first_dense, n_layers)
            layer_types = ["dense"] * n_dense + ["sparse"] * (n_layers - n_dense)
        elif first_dense is None:  # the leading dense layers the list shows (all: NextN too)
            first_dense = next(
                (i for i, t in enumerate(layer_types) if t != "dense"), n_layers + nextn
            )
        if len(layer_types) != n_layers or any(t not in ("dense", "sparse") for t in layer_types):
            raise ModelConfigError(
                f"{source}: mlp_layer_types must list 'dense' or 'sparse' for each of the "
                f"{n_layers} layers, got {layer_types!r}."
            )

        eos = cfg.get("eos_token_id", 1)
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        indexer_mode = cfg.get("indexer_mode", "bf16")
        if indexer_mode not in INDEXER_MODES:
            raise ModelConfigError(
                f"{source}: indexer_mode {indexer_mode!r} is not one of {INDEXER_MODES}."
            )
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ModelConfigError(f"{source}: hidden_act {act!r} is not supported (only 'silu').")

        config = cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg.get("intermediate_size", 18432)),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size", 2048)),
            num_hidden_layers=n_layers,
            num_attention_heads=int(cfg["num_attention_heads"]),
            q_lora_rank=int(cfg["q_lora_rank"]),
            kv_lora_rank=int(cfg["kv_lora_rank"]),
            qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
            qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
            v_head_dim=int(cfg["v_head_dim"]),
            n_routed_experts=int(cfg.get("n_routed_experts", 256)),
            n_shared_experts=int(cfg.get("n_shared_experts", 1)),
            num_experts_per_tok=int(cfg.get("num_experts_per_tok", 8)),
            n_group=int(cfg.get("n_group", 1) or 1),
            topk_group=int(cfg.get("topk_group", 1) or 1),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            mlp_layer_types=tuple(layer_types),
            index_n_heads=int(cfg["index_n_heads"]),
            index_head_dim=int(cfg["index_head_dim"]),
            index_topk=int(cfg["index_topk"]),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 163840)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=_parse_rope(cfg, source),
            rope_interleave=bool(cfg.get("rope_interleave", True)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            hidden_act=act,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            indexer_mode=indexer_mode,
            first_k_dense_replace=int(first_dense),
            num_nextn_predict_layers=nextn,
            raw=dict(cfg),
        )
        config._check_shapes(source)
        return config

    def _check_shapes(self, source: str) -> None:
        if self.qk_rope_head_dim % 2:
            raise ModelConfigError(f"{source}: qk_rope_head_dim must be even.")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ModelConfigError(
                f"{source}: index_head_dim ({self.index_head_dim}) must be >= qk_rope_head_dim "
                f"({self.qk_rope_head_dim}): the indexer ropes its first qk_rope_head_dim dims."
            )
        nextn_types = [
            self.mlp_layer_type(self.num_hidden_layers + k)
            for k in range(self.num_nextn_predict_layers)
        ]
        if "sparse" in self.mlp_layer_types or "sparse" in nextn_types:
            if self.n_routed_experts % self.n_group:
                raise ModelConfigError(f"{source}: n_routed_experts must be divisible by n_group.")
            if self.topk_group > self.n_group:
                raise ModelConfigError(f"{source}: topk_group must be <= n_group.")
            if self.num_experts_per_tok > self.n_routed_experts:
                raise ModelConfigError(
                    f"{source}: num_experts_per_tok must be <= n_routed_experts."
                )
        if self.index_topk < 1:
            raise ModelConfigError(f"{source}: index_topk must be >= 1.")


def _parse_rope(cfg: dict[str, Any], source: str) -> RopeConfig:
    """Accept both transformers-5 ``rope_parameters`` and the older ``rope_scaling`` layout."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return RopeConfig(rope_type="default", theta=theta)
    if rope_type != "yarn":
        raise ModelConfigError(f"{source}: rope type {rope_type!r} unsupported (default, yarn).")
    original = params.get("original_max_position_embeddings") or cfg.get(
        "max_position_embeddings", 163840
    )
    factor = params.get("factor")
    if factor is None:
        factor = float(cfg.get("max_position_embeddings", original)) / float(original)

    def _opt(key: str) -> float | None:
        value = params.get(key)
        return None if value is None else float(value)

    return RopeConfig(
        rope_type="yarn",
        theta=theta,
        factor=float(factor),
        original_max_position_embeddings=int(original),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=_opt("mscale"),
        mscale_all_dim=_opt("mscale_all_dim"),
        attention_factor=_opt("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )


def load_config(model_path: str | Path) -> DeepseekV32Config:
    path = Path(model_path)
    if not path.exists():
        raise ModelConfigError(f"model path {str(path)!r} does not exist.")
    if not path.is_dir():
        raise ModelConfigError(
            f"model path {str(path)!r} is not a directory; pass the checkpoint folder that "
            "holds config.json and *.safetensors."
        )
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelConfigError(f"{str(path)!r} has no config.json; is it a checkpoint folder?")
    try:
        data = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelConfigError(f"cannot read {cfg_file}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelConfigError(f"{cfg_file} does not hold a JSON object.")
    return DeepseekV32Config.from_dict(data, source=str(cfg_file))
