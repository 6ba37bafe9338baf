"""The one interface between the model and KV storage, and its plain (no-offload) pool.

The model never indexes KV memory itself. Per layer it (1) writes each new token's MLA
row (latent + rope key) and indexer key at a token location, (2) reads the indexer keys
of every token to score them, and (3) hands the selected token locations to ``resolve``,
which returns the buffer and the rows in it that attention must read. The plain pool
returns its own full buffer and the locations unchanged; ECHO returns its bounded
per-layer device cache and the slots it has just made resident. Model code is identical.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from sglang_echo.kernels.fp8_kv import encode_kv_rows
from sglang_echo.model.config import DeepseekV32Config
from sglang_echo.model.periodic_rows import PeriodicRows


class KVCache:
    """The contract between the model (and the runtime that drives it) and KV storage: the
    whole lifecycle a backend may take part in, declared here once. ``write``,
    ``index_keys`` and ``resolve`` are what every backend must do; every other method has
    the plain pool's behaviour as its default (nothing to do), so callers call them
    unconditionally instead of probing a backend for optional attributes.

    Token locations are ints in [1, capacity]; location 0 is a padding sink."""

    num_layers: int
    kv_row_dim: int
    index_dim: int
    # A decode step of this many tokens or more may run its resolve on a side stream
    # beside the query's up-projection (model/attention.py: resolve_beside); 0: never.
    resolve_beside_from: int = 0
    # A decode step can be captured in a CUDA graph (False: the backend's host pool is
    # not device-addressable, so its recall cannot be captured).
    graph_safe: bool = True
    # An arriving prompt's writes change bytes and nothing else (no maps), so a transfer
    # may launch them from another thread beside the decode steps.
    fills_prompt_in_place: bool = False
    # An arriving prompt is written by ``fill_prompt`` (into the slots ``reserve_prompt``
    # gave, the host rows laid out by extents); otherwise by ``write_prompt``.
    fill_takes_extents: bool = False
    # The indexer's selection hooks for a decode step (ECHO's staged prefetch) and for a
    # prefill chunk (its histogram prefetch), or None: model/indexer.py.
    decode_prefetch: Any = None
    prefill_prefetch: Any = None

    # ------------------------------------------------------------ the model, per layer
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
        raise NotImplementedError

    def index_keys(self, layer: int) -> torch.Tensor:
        """Indexer keys of every token location: [capacity + 1, index_dim], on the device."""
        raise NotImplementedError

    def resolve(
        self, layer: int, locs: torch.Tensor, distinct: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Selected locations [Q, K] (-1 = none) -> (kv buffer [S, kv_row_dim], rows [Q, K]).

        ``rows`` index the buffer; entries where ``locs`` is -1 are -1 too. ``distinct``:
        the caller promises no location occurs twice in ``locs`` (a decode step: a query
        per request, and requests never share a location here); a backend may save work
        on it, and must stay correct if the promise is wrong.
        """
        raise NotImplementedError

    def max_resolve_queries(self, topk: int) -> int:
        """How many queries' selections one ``resolve`` call may carry (its union must fit)."""
        return 1 << 30

    @property
    def kv_dtype(self) -> torch.dtype | None:
        """What the KV rows are stored as (uint8: fp8 rows); None: the query's dtype."""
        return None

    # ------------------------------------------------------------ the runtime
    def release(self, locs: torch.Tensor) -> None:
        """Token locations ``locs`` are being freed: forget any state tied to them."""

    def bind_request_rows(self, max_rows: int) -> None:
        """Per-request state is sized by the request table, once, before any step."""

    def admit_row(self, row: int) -> None:
        """A new request takes request-table row ``row``: reset what the row carried."""

    def note_owner(self, rows: torch.Tensor | int, locs: torch.Tensor) -> None:
        """Token locations ``locs`` belong to the requests of table rows ``rows`` (a row
        per location, or one row for all): a backend partitioned by request learns it."""

    def before_decode_step(self) -> None:
        """Called before each decode step (it may pick the step's prefetch mode)."""

    def after_decode_step(self) -> None:
        """Called after each decode step was launched."""

    def decode_prefetch_modes(self) -> tuple[bool, ...]:
        """The decode-prefetch modes a step can take (a CUDA graph per batch size and mode)."""
        return (False,)

    def forced_decode_prefetch(self, on: bool) -> AbstractContextManager[None]:
        """Steps inside run with the decode prefetch ``on`` (start-up capture)."""
        return nullcontext()

    def checkpoint(self) -> Any:
        """The backend's small state, to put back after start-up capture (``restore()``),
        or None when it has none."""
        return None

    def abandon_step(self) -> None:
        """A captured step failed midway: drop what it left pending."""

    def telemetry(self) -> dict | None:
        """Counters for the server's metrics (reads the device), or None."""
        return None

    # ------------------------------------------------------------ arriving prompts
    def write_prompt(
        self, layer: int, locs: torch.Tensor, kv_rows: torch.Tensor, index_keys: torch.Tensor
    ) -> None:
        """A whole prompt's rows at ``locs``; by default as a prefill writes them."""
        self.write(layer, locs, kv_rows, index_keys)

    def reserve_prompt(self, locs: torch.Tensor) -> torch.Tensor | None:
        """Device slots for an arriving prompt, per layer, or None (nothing to reserve)."""
        return None

    def fill_prompt(
        self,
        layer: int,
        locs: torch.Tensor,
        kv_rows: torch.Tensor | PeriodicRows,
        index_keys: torch.Tensor,
        slots: torch.Tensor | None,
        extents: Any,
        part: str = "all",
    ) -> None:
        """An arriving prompt's bytes, for ``fill_takes_extents`` backends: by default as
        ``write_prompt``, ignoring the reserved slots and the host extents. ``kv_rows`` may
        be a window into a bank of rows (an emulated arrival: model/periodic_rows.py).
        ``part``: "host" writes what a copy engine can (no SM), "device" the rest, "all"
        both; the two write disjoint bytes, so a transfer may run them on two streams. By
        default "host" writes nothing and "device" everything."""
        if part == "host":
            return
        if isinstance(kv_rows, PeriodicRows):
            kv_rows = kv_rows.materialize()
        self.write_prompt(layer, locs, kv_rows, index_keys)

    def unpin_prompt(self, slots: torch.Tensor | None) -> None:
        """An arrived prompt's reserved slots may be evicted from now on."""


class PlainKVCache(KVCache):
    """No-offload: every token's rows for every layer stay on the model's device."""

    fills_prompt_in_place = True  # its write is index copies into its own buffers

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

    def stats(self) -> dict:
        return {"backend": "no-offload", "kv_bytes": self.nbytes}
