"""Rotary position embeddings: default and YaRN frequencies, interleaved and half-split forms.

MLA ropes its 64-d key in DeepSeek's interleaved pair layout while the indexer ropes the
first dims of its 128-d key half-split; both read the same cos/sin table.
"""

from __future__ import annotations

import math

import torch

from sglang_echo.model.config import RopeConfig


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies for ``dim`` rotary dims and the factor applied to cos/sin."""
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if rope.rope_type == "default":
        return 1.0 / pos_freqs, 1.0

    factor = rope.factor
    if rope.attention_factor is not None:
        cos_sin_factor = rope.attention_factor
    elif rope.mscale and rope.mscale_all_dim:
        cos_sin_factor = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(
            factor, rope.mscale_all_dim
        )
    else:
        cos_sin_factor = _yarn_mscale(factor)

    original = rope.original_max_position_embeddings or 4096

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(cos_sin_factor)


def attention_softmax_scale(rope: RopeConfig, qk_head_dim: int) -> float:
    """MLA's score scale: 1/sqrt(d), times mscale(all_dim)^2 under YaRN."""
    scale = qk_head_dim**-0.5
    if rope.rope_type == "yarn" and rope.mscale_all_dim:
        m = _yarn_mscale(rope.factor, rope.mscale_all_dim)
        scale = scale * m * m
    return scale


class RotaryTable:
    """cos/sin for given positions; ``cos``/``sin`` come back as [T, dim] in ``dtype``."""

    def __init__(self, rope: RopeConfig, dim: int, device: torch.device) -> None:
        inv_freq, self.cos_sin_factor = rope_inv_freq(rope, dim)
        self.inv_freq = inv_freq.to(device)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.cos_sin_factor
        sin = emb.sin() * self.cos_sin_factor
        return cos.to(dtype), sin.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split rope. ``x`` is [T, ..., dim]; cos/sin [T, dim] broadcast over middle dims."""
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    cos, sin = cos.view(shape), sin.view(shape)
    return x * cos + _rotate_half(x) * sin


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's pairwise rope; the result is laid out de-interleaved ([evens', odds']).

    Queries and keys are both permuted the same way, so their dot products are unchanged.
    """
    half = cos.shape[-1] // 2
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = cos[..., :half].reshape(shape), sin[..., :half].reshape(shape)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
