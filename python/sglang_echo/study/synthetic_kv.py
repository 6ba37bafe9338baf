"""Synthetic prompt KV for a decode node: deterministic MLA rows and indexer keys.

Why: a PD decode node receives each prompt's KV from a prefill node; SGLang benchmarks a
decode node alone with a ``fake`` transfer backend. Here the KV a 100K-token prompt would
bring is generated on the node (on the device, in one pass per layer) and written straight
into the KV backend, so a request starts decoding at once, admitted in milliseconds instead
of a prefill's seconds. Rows are random but deterministic by (seed, layer): two runs, or
two backends, see the same prompt. Indexer keys follow ``locality.index_keys`` (the
locality knob) and are encoded exactly as the model caches its own (fp8 + scale after a
Hadamard rotation, or plain values in bf16 mode).
"""

from __future__ import annotations

import torch

from sglang_echo.model.config import DeepseekV32Config, fp8_row_bytes
from sglang_echo.model.indexer import hadamard_matrix, pack_fp8_rows, quantize_fp8
from sglang_echo.model.kv_cache import KVCache
from sglang_echo.study.locality import Locality, index_keys


def _generator(device: torch.device, seed: int, layer: int, stream: int) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 1_000_003 + layer) * 7 + stream)
    return gen


class SyntheticKV:
    """Per-layer rows of a synthetic prompt of length n and seed s, for one model."""

    def __init__(
        self,
        config: DeepseekV32Config,
        directions: torch.Tensor,
        locality: Locality,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.config = config
        # [L, D], from locality.favoured_directions; on the device once, so that writing a
        # prompt makes no blocking host-to-device copy (the decode node writes on a side
        # stream, and a blocking copy there would hold the engine thread until the stream
        # drained, stalling the running batch as before).
        self.directions = directions.to(device)
        self.locality = locality
        self.dtype = dtype
        self.device = torch.device(device)

    def hot_positions(self, layer: int, length: int, seed: int) -> torch.Tensor:
        """Sorted prompt positions whose keys carry the favoured direction."""
        m = self.locality.hot_count(self.config.index_topk, length)
        # Drawn where the keys are made: on CUDA no host permutation of 100K positions per
        # layer (a few ms of the engine thread per admission) and no copy to wait for.
        gen = _generator(self.device, seed, layer, 0)
        return torch.randperm(length, generator=gen, device=self.device)[:m].sort().values

    def encode_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """Unrotated float keys [n, D] -> the rows the model caches (``index_row_dim``)."""
        k = keys.to(self.dtype)
        if self.config.indexer_mode != "fp8_hadamard":
            return k
        d = self.config.index_head_dim
        rotated = k @ hadamard_matrix(d, k.device, k.dtype)
        return pack_fp8_rows(*quantize_fp8(rotated), fp8_row_bytes(d))

    def rows(self, layer: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(MLA rows [n, kv_row_dim] in the model dtype, index-key rows [n, index_row_dim])."""
        cfg = self.config
        gen = _generator(self.device, seed, layer, 1)
        kv = torch.randn(length, cfg.kv_row_dim, generator=gen, device=self.device)
        keys = index_keys(
            length,
            self.directions[layer],
            self.hot_positions(layer, length, seed),
            _generator(self.device, seed, layer, 2),
            self.device,
        )
        return kv.to(self.dtype), self.encode_keys(keys)

    def write(self, kv_cache: KVCache, locs: torch.Tensor, seed: int) -> None:
        """Write a prompt of ``len(locs)`` tokens at token locations ``locs`` (positions
        0..n-1 in order) into every layer: ECHO's ``write_prompt`` (host rows + device
        index keys, no device slots) where the backend has it, else ``write`` (the plain
        pool's device rows)."""
        write = getattr(kv_cache, "write_prompt", None) or kv_cache.write
        for layer in range(self.config.num_hidden_layers):
            kv, keys = self.rows(layer, int(locs.numel()), seed)
            write(layer, locs, kv, keys)
