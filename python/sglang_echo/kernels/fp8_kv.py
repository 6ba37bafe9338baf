"""The fp8 MLA KV row (``--kv-cache-dtype fp8_e4m3``), SGLang's and FlashMLA's layout.

One token's row is bytes: the latent part as float8 e4m3 in tiles of ``FP8_TILE`` (128)
values, one float32 scale per tile after it, then the rope key as bfloat16, unquantized:

    [ latent: r bytes e4m3 | r / 128 scales: float32 | rope: d x bfloat16 ]

656 bytes at DeepSeek-V3.2's r = 512, d = 64, against 1152 in bfloat16. Why this layout:
it is the one SGLang's NSA backend stores and FlashMLA's sparse decode reads, so host
pools, caches and transfers carry the same bytes; the rope key stays bf16 because rotary
positions lose precision fast in fp8. A tile's scale is amax / 448 (e4m3's largest
normal), so the tile's largest value maps to the top of the range; an all-zero tile gets
scale 1. Dequantizing is exact arithmetic given the bytes (e4m3 -> float32, times the
float32 scale, rounded once to bfloat16), so every reader of a row (the torch path, the
kernel in registers) sees the same bf16 values, and offload stays bit-identical to
no-offload at the same KV dtype. At r = 512 and d = 64 a row is 41 x 16 bytes, so rows
stay 16-byte aligned; narrower test models get rows that are only 4-byte aligned (the
scales' float32 loads need no more), which the kernels handle at narrower vectors.
"""

from __future__ import annotations

import torch

FP8_TILE = 128  # latent values per float32 scale
E4M3_MAX = 448.0
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8_e4m3")  # SGLang's --kv-cache-dtype names we take


def fp8_row_bytes(kv_lora_rank: int, rope_dim: int) -> int:
    """Bytes of one fp8 KV row; raises for latent widths the tiles cannot cover."""
    if kv_lora_rank % FP8_TILE:
        raise ValueError(
            f"fp8 KV needs kv_lora_rank to be a multiple of {FP8_TILE} (one scale per tile), "
            f"got {kv_lora_rank}; use --kv-cache-dtype auto for this model"
        )
    return kv_lora_rank + 4 * (kv_lora_rank // FP8_TILE) + 2 * rope_dim


def quantize_kv_rows(rows: torch.Tensor, kv_lora_rank: int) -> torch.Tensor:
    """[T, r + d] rows (any float dtype) -> [T, fp8_row_bytes] uint8."""
    t, width = rows.shape
    rope = width - kv_lora_rank
    out = torch.empty(t, fp8_row_bytes(kv_lora_rank, rope), dtype=torch.uint8, device=rows.device)
    lat = rows[:, :kv_lora_rank].float().view(t, -1, FP8_TILE)
    amax = lat.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    codes = (lat / scale.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    n_tiles = kv_lora_rank // FP8_TILE
    out[:, :kv_lora_rank] = codes.view(t, kv_lora_rank).view(torch.uint8)
    out[:, kv_lora_rank : kv_lora_rank + 4 * n_tiles] = scale.contiguous().view(torch.uint8)
    rope_bf16 = rows[:, kv_lora_rank:].to(torch.bfloat16).contiguous()
    out[:, kv_lora_rank + 4 * n_tiles :] = rope_bf16.view(torch.uint8)
    return out


def dequantize_kv_rows(
    packed: torch.Tensor, kv_lora_rank: int, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """[..., fp8_row_bytes] uint8 -> [..., r + d] rows in ``dtype`` (the latent rounded
    once from float32 to ``dtype``; the rope key exact)."""
    lead = packed.shape[:-1]
    flat = packed.reshape(-1, packed.shape[-1])
    n_tiles = kv_lora_rank // FP8_TILE
    codes = flat[:, :kv_lora_rank].contiguous().view(torch.float8_e4m3fn).float()
    scale = flat[:, kv_lora_rank : kv_lora_rank + 4 * n_tiles].contiguous().view(torch.float32)
    lat = (codes.view(-1, n_tiles, FP8_TILE) * scale.unsqueeze(-1)).view(-1, kv_lora_rank)
    rope = flat[:, kv_lora_rank + 4 * n_tiles :].contiguous().view(torch.bfloat16)
    out = torch.cat((lat.to(dtype), rope.to(dtype)), dim=-1)
    return out.view(*lead, out.shape[-1])


def kv_storage(
    kv_lora_rank: int, rope_dim: int, model_dtype: torch.dtype, kv_cache_dtype: str
) -> tuple[int, torch.dtype]:
    """(row width, tensor dtype) a KV pool stores for ``--kv-cache-dtype``: the model's
    rows as they are ("auto"/"bfloat16": the model dtype), or fp8 rows as bytes."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}"
        )
    if kv_cache_dtype == "fp8_e4m3":
        return fp8_row_bytes(kv_lora_rank, rope_dim), torch.uint8
    if kv_cache_dtype == "bfloat16" and model_dtype != torch.bfloat16:
        raise ValueError(
            f"--kv-cache-dtype bfloat16 needs a bfloat16 model, this one runs in {model_dtype}; "
            "use auto (the model's dtype) or fp8_e4m3"
        )
    return kv_lora_rank + rope_dim, model_dtype


def encode_kv_rows(rows: torch.Tensor, kv_lora_rank: int, storage: torch.dtype) -> torch.Tensor:
    """Model rows -> what a pool of ``storage`` dtype keeps (fp8 rows for uint8)."""
    if storage == torch.uint8:
        return quantize_kv_rows(rows, kv_lora_rank)
    return rows.to(storage)


def decode_kv_rows(stored: torch.Tensor, kv_lora_rank: int, dtype: torch.dtype) -> torch.Tensor:
    """Stored rows (a gather of them) -> the model's rows in ``dtype``."""
    if stored.dtype == torch.uint8:
        return dequantize_kv_rows(stored, kv_lora_rank, dtype)
    return stored
