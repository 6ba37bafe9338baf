"""A HiSparse-like KV backend: a private device buffer per request and layer, LRU inside it.

SGLang's HiSparse keeps every token's MLA rows in pinned host memory and gives each
running request its own bounded device buffer per layer (``device_buffer_size``, 4096
rows by default), evicting least-recently-used rows within that request only. ECHO shares
one bounded cache per layer among all requests. This backend implements HiSparse's policy
beside ECHO, with the same host pool, the same recall kernel and the same model interface,
so the two policies can be compared on one workload; it is not SGLang's code or kernels.

Layout, per layer: ``rows`` [R x B + 1, D] (slot 0 a sink; request-table row r owns slots
1 + r*B .. (r+1)*B), ``host_to_slot`` [N_H + 1], ``slot_to_host`` [R x B + 1] (0 = free),
``stamp`` [R x B + 1] (last-use clock; -1 = free) and a clock. Which request a token
belongs to comes from ``note_owner`` (the step runner calls it when it places tokens).

A resolve (decode: one query per request; prefill: one query, see ``max_resolve_queries``)
stamps the hits, orders each partition's slots by stamp (free first, then least recent,
ties by slot), gives the i-th miss of a request that request's i-th victim, unmaps the
victims' old tokens, maps the misses and recalls their rows from the host. Fixed shapes,
no host synchronisation: capturable in a CUDA graph. A request's hits and misses never
exceed its buffer (top-k <= B), so a victim is never a slot selected in the same step.
"""

from __future__ import annotations

import torch

from sglang_echo.kernels.fp8_kv import encode_kv_rows
from sglang_echo.model.kv_cache import KVCache
from sglang_echo.offload.host_pool import HostKVPool
from sglang_echo.offload.state_checkpoint import StateCheckpoint

ABSENT = -1
DEFAULT_DEVICE_BUFFER_SIZE = 4096  # HiSparse's default device_buffer_size


class HiSparseKVCache(KVCache):
    def __init__(
        self,
        num_layers: int,
        host_tokens: int,
        max_requests: int,
        buffer_size: int,
        kv_row_dim: int,
        index_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        index_dtype: torch.dtype | None = None,
        pin: bool | None = None,
        use_kernels: bool | None = None,
        kv_lora_rank: int | None = None,
        pdl: bool = True,
    ) -> None:
        device = torch.device(device)
        self.kv_lora_rank = kv_lora_rank  # needed to store fp8 rows (dtype uint8)
        if buffer_size < 1 or max_requests < 1:
            raise ValueError("the per-request buffer and the request count must be >= 1")
        self.num_layers = num_layers
        self.kv_row_dim = kv_row_dim
        self.index_dim = index_dim
        self.device = device
        self.max_requests = max_requests
        self.buffer_size = buffer_size
        self.host = HostKVPool(
            num_layers,
            host_tokens,
            kv_row_dim,
            dtype,
            pin=(device.type == "cuda") if pin is None else pin,
        )
        self.host_view = self.host.view_for(device)
        # The recall kernel on CUDA (and under the Triton interpreter when asked), an index
        # copy elsewhere; both copy the same rows.
        self.use_kernels = (
            use_kernels if use_kernels is not None else device.type == "cuda"
        ) and self.host_view is not None
        # Chained recall launches (kernels/pdl.py): SGLANG_ECHO_PDL, handed down by the entry
        # point that builds the cache (its settings' value); on by default, as the variable.
        self.pdl = pdl
        slots = max_requests * buffer_size + 1
        i64 = dict(dtype=torch.int64, device=device)
        self.rows = torch.zeros(num_layers, slots, kv_row_dim, dtype=dtype, device=device)
        self.index = torch.zeros(
            num_layers, host_tokens + 1, index_dim, dtype=index_dtype or dtype, device=device
        )
        self.host_to_slot = torch.full((num_layers, host_tokens + 1), ABSENT, **i64)
        self.slot_to_host = torch.zeros(num_layers, slots, **i64)
        self.stamp = torch.full((num_layers, slots), -1, **i64)
        self.clock = torch.zeros(num_layers, **i64)
        self.owner = torch.zeros(host_tokens + 1, **i64)  # token location -> request row
        self.hits = torch.zeros(num_layers, **i64)
        self.misses = torch.zeros(num_layers, **i64)
        self.evictions = torch.zeros(num_layers, **i64)

    def checkpoint(self) -> StateCheckpoint:
        """The buffers' small state (maps, stamps, clocks, counters), to restore after the
        dummy steps of start-up graph capture; KV rows and index keys are data."""
        return StateCheckpoint([self], [self.rows, self.index, self.host.rows, self.host_view])

    @classmethod
    def for_model(
        cls,
        config,
        host_tokens: int,
        max_requests: int,
        buffer_size: int,
        dtype,
        device,
        kv_cache_dtype: str = "auto",
        **kw,
    ):
        width, stored = config.kv_storage(dtype, kv_cache_dtype)
        return cls(
            config.num_hidden_layers,
            host_tokens,
            max_requests,
            buffer_size,
            width,
            config.index_row_dim,
            stored,
            device,
            index_dtype=config.index_row_dtype(dtype),
            kv_lora_rank=config.kv_lora_rank,
            **kw,
        )

    # --------------------------------------------------------------- writes
    def note_owner(self, rows: torch.Tensor | int, locs: torch.Tensor) -> None:
        """Token locations ``locs`` [T] now belong to request-table rows ``rows`` [T] (or
        all to the one row ``rows``)."""
        locs = locs.to(self.device, torch.int64)
        if isinstance(rows, int):
            rows = torch.full_like(locs, rows)
        self.owner.index_copy_(0, locs, rows.to(self.device, torch.int64))

    def _write_host(self, layer: int, locs: torch.Tensor, kv_rows: torch.Tensor) -> None:
        if self.host_view is not None:
            self.host_view[layer].index_copy_(0, locs, kv_rows.to(self.host_view.dtype))
        else:
            self.host.rows[layer].index_copy_(
                0, locs.cpu(), kv_rows.to("cpu", self.host.rows.dtype)
            )

    def write(
        self,
        layer: int,
        locs: torch.Tensor,
        kv_rows: torch.Tensor,
        index_keys: torch.Tensor,
        decode: bool = False,
    ) -> None:
        """New tokens: index keys on the device, MLA rows to the host only, in decode and
        prefill alike; a token enters its request's buffer when a top-k first selects it."""
        self.index[layer].index_copy_(0, locs, index_keys.to(self.index.dtype))
        self._write_host(layer, locs, encode_kv_rows(kv_rows, self.kv_lora_rank, self.rows.dtype))

    write_prompt = write  # a decode node's transferred prompt goes the same way

    @property
    def kv_dtype(self) -> torch.dtype:
        """What the KV rows are stored as (uint8: fp8 rows, kernels/fp8_kv.py)."""
        return self.rows.dtype

    def index_keys(self, layer: int) -> torch.Tensor:
        return self.index[layer]

    def max_resolve_queries(self, topk: int) -> int:
        # One query per call outside decode: two queries of one request may select the same
        # tokens, and one request's selections must fit its buffer.
        return 1

    # -------------------------------------------------------------- resolve
    def resolve(
        self, layer: int, locs: torch.Tensor, distinct: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ids = locs.reshape(-1).to(torch.int64)
        n = ids.numel()
        r, b = self.max_requests, self.buffer_size
        h2s, s2h, stamp = self.host_to_slot[layer], self.slot_to_host[layer], self.stamp[layer]
        valid = ids >= 0
        safe = ids.clamp(min=0)  # -1 (none) reads location 0, never a token
        slot = h2s[safe]
        hit = valid & (slot != ABSENT)
        miss = valid & ~hit
        self.clock[layer : layer + 1] += 1
        now = self.clock[layer]
        zero = torch.zeros_like(ids)
        stamp.index_put_((torch.where(hit, slot, zero),), now.expand(n))  # protect the hits
        # Each partition's slots, least recently used first (free slots, stamped -1, lead).
        col = torch.arange(b, device=self.device)
        keys = stamp[1:].view(r, b) * b + col
        order = torch.argsort(keys, dim=1)
        # Rank of each miss among its request's misses (in selection order).
        owner = self.owner[safe]
        group = torch.where(miss, owner, torch.full_like(owner, r))
        pos = torch.arange(n, device=self.device)
        by_group = torch.argsort(group * n + pos)
        g_sorted = group[by_group]
        start = torch.ones_like(g_sorted, dtype=torch.bool)
        start[1:] = g_sorted[1:] != g_sorted[:-1]
        first = torch.cummax(torch.where(start, pos, zero), dim=0).values
        rank = torch.empty_like(pos).scatter_(0, by_group, pos - first)
        victim = 1 + owner * b + order[owner.clamp(max=r - 1), rank.clamp(max=b - 1)]
        new_slot = torch.where(miss, victim, zero)
        old = s2h[new_slot]
        evicted = miss & (old > 0)
        h2s.index_put_((torch.where(evicted, old, zero),), torch.full_like(old, ABSENT))
        h2s.index_put_((torch.where(miss, ids, zero),), new_slot)
        s2h.index_put_((new_slot,), torch.where(miss, ids, zero))
        stamp.index_put_((new_slot,), now.expand(n))
        h2s[:1].fill_(ABSENT)  # location 0 absorbed the masked writes; it is never a token
        self.hits[layer : layer + 1] += hit.sum()
        self.misses[layer : layer + 1] += miss.sum()
        self.evictions[layer : layer + 1] += evicted.sum()
        self._recall(layer, ids, new_slot, miss)
        out = torch.where(hit, slot, torch.where(miss, new_slot, torch.full_like(ids, -1)))
        return self.rows[layer], out.view(locs.shape)

    def _recall(self, layer: int, ids: torch.Tensor, slots: torch.Tensor, miss: torch.Tensor):
        """Copy the misses' rows host -> buffer: the recall kernel over a compacted list on
        CUDA (as ECHO's), an index copy elsewhere."""
        if self.use_kernels:
            from sglang_echo.kernels.recall import recall_rows

            n = ids.numel()
            at = torch.where(
                miss, torch.cumsum(miss.to(torch.int64), 0) - 1, torch.full_like(ids, n)
            )
            miss_ids = torch.zeros(n + 1, dtype=torch.int64, device=self.device)
            miss_slots = torch.zeros(n + 1, dtype=torch.int64, device=self.device)
            miss_ids.scatter_(0, at, ids.clamp(min=0))
            miss_slots.scatter_(0, at, slots)
            count = miss.sum().reshape(1)  # int64 [1], as ECHO's allocation hands it over
            recall_rows(
                self.host_view[layer],
                self.rows[layer],
                miss_ids[:n],
                miss_slots[:n],
                count,
                pdl=self.pdl,
            )
            return
        take = miss.nonzero().squeeze(1)
        src = self.host.rows[layer].index_select(0, ids[take].cpu()).to(self.device)
        self.rows[layer].index_copy_(0, slots[take], src.to(self.rows.dtype))

    # -------------------------------------------------------------- release
    def release(self, locs: torch.Tensor) -> None:
        """A request ends: its tokens leave every layer's buffer (their slots are free)."""
        locs = locs.to(self.device, torch.int64)
        for layer in range(self.num_layers):
            slot = self.host_to_slot[layer][locs]
            resident = slot != ABSENT
            freed = torch.where(resident, slot, torch.zeros_like(slot))
            self.slot_to_host[layer].index_fill_(0, freed, 0)
            self.stamp[layer].index_fill_(0, freed, -1)
            self.host_to_slot[layer].index_fill_(0, locs, ABSENT)
            self.slot_to_host[layer][:1].fill_(0)

    # ------------------------------------------------------------ telemetry
    def free_slots(self) -> list[int]:
        """Free buffer slots per layer (all of them once every request ended)."""
        return (self.slot_to_host[:, 1:] == 0).sum(dim=1).tolist()

    def telemetry(self) -> dict[str, list]:
        hits, misses = self.hits.tolist(), self.misses.tolist()
        row_bytes = self.kv_row_dim * self.rows.element_size()
        return {
            "hits": hits,
            "misses": misses,
            "hit_rate": [h / (h + m) if h + m else 1.0 for h, m in zip(hits, misses, strict=True)],
            "evictions": self.evictions.tolist(),
            "recalled_bytes": [m * row_bytes for m in misses],
        }

    def reset_telemetry(self) -> None:
        for t in (self.hits, self.misses, self.evictions):
            t.zero_()

    def stats(self) -> dict:
        return {
            "backend": "hisparse",
            "device_buffer_size": self.buffer_size,
            "host_tokens": self.host.num_tokens,
            "host_bytes": self.host.nbytes,
            "host_pinned": self.host.pinned,
            "device_bytes": self.rows.nbytes + self.index.nbytes,
            **self.telemetry(),
        }
