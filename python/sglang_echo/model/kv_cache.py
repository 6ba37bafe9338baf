"""The one interface between the model and KV storage, and its plain (no-offload) pool.

The model never indexes KV memory itself. Per layer it (1) writes each new token's MLA
row (latent + rope key) and indexer key at a token location, (2) reads the indexer keys
of every token to score them, and (3) hands the selected token locations to ``resolve``,
which returns the buffer and the rows in it that attention must read. The plain pool
returns its own full buffer and the locations unchanged; ECHO returns its bounded
per-layer device cache and the slots it has just made resident. Model code is identical.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from sglang_echo.kernels.fp8_kv import encode_kv_rows
from sglang_echo.model.config import DeepseekV32Config


@runtime_checkable
class KVCache(Protocol):
    """Token locations are ints in [1, capacity]; location 0 is a padding sink."""

    num_layers: int
    kv_row_dim: int
    index_dim: int

    def write(
        self,
        layer: int,
        locs: torch.Tensor,
        kv_rows: torch.Tensor,
        index_keys: torch.Tensor,
        decode: bool = False,
    ) -> None:
        """Store rows for tokens at ``locs`` [T]: kv_rows [T, kv_row_dim], index_keys [T, index_dim].

        Index-key rows are whatever the indexer caches: D values, or in fp8 mode D + 4 bytes.
        ``decode``: the tokens of a decode step (one per request). A backend with a bounded
        device cache may keep them out of it until a top-k selects them; ``resolve`` must
        still return their rows then.
        """

    def index_keys(self, layer: int) -> torch.Tensor:
        """Indexer keys of every token location: [capacity + 1, index_dim], on the device."""

    def resolve(
        self, layer: int, locs: torch.Tensor, distinct: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Selected locations [Q, K] (-1 = none) -> (kv buffer [S, kv_row_dim], rows [Q, K]).

        ``rows`` index the buffer; entries where ``locs`` is -1 are -1 too. ``distinct``:
        the caller promises no location occurs twice in ``locs`` (a decode step: a query
        per request, and requests never share a location here); a backend may save work
        on it, and must stay correct if the promise is wrong.
        """

    def max_resolve_queries(self, topk: int) -> int:
        """How many queries' selections one ``resolve`` call may carry (its union must fit)."""

    def release(self, locs: torch.Tensor) -> None:
        """Token locations ``locs`` are being freed: forget any state tied to them."""


class PlainKVCache:
    """No-offload: every token's rows for every layer stay on the model's device."""

    def __init__(
        self,
        num_layers: int,
        capacity: int,
        kv_row_dim: int,
        index_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        index_dtype: torch.dtype | None = None,
        kv_lora_rank: int | None = None,
    ) -> None:
        self.num_layers = num_layers
        self.kv_lora_rank = kv_lora_rank  # needed to store fp8 rows (dtype uint8)
        self.capacity = capacity
        self.kv_row_dim = kv_row_dim
        self.index_dim = index_dim
        self.kv = torch.zeros(num_layers, capacity + 1, kv_row_dim, dtype=dtype, device=device)
        self.index = torch.zeros(
            num_layers, capacity + 1, index_dim, dtype=index_dtype or dtype, device=device
        )

    @classmethod
    def for_model(
        cls,
        config: DeepseekV32Config,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str,
        kv_cache_dtype: str = "auto",
    ) -> PlainKVCache:
        """Row widths and the index-key dtype as the model's indexer mode needs them; KV
        rows as ``--kv-cache-dtype`` stores them (kernels/fp8_kv.py)."""
        width, stored = config.kv_storage(dtype, kv_cache_dtype)
        return cls(
            config.num_hidden_layers,
            capacity,
            width,
            config.index_row_dim,
            stored,
            device,
            index_dtype=config.index_row_dtype(dtype),
            kv_lora_rank=config.kv_lora_rank,
        )

    @property
    def kv_dtype(self) -> torch.dtype:
        """What the KV rows are stored as (uint8: fp8 rows, kernels/fp8_kv.py)."""
        return self.kv.dtype

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + self.index.nbytes

    def write(
        self,
        layer: int,
        locs: torch.Tensor,
        kv_rows: torch.Tensor,
        index_keys: torch.Tensor,
        decode: bool = False,
    ) -> None:
        self.kv[layer].index_copy_(
            0, locs, encode_kv_rows(kv_rows, self.kv_lora_rank, self.kv.dtype)
        )
        self.index[layer].index_copy_(0, locs, index_keys.to(self.index.dtype))

    def index_keys(self, layer: int) -> torch.Tensor:
        return self.index[layer]

    def resolve(
        self, layer: int, locs: torch.Tensor, distinct: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv[layer], locs

    def max_resolve_queries(self, topk: int) -> int:
        return 1 << 30

    def release(self, locs: torch.Tensor) -> None:
        return None

    def stats(self) -> dict:
        return {"backend": "no-offload", "kv_bytes": self.nbytes}
