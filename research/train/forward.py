"""Differentiable full-sequence forward over our model's own modules, for training.

The inference model (``sglang_echo.model``) runs MLA in its absorbed form over a KV cache
under ``inference_mode``. Training needs gradients and whole sequences, so this forward
reads the same parameters but expands keys and values per head (q_nope . k_nope +
q_rope . k_rope equals the absorbed product) and hands them to
``scaled_dot_product_attention``: flash attention for the dense causal phase, a boolean
top-k mask for the sparse phase. Its logits equal the inference model's (tested in float32).

The indexer (DSA) sees detached inputs, so its only training signal is the KL divergence
from the main attention: per layer, on a subsample of query rows, KL(p || softmax(I)) where
p is the head-averaged attention distribution (over the causal keys, or over the selected
top-k in the sparse phase) and I the indexer scores over the same keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from sglang_echo.model.indexer import index_scores, select_topk

MODES = ("dense", "sparse")
# Largest [batch x rows x index-heads x keys] float32 score block built for selection.
SELECT_BLOCK_ELEMENTS = 1 << 27
# Pinned SDPA backends: flash for causal attention; the memory-efficient kernel (which
# takes a broadcast boolean mask without materializing it per head) for top-k masks.
CAUSAL_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
MASKED_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass
class ForwardOutput:
    lm_loss: torch.Tensor | None  # mean next-token cross entropy (nats)
    kl_loss: torch.Tensor | None  # mean over layers of the indexer KL (nats)
    kl_per_layer: list[torch.Tensor]
    logits: torch.Tensor | None  # [B, T, V] float32 when asked for


def _compute_dtype(device: torch.device, fallback: torch.dtype) -> torch.dtype:
    kind = device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return fallback


def _no_autocast(device: torch.device) -> torch.autocast:
    return torch.autocast(device.type, enabled=False)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """SDPA over [B, H, T, d]; ``allowed`` [B, T, T] bool (None = causal). Head dims are
    zero-padded to one size so the flash kernel (equal q/k/v dims) can take them."""
    dq, dv = q.shape[-1], v.shape[-1]
    d = max(dq, dv)
    if dq < d:
        q, k = F.pad(q, (0, d - dq)), F.pad(k, (0, d - dq))
    if dv < d:
        v = F.pad(v, (0, d - dv))
    if allowed is None:
        with sdpa_kernel(CAUSAL_BACKENDS):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        with sdpa_kernel(MASKED_BACKENDS):
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=allowed.unsqueeze(1), scale=scale
            )
    return out[..., :dv]


@torch.no_grad()
def topk_mask(
    iq: torch.Tensor,
    iw: torch.Tensor,
    ik: torch.Tensor,
    topk: int,
    softmax_scale: float,
    exact: bool = False,
) -> torch.Tensor:
    """Boolean [B, T, T]: key s is attended by query t iff s <= t and s is in t's top-k.

    ``exact`` uses the inference selection (stable sort, ties to the lower position);
    otherwise ``torch.topk`` (faster; tie order unspecified, which only matters for
    exactly equal scores). Scores are float32 as at inference.
    """
    batch, seq, heads, _ = iq.shape
    device = iq.device
    allowed = torch.zeros(batch, seq, seq, dtype=torch.bool, device=device)
    key_pos = torch.arange(seq, device=device)
    rows = max(1, SELECT_BLOCK_ELEMENTS // (batch * heads * seq))
    with _no_autocast(device):
        keys = ik.float()
        for s in range(0, seq, rows):
            e = min(seq, s + rows)
            scores = index_scores(iq[:, s:e].float(), iw[:, s:e].float(), keys, softmax_scale)
            query_pos = torch.arange(s, e, device=device)
            block = allowed[:, s:e]
            if exact:
                pos = select_topk(scores, query_pos.expand(batch, -1), topk)
                # -1 (no key) entries point at the row's first pick, always a real key.
                pos = torch.where(pos >= 0, pos, pos[..., :1])
                block.scatter_(-1, pos, True)
            else:
                masked = scores.masked_fill(key_pos > query_pos[:, None], float("-inf"))
                idx = masked.topk(min(topk, seq), dim=-1).indices
                block.scatter_(-1, idx, True)
            block &= key_pos[None, None, :] <= query_pos[None, :, None]
    return allowed


def indexer_kl(
    q: torch.Tensor,
    k: torch.Tensor,
    iq: torch.Tensor,
    iw: torch.Tensor,
    ik: torch.Tensor,
    rows: torch.Tensor,
    allowed: torch.Tensor | None,
    scale: float,
    softmax_scale: float,
) -> torch.Tensor:
    """Mean over (batch, rows) of KL(p || softmax(I)) for the query positions ``rows``.

    q, k [B, H, T, d] main attention (target, no gradient); iq [B, T, Hi, D], iw [B, T, Hi],
    ik [B, T, D] the indexer's (gradient flows into them).
    """
    device = q.device
    seq = q.shape[2]
    with torch.no_grad(), _no_autocast(device):
        if allowed is None:
            key_pos = torch.arange(seq, device=device)
            mask = (key_pos[None, :] <= rows[:, None]).expand(q.shape[0], -1, -1)
        else:
            mask = allowed[:, rows]
        logits = torch.matmul(q[:, :, rows].float(), k.float().transpose(-1, -2)) * scale
        logits = logits.masked_fill(~mask[:, None], float("-inf"))
        target = torch.softmax(logits, dim=-1).mean(dim=1)  # [B, R, T], heads summed / H
        log_target = torch.log(target.clamp_min(torch.finfo(torch.float32).tiny))
    with _no_autocast(device):
        scores = index_scores(iq[:, rows].float(), iw[:, rows].float(), ik.float(), softmax_scale)
        log_q = torch.log_softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        log_q = log_q.masked_fill(~mask, 0.0)
        terms = torch.where(target > 0, target * (log_target - log_q), torch.zeros_like(log_q))
        return terms.sum(dim=-1).mean()


def _layer_forward(
    layer: nn.Module,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    shape: tuple[int, int],
    mode: str,
    kl_rows: torch.Tensor | None,
    exact_topk: bool,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    batch, seq = shape
    n = batch * seq
    attn = layer.self_attn
    heads = attn.n_heads
    x = layer.input_layernorm(hidden)
    q_resid = attn.q_a_layernorm(attn.q_a_proj(x))
    q = attn.q_b_proj(q_resid).view(n, heads, attn.nope_dim + attn.rope_dim)
    q_nope, q_pe = q.split([attn.nope_dim, attn.rope_dim], dim=-1)
    latent, k_pe = attn.kv_a_proj_with_mqa(x).split([attn.kv_lora_rank, attn.rope_dim], dim=-1)
    latent = attn.kv_a_layernorm(latent)
    q_pe = attn._rope(q_pe, cos, sin)
    k_pe = attn._rope(k_pe.unsqueeze(1), cos, sin)
    k_nope, v = (
        attn.kv_b_proj(latent)
        .view(n, heads, attn.nope_dim + attn.v_dim)
        .split([attn.nope_dim, attn.v_dim], dim=-1)
    )
    q_full = torch.cat((q_nope.to(dtype), q_pe.to(dtype)), dim=-1)
    k_full = torch.cat((k_nope.to(dtype), k_pe.to(dtype).expand(-1, heads, -1)), dim=-1)

    def heads_first(t: torch.Tensor) -> torch.Tensor:
        return t.view(batch, seq, heads, -1).transpose(1, 2)

    q4, k4, v4 = heads_first(q_full), heads_first(k_full), heads_first(v.to(dtype))

    indexer = attn.indexer
    ik = indexer.project_key(x.detach(), cos, sin).view(batch, seq, indexer.head_dim)
    iq, iw = indexer.project_query(x.detach(), q_resid.detach(), cos, sin)
    iq = iq.view(batch, seq, indexer.n_heads, indexer.head_dim)
    iw = iw.view(batch, seq, indexer.n_heads)
    allowed = None
    if mode == "sparse":
        allowed = topk_mask(iq, iw, ik, indexer.topk, indexer.softmax_scale, exact_topk)
    out = attention(q4, k4, v4, allowed, attn.scale)
    kl = None
    if kl_rows is not None:
        kl = indexer_kl(q4, k4, iq, iw, ik, kl_rows, allowed, attn.scale, indexer.softmax_scale)
    out = out.transpose(1, 2).reshape(n, heads * attn.v_dim)
    hidden = hidden + attn.o_proj(out)
    hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return hidden, kl


def train_forward(
    model: nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor | None = None,
    mode: str = "dense",
    kl_rows: torch.Tensor | None = None,
    exact_topk: bool = False,
    return_logits: bool = False,
) -> ForwardOutput:
    """Forward ``input_ids`` [B, T] through ``model`` (our DeepseekV32ForCausalLM).

    mode "dense": causal attention over every key; "sparse": each query attends only to
    its indexer top-k (``config.index_topk``), as at inference. ``kl_rows`` [R] (query
    positions) turns on the indexer KL. Runs under an outer autocast if one is active.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    batch, seq = input_ids.shape
    config = model.config
    if seq > config.max_position_embeddings:
        raise ValueError(
            f"sequence length {seq} exceeds max_position_embeddings "
            f"{config.max_position_embeddings}; lower --seq-len."
        )
    if config.indexer_mode != "bf16":
        raise ValueError("training supports indexer_mode 'bf16' only (fp8 is an inference format)")
    device = input_ids.device
    dtype = _compute_dtype(device, model.lm_head.weight.dtype)
    positions = torch.arange(seq, device=device).repeat(batch)
    cos, sin = model.rotary().cos_sin(positions, dtype)
    hidden = model.model.embed_tokens(input_ids).view(batch * seq, -1)
    kls: list[torch.Tensor] = []
    for layer in model.model.layers:
        hidden, kl = _layer_forward(
            layer, hidden, cos, sin, (batch, seq), mode, kl_rows, exact_topk, dtype
        )
        if kl is not None:
            kls.append(kl)
    logits = model.lm_head(model.model.norm(hidden)).float()
    lm_loss = None
    if labels is not None:
        lm_loss = F.cross_entropy(logits, labels.reshape(-1))
    return ForwardOutput(
        lm_loss=lm_loss,
        kl_loss=torch.stack(kls).mean() if kls else None,
        kl_per_layer=kls,
        logits=logits.view(batch, seq, -1) if return_logits else None,
    )
