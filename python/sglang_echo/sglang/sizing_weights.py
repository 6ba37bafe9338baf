"""One GPU's share of the model's weights, before any weight loads: the early sizing check
(``sizing.py``, at argument resolution) needs them for sglang's static-fraction rule, and
sglang only knows them after the load (minutes on DeepSeek-V3.2's full checkpoint).

Two sources: the checkpoint (``checkpoint_weight_bytes``: every tensor's bytes from the
shards' headers, named by ``model.safetensors.index.json``, checked against its
``total_size``) or, without one, config.json (``weight_bytes``: every weight matrix counted
from the model's dimensions and quantization). Either is split by part
(``split_weights``) as sglang loads each part under TP, DP attention and the MoE layout
(``Parallel``). ``args_sizing.weights_of`` picks the source.

Pure Python (no torch): reads config.json's fields and the shards' headers only.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GiB = 2**30
SCALE_BLOCK = 128  # DSATokenToKVPool.quant_block_size: one fp32 scale per 128 values
INDEX_FILE = "model.safetensors.index.json"
SAFETENSORS_HEADER_LIMIT = 100 * 2**20  # the format's own limit on a header's length
# Tensors of no known part may hold at most this share of a checkpoint read through its
# index; more means another naming than DeepSeek-V3.2's, whose split would be wrong.
UNKNOWN_TENSORS_SHARE = 0.01


def gib(nbytes: float) -> str:
    """Bytes as the messages print them."""
    return f"{nbytes / GiB:.2f} GiB"


@dataclass(frozen=True)
class Parallel:
    """The parallel layout that splits the weights (pipeline parallelism is refused)."""

    tp_size: int = 1
    attn_dp_size: int = 1
    nnodes: int = 1
    enable_dp_lm_head: bool = False
    moe_dense_tp_size: int | None = None

    @property
    def attn_tp_size(self) -> int:
        return max(1, self.tp_size // self.attn_dp_size)

    @property
    def ranks_per_node(self) -> int:
        return max(1, self.tp_size // max(1, self.nnodes))


@dataclass(frozen=True)
class WeightBytes:
    """One GPU's share of the weights, by part."""

    attention: int  # MLA + indexer (+ the absorbed bf16 copies of kv_b), norms
    embeddings: int  # input embedding + lm_head
    dense_mlp: int  # the first_k_dense_replace layers' MLPs
    shared_experts: int
    routed_experts: int
    routers: int  # MoE gates and their bias
    other: int = 0  # checkpoint tensors of no known part, counted whole on every GPU
    source: str = "config.json"  # where the bytes were read

    @property
    def total(self) -> int:
        return (
            self.attention
            + self.embeddings
            + self.dense_mlp
            + self.shared_experts
            + self.routed_experts
            + self.routers
            + self.other
        )

    def lines(self) -> list[str]:
        """The parts, for the summary."""
        other = f", other {gib(self.other)}" if self.other else ""
        return [
            f"weights from {self.source}: attention {gib(self.attention)}, embeddings "
            f"{gib(self.embeddings)}, dense MLPs {gib(self.dense_mlp)},",
            f"  shared experts {gib(self.shared_experts)}, routed experts "
            f"{gib(self.routed_experts)}, routers {gib(self.routers)}{other}",
        ]


_INT_METHODS = ("awq", "awq_marlin", "gptq", "gptq_marlin", "moe_wna16")
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}


class UnknownWeights(ValueError):
    """The config does not say enough to estimate the weights' bytes."""


def _unconverted(quant: Mapping[str, Any], module: str) -> bool:
    names = [*(quant.get("modules_to_not_convert") or []), *(quant.get("ignored_layers") or [])]
    return any(name and name in module for name in names)


def matrix_bytes(
    quant: Mapping[str, Any] | None,
    module: str,
    rows: int,
    cols: int,
    *,
    expert: bool = False,
    dtype_bytes: int = 2,
) -> int:
    """Bytes of one ``[rows, cols]`` linear weight as the checkpoint stores it: fp8 = 1 B
    per value + an fp32 scale per weight block; 4-bit group quantization (AWQ/GPTQ, what
    --quantization moe_wna16 loads) = packed values + an fp16 scale and a packed zero per
    group of inputs; w4afp8 = 4-bit experts with fp32 group scales, fp8 elsewhere;
    unquantized, or a module the config leaves unconverted = the checkpoint's dtype."""
    method = str((quant or {}).get("quant_method", "")).lower()
    if not quant or _unconverted(quant, module):
        return rows * cols * dtype_bytes
    if method == "fp8" or (method == "w4afp8" and not expert):
        block = quant.get("weight_block_size") or [SCALE_BLOCK, SCALE_BLOCK]
        b0, b1 = int(block[0]), int(block[1])
        return rows * cols + 4 * (-(-rows // b0)) * (-(-cols // b1))
    if method == "w4afp8":
        group = int(quant.get("group_size", SCALE_BLOCK))
        return rows * cols // 2 + 4 * rows * (-(-cols // group))
    if method in _INT_METHODS:
        bits = int(quant.get("bits", quant.get("w_bit", 4)))
        group = int(quant.get("group_size", quant.get("q_group_size", SCALE_BLOCK)))
        groups = 1 if group <= 0 else -(-cols // group)
        return rows * cols * bits // 8 + groups * rows * (2 * 8 + bits) // 8
    raise UnknownWeights(f"quantization {method!r}")


def weight_bytes(
    config: Mapping[str, Any], parallel: Parallel, quantization: str | None = None
) -> WeightBytes:
    """One GPU's share of a DeepSeek-V3.2-style (MLA + DSA indexer + MoE) checkpoint,
    counted from config.json: every weight matrix's bytes (``matrix_bytes``), norms and
    gates in the checkpoint's dtype, each part divided as sglang loads it:

    - attention: q_b/q, kv_b, o and sglang's absorbed bf16 copies of kv_b (w_kc, w_vc)
      split by attention-TP (tp / attn_dp); q_a, kv_a, the indexer and norms replicated;
    - the input embedding by attention-TP under DP attention, else by TP; lm_head by TP
      (attention-TP with --enable-dp-lm-head);
    - dense MLPs by TP (replicated with --moe-dense-tp-size 1); shared and routed experts
      by TP (= EP x MoE-TP); gates and their bias replicated.

    Not counted: the MTP layer (loaded only for speculative decoding, which the plugin refuses under ECHO),
    vocabulary padding, per-tensor scalars. ``quantization`` (``--quantization``) applies
    only when config.json has no quantization_config (online fp8). Raises UnknownWeights
    when a field or the quantization is unknown."""
    try:
        h = int(config["hidden_size"])
        vocab = int(config["vocab_size"])
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        kv_lora = int(config["kv_lora_rank"])
        nope, rope = int(config["qk_nope_head_dim"]), int(config["qk_rope_head_dim"])
        v_dim = int(config["v_head_dim"])
        q_lora = int(config.get("q_lora_rank") or 0)
        idx_heads = int(config.get("index_n_heads") or 0)
        idx_dim = int(config.get("index_head_dim") or 0)
        dense_inter = int(config["intermediate_size"])
        moe_inter = int(config.get("moe_intermediate_size") or 0)
        experts = int(config.get("n_routed_experts") or 0)
        shared = int(config.get("n_shared_experts") or 0)
        first_dense = int(config.get("first_k_dense_replace") or 0) if experts else layers
        freq = int(config.get("moe_layer_freq") or 1)
    except (KeyError, TypeError, ValueError) as exc:
        raise UnknownWeights(f"config.json lacks {exc}") from exc
    quant = config.get("quantization_config") or (
        {"quant_method": quantization} if quantization else None
    )
    dt = _DTYPE_BYTES.get(str(config.get("torch_dtype", "bfloat16")), 2)

    def mat(module: str, rows: int, cols: int, expert: bool = False) -> int:
        return matrix_bytes(quant, module, rows, cols, expert=expert, dtype_bytes=dt)

    parts = dict.fromkeys(
        ("attn_split", "attn_replicated", "dense", "shared", "routed", "routers"), 0
    )
    q_in = q_lora or h  # q_b reads the q_a latent; without q_lora, q_proj reads the hidden
    for i in range(layers):
        attn = f"model.layers.{i}.self_attn"
        parts["attn_split"] += (
            mat(f"{attn}.q_b_proj" if q_lora else f"{attn}.q_proj", heads * (nope + rope), q_in)
            + mat(f"{attn}.kv_b_proj", heads * (nope + v_dim), kv_lora)
            + mat(f"{attn}.o_proj", h, heads * v_dim)
        )
        parts["attn_replicated"] += (
            mat(f"{attn}.kv_a_proj_with_mqa", kv_lora + rope, h)
            + dt * (kv_lora + 2 * h)  # kv_a_layernorm, input and post-attention norms
            + (mat(f"{attn}.q_a_proj", q_lora, h) + dt * q_lora if q_lora else 0)
        )
        if idx_heads and idx_dim:
            parts["attn_replicated"] += (
                mat(f"{attn}.indexer.wq_b", idx_heads * idx_dim, q_in)
                + mat(f"{attn}.indexer.wk", idx_dim, h)
                + dt * idx_heads * h  # weights_proj (unquantized)
                + dt * 2 * idx_dim  # k_norm weight and bias
            )
        mlp = f"model.layers.{i}.mlp"
        if i < first_dense or (i - first_dense) % freq:
            parts["dense"] += 2 * mat(mlp, dense_inter, h) + mat(mlp, h, dense_inter)
            continue
        routed = f"{mlp}.experts"
        parts["routed"] += experts * (
            2 * mat(routed, moe_inter, h, True) + mat(routed, h, moe_inter, True)
        )
        one = f"{mlp}.shared_experts"
        parts["shared"] += shared * (2 * mat(one, moe_inter, h) + mat(one, h, moe_inter))
        parts["routers"] += dt * experts * h + 4 * experts  # gate, e_score_correction_bias

    parts["attn_split"] += absorbed_bytes(config)  # w_kc, w_vc (bf16)
    parts["embed"] = parts["lm_head"] = dt * vocab * h
    parts["norm"] = dt * h  # the final norm
    return split_weights(parts, parallel, "config.json")


WEIGHT_PARTS = (
    "attn_split", "attn_replicated", "embed", "lm_head", "norm",
    "dense", "shared", "routed", "routers", "other",
)  # fmt: skip


def split_weights(parts: Mapping[str, int], parallel: Parallel, source: str) -> WeightBytes:
    """One GPU's share of the whole model's bytes by part (``WEIGHT_PARTS``), divided as
    sglang loads each part (``weight_bytes``'s list); a part not given is 0."""

    def part(name: str) -> int:
        return int(parts.get(name, 0))

    def share(nbytes: int, ways: int) -> int:
        return -(-nbytes // max(1, ways))

    tp, attn_tp = max(1, parallel.tp_size), parallel.attn_tp_size
    dense_tp = 1 if parallel.moe_dense_tp_size == 1 else tp
    return WeightBytes(
        attention=share(part("attn_split"), attn_tp) + part("attn_replicated"),
        embeddings=share(part("embed"), attn_tp if parallel.attn_dp_size > 1 else tp)
        + share(part("lm_head"), attn_tp if parallel.enable_dp_lm_head else tp)
        + part("norm"),
        dense_mlp=share(part("dense"), dense_tp),
        shared_experts=share(part("shared"), tp),
        routed_experts=share(part("routed"), tp),
        routers=part("routers"),
        other=part("other"),
        source=source,
    )


def absorbed_bytes(config: Mapping[str, Any]) -> int:
    """sglang's bf16 copies of each layer's kv_b (``w_kc`` [heads, nope, kv_lora] and
    ``w_vc`` [heads, kv_lora, v]), made while loading: in no checkpoint, split like the
    attention projections."""
    heads, kv_lora = int(config["num_attention_heads"]), int(config["kv_lora_rank"])
    per_layer = heads * (int(config["qk_nope_head_dim"]) + int(config["v_head_dim"])) * kv_lora
    return int(config["num_hidden_layers"]) * 2 * per_layer


_SPLIT_ATTENTION = ("q_b_proj", "q_proj", "kv_b_proj", "o_proj")
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def tensor_part(name: str, layers: int) -> str | None:
    """The part (``WEIGHT_PARTS``) of a DeepSeek-V3.2 checkpoint tensor, by its name; None
    for the MTP layer (layer ``num_hidden_layers`` and above: loaded only for speculative
    decoding, which the plugin refuses under ECHO). A name of no known part is "other" (counted whole on
    every GPU, the most it can take)."""
    if name.startswith("model.embed_tokens."):
        return "embed"
    if name.startswith("lm_head."):
        return "lm_head"
    if name.startswith("model.norm."):
        return "norm"
    match = _LAYER.fullmatch(name)
    if match is None:
        return "other"
    if int(match[1]) >= layers:
        return None
    rest = match[2]
    if rest.startswith("self_attn."):
        return "attn_split" if rest.split(".")[1] in _SPLIT_ATTENTION else "attn_replicated"
    if rest.startswith(("input_layernorm.", "post_attention_layernorm.")):
        return "attn_replicated"
    for prefix, found in (
        ("mlp.experts.", "routed"),
        ("mlp.shared_experts.", "shared"),
        ("mlp.gate.", "routers"),  # the router and its e_score_correction_bias
        ("mlp.", "dense"),
    ):
        if rest.startswith(prefix):
            return found
    return "other"


def safetensors_tensor_bytes(path: Path) -> dict[str, int]:
    """Each tensor's bytes in one safetensors file, from its header only (an 8-byte
    little-endian length, then JSON with each tensor's ``data_offsets``)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > SAFETENSORS_HEADER_LIMIT:
            raise ValueError(f"{path}: a {length}-byte header is not safetensors'")
        header = json.loads(f.read(length))
    return {
        name: int(entry["data_offsets"][1]) - int(entry["data_offsets"][0])
        for name, entry in header.items()
        if name != "__metadata__"
    }


def checkpoint_weight_bytes(
    model_dir: str | Path, config: Mapping[str, Any], parallel: Parallel
) -> WeightBytes | None:
    """One GPU's share of the weights as the checkpoint stores them: the tensors that
    ``model.safetensors.index.json`` names, each one's bytes from its shard's header, by
    part (``tensor_part``: MTP left out), plus sglang's absorbed copies, divided as
    ``split_weights`` does. None (use ``weight_bytes``) without an index, when a shard is
    missing or its header unreadable, or when tensors of no known part hold more than
    ``UNKNOWN_TENSORS_SHARE`` of the bytes (not DeepSeek-V3.2's names).

    The index alone maps names to shard files; its ``metadata.total_size`` is the sum
    over every tensor, MTP included, so it cannot be split by part. The headers can (a few
    kilobytes per shard, read without the data), and their sum must equal ``total_size``:
    otherwise the index does not describe these shards and UnknownWeights is raised."""
    model_dir = Path(model_dir)
    index_path = model_dir / INDEX_FILE
    if not index_path.is_file():
        return None
    index = json.loads(index_path.read_text())
    weight_map: Mapping[str, str] = index.get("weight_map") or {}
    total = (index.get("metadata") or {}).get("total_size")
    sizes: dict[str, int] = {}
    try:
        for shard in sorted(set(weight_map.values())):
            sizes.update(safetensors_tensor_bytes(model_dir / shard))
    except (OSError, ValueError, KeyError, struct.error):
        return None
    if total is not None and sum(sizes.values()) != int(total):
        raise UnknownWeights(
            f"{index_path}: its shards hold {sum(sizes.values())} bytes of tensors, its "
            f"metadata.total_size says {total}"
        )
    layers = int(config["num_hidden_layers"])
    parts = dict.fromkeys(WEIGHT_PARTS, 0)
    for name, nbytes in sizes.items():
        part = tensor_part(name, layers)
        if part is not None:
            parts[part] += nbytes
    if parts["other"] > UNKNOWN_TENSORS_SHARE * sum(sizes.values()):
        return None
    parts["attn_split"] += absorbed_bytes(config)
    return split_weights(parts, parallel, f"the checkpoint's {INDEX_FILE}")
