"""ECHO as a ``KVCache``: the model's cache interface over host pool + device cache.

MLA rows live in the pinned host pool for every token and in a bounded per-layer device
cache for recently selected ones; indexer keys stay on the device for every token, since
the indexer scores all of them each step.

The cache operations are EchoManager's (offload/manager.py); which decode prefetch a step
runs with is DecodePrefetchSwitch's (offload/prefetch_switch.py). This class is the
``KVCache`` interface over them, and what it reports.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch

from sglang_echo.config import EchoConfig, max_running
from sglang_echo.kernels.fp8_kv import encode_kv_rows
from sglang_echo.kernels.pinned_store import PinnedReadback
from sglang_echo.kernels.placed_rows import write_placed_rows_kernel, write_placed_rows_reference
from sglang_echo.model.kv_cache import KVCache
from sglang_echo.model.periodic_rows import PeriodicRows
from sglang_echo.offload.decode_prefetcher import DecodePrefetcher
from sglang_echo.offload.device_cache import DeviceCache
from sglang_echo.offload.host_extents import HostExtents, all_rows, copy_runs, rows_at
from sglang_echo.offload.host_pool import HostKVPool
from sglang_echo.offload.manager import EchoManager
from sglang_echo.offload.prefetch_rule import DecodePrefetchRule
from sglang_echo.offload.prefetch_switch import DecodePrefetchSwitch, SwitchedCheckpoint
from sglang_echo.offload.prefill_prefetcher import PrefillPrefetcher

FILL_PARTS = ("all", "host", "device")


def stored_form(
    banks: dict[int, tuple[torch.Tensor, torch.Tensor]],
    kv_rows: torch.Tensor | PeriodicRows,
    kv_lora_rank: int,
    kv_dtype: torch.dtype,
) -> torch.Tensor | PeriodicRows:
    """``kv_rows`` as the pools store them (fp8-encoded under an fp8 KV cache). A window into
    a bank: the bank encoded at its first use only (kept in ``banks``), since every prompt
    of a decode node's transfer draws from one bank per layer, and encoding it per arrival
    and layer quantized the whole bank each time under fp8. The first encoding is waited
    for on the host: an arrival's two parts read it from two streams."""
    if not isinstance(kv_rows, PeriodicRows):
        return encode_kv_rows(kv_rows, kv_lora_rank, kv_dtype)
    key = kv_rows.bank.data_ptr()
    if key not in banks:
        encoded = encode_kv_rows(kv_rows.bank, kv_lora_rank, kv_dtype)
        if encoded.is_cuda:
            torch.cuda.current_stream(encoded.device).synchronize()
        banks[key] = (kv_rows.bank, encoded)
    return kv_rows.with_bank(banks[key][1])


class EchoKVCache(KVCache):
    # An arriving prompt's bytes go to its host rows and reserved slots (fill_prompt):
    # index copies only, so a transfer's own thread may launch them.
    fills_prompt_in_place = True
    fill_takes_extents = True
    # What the KV rows are stored as (uint8: fp8 rows, kernels/fp8_kv.py): a plain
    # attribute, set once in __init__ (the pools' dtype never changes); this class-level
    # value shadows KVCache's read-only property so that the instance can hold it.
    kv_dtype: torch.dtype | None = None

    def __init__(
        self,
        config: EchoConfig,
        num_layers: int,
        host_tokens: int,
        kv_row_dim: int,
        index_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        pin: bool | None = None,
        use_kernels: bool | None = None,
        index_dtype: torch.dtype | None = None,
        kv_lora_rank: int | None = None,
    ) -> None:
        device = torch.device(device)
        self.config = config
        self.kv_lora_rank = kv_lora_rank  # needed to store fp8 rows (dtype uint8)
        self.num_layers = num_layers
        self.kv_row_dim = kv_row_dim
        self.index_dim = index_dim
        self.host = HostKVPool(
            num_layers,
            host_tokens,
            kv_row_dim,
            dtype,
            pin=(device.type == "cuda") if pin is None else pin,
        )
        self.cache = DeviceCache(
            num_layers, config.dev_cache_size, host_tokens, kv_row_dim, dtype, device,
            eviction_reserve=config.eviction_reserve,
        )  # fmt: skip
        self.manager = EchoManager(self.host, self.cache, use_kernels=use_kernels, pdl=config.pdl)
        self._telemetry = PinnedReadback(device, slot_bytes=4096, slots=2)  # telemetry()
        self.kv_dtype = self.cache.rows.dtype
        # A decode step captures in a CUDA graph only over a device-addressable host pool.
        self.graph_safe = self.manager.graph_safe
        # From this decode batch up, the resolve runs on a side stream beside the query's
        # up-projection (CUDA; model/attention.py resolve_beside).
        self.resolve_beside_from = int(config.resolve_overlap)
        self.index = torch.zeros(
            num_layers, host_tokens + 1, index_dim, dtype=index_dtype or dtype, device=device
        )
        # Decode prefetch (SGLANG_NSA_FUSE_LOGITS_RECALL_DECODE=1 or auto): built once the
        # runtime says how many request rows there are (bind_request_rows); None = off.
        # Under auto, ``rule`` picks the decode steps it runs in; ``decode_prefetch`` (the
        # model's hook) is the prefetcher for the coming step or None, kept by ``switch``.
        self.decode_prefetcher: DecodePrefetcher | None = None
        self.decode_prefetch: DecodePrefetcher | None = None
        self.rule = DecodePrefetchRule(device, num_layers) if config.fuse_decode == "auto" else None
        self.switch = DecodePrefetchSwitch(self, self.rule)
        # Prefill prefetch (SGLANG_NSA_FUSE_LOGITS_RECALL_EXTEND=1), built the same way.
        self.prefill_prefetch: PrefillPrefetcher | None = None
        # Banks of arriving rows (model/periodic_rows.py) in stored form, by the bank's
        # data pointer, the bank kept alive beside it so the pointer is never reused.
        self._stored_banks: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def bind_request_rows(self, max_rows: int) -> None:
        """The request table has ``max_rows`` rows: size the per-request prefetch state
        (once, before any step, so captured CUDA graphs keep their tensors)."""
        if self.config.fuse_decode != "0" and self.decode_prefetcher is None:
            self.decode_prefetcher = DecodePrefetcher(self.manager, max_rows)
            self.switch.sync()
        if self.config.fuse_extend and self.prefill_prefetch is None:
            self.prefill_prefetch = PrefillPrefetcher(self.manager, max_rows)

    def admit_row(self, row: int) -> None:
        """A new request takes request-table row ``row``: forget the old one's thresholds
        and score offsets."""
        for prefetcher in (self.decode_prefetcher, self.prefill_prefetch):
            if prefetcher is not None:
                prefetcher.reset_rows([row])

    def decode_prefetch_modes(self) -> tuple[bool, ...]:
        return self.switch.modes()

    def forced_decode_prefetch(self, on: bool) -> AbstractContextManager[None]:
        return self.switch.forced(on)

    def checkpoint(self) -> SwitchedCheckpoint:
        """The cache's small state (maps, stacks, clocks, counters, thresholds), to restore
        after dummy steps; KV rows, index keys and staging rows are data, not state."""
        p = self.decode_prefetcher
        staging = p.stage_rows if p is not None else None
        return SwitchedCheckpoint(
            self.switch,
            [self.cache, self.manager, self.decode_prefetcher, self.rule, self.prefill_prefetch],
            [self.cache.rows, self.host.rows, self.host.device_view, self.index, staging],
        )

    def abandon_step(self) -> None:
        """Forget a step that stopped half way (a failed graph capture): prefetches and
        staged rows it left pending, whose events were recorded in the capture and must not
        be waited on outside it."""
        self.manager.prefetches.abandon()

    def before_decode_step(self) -> None:
        self.switch.before_step()

    def after_decode_step(self) -> None:
        self.switch.after_step()

    def write(
        self,
        layer: int,
        locs: torch.Tensor,
        kv_rows: torch.Tensor,
        index_keys: torch.Tensor,
        decode: bool = False,
    ) -> None:
        """New tokens: index keys on the device, MLA rows to the host pool, and device
        slots. A prefill chunk appends (allocating, evicting if it must). A decode step's
        tokens (one per request, nearly always selected by the step's own top-k) take free
        slots in the launch that writes their host rows, and only while free slots last
        (``EchoManager.write_decode``): no allocation pass, and the step's resolve finds
        them resident instead of recalling one row per request over PCIe. With
        SGLANG_ECHO_DECODE_PLACE=0 they go to the host only and the resolve recalls them."""
        self.index[layer].index_copy_(0, locs, index_keys.to(self.index.dtype))
        if decode and self.config.decode_place:
            self.manager.write_decode(
                layer, locs, encode_kv_rows(kv_rows, self.kv_lora_rank, self.kv_dtype)
            )
        elif decode:  # a verify's rejected positions come again: residents rewritten
            self.manager.write_host(
                layer,
                locs,
                encode_kv_rows(kv_rows, self.kv_lora_rank, self.kv_dtype),
                residents=True,
            )
        else:
            self.manager.append(
                layer, locs, encode_kv_rows(kv_rows, self.kv_lora_rank, self.kv_dtype)
            )

    def write_prompt(
        self, layer: int, locs: torch.Tensor, kv_rows: torch.Tensor, index_keys: torch.Tensor
    ) -> None:
        """A decode node's transferred prompt: index keys on the device, MLA rows in the
        host pool and, with ``decode_place``, in free device slots while they last (never
        evicting: ``EchoManager.write_prompt``). Through ``append`` a prompt of 100K tokens
        would take 100K slots per layer (evicting every other request's working set, or not
        fitting at all); what is not placed, the first decode step recalls when selected."""
        self.index[layer].index_copy_(0, locs, index_keys.to(self.index.dtype))
        if self.config.decode_place:
            self.manager.write_prompt(
                layer, locs, encode_kv_rows(kv_rows, self.kv_lora_rank, self.kv_dtype)
            )
        else:
            self.manager.write_host(
                layer, locs, encode_kv_rows(kv_rows, self.kv_lora_rank, self.kv_dtype)
            )

    def reserve_prompt(self, locs: torch.Tensor) -> torch.Tensor | None:
        """A decode node's arriving prompt: its device slots in every layer, taken now from
        the free stacks (never evicting) and pinned until ``unpin_prompt``; None with
        ``decode_place`` off (host rows only). Call on the decode stream: the free stacks
        and maps are the steps', and only that stream orders changes to them. The rows are
        written by ``fill_prompt`` beside the steps, on the transfer's stream."""
        if not self.config.decode_place:
            return None
        return self.manager.reserve_prompt(locs)

    def fill_prompt(
        self,
        layer: int,
        locs: torch.Tensor,
        kv_rows: torch.Tensor | PeriodicRows,
        index_keys: torch.Tensor,
        slots: torch.Tensor | None,
        extents: HostExtents | None = None,
        part: str = "all",
    ) -> None:
        """The arriving prompt's bytes for one layer. Data only (no map, stack or counter
        changes), so it may run on another stream and thread than the decode steps: no
        step selects these ids before the request joins the batch, and pinned slots are
        never evicted. ``part``: "host", the host rows (copies, no SM); "device", the index
        keys and the device rows of the lanes the reservation placed; "all". The two parts
        write disjoint bytes, so they may run on two streams.

        ``extents`` (offload/host_extents.py, its ``rest`` on the rows' device): the host
        rows of its long runs go by copy engine into the pinned pool (no SM held while
        PCIe drains), the rest by the UVA scatter; without it all by the scatter.
        ``kv_rows`` as a window into a bank (model/periodic_rows.py): the long runs are
        copied from the bank's stored form, stretch by stretch, with no rows made first."""
        if part not in FILL_PARTS:
            raise ValueError(f"part must be one of {FILL_PARTS}, got {part!r}")
        if part != "device":
            stored = stored_form(self._stored_banks, kv_rows, self.kv_lora_rank, self.kv_dtype)
            host = self.manager.host_view if self.manager.host_view is not None else self.host.rows
            if extents is None:
                host[layer].index_copy_(0, locs.to(host.device), all_rows(stored).to(host.device))
            else:
                copy_runs(self.host.rows[layer], stored, extents.runs)
                if extents.rest.numel():
                    rest = extents.rest
                    host[layer].index_copy_(
                        0, locs[rest].to(host.device), rows_at(stored, rest).to(host.device)
                    )
        if part == "host":
            return
        self.index[layer].index_copy_(0, locs, index_keys.to(self.index.dtype))
        if slots is None:  # only the lanes the reservation placed (kernels/placed_rows.py)
            return
        stored = stored_form(self._stored_banks, kv_rows, self.kv_lora_rank, self.kv_dtype)
        if isinstance(stored, PeriodicRows):
            src, period, offset = stored.bank, stored.period, stored.offset
        else:
            src, period, offset = stored, None, 0
        write = (
            write_placed_rows_kernel if self.manager.use_kernels else write_placed_rows_reference
        )
        write(self.cache.rows[layer], slots, src, self.cache.scratch_slot, period, offset)

    def unpin_prompt(self, slots: torch.Tensor | None) -> None:
        """The prompt has arrived (on the decode stream, after its transfer's event): its
        placed rows become ordinary residents of the oldest priority."""
        if slots is not None:
            self.manager.unpin_prompt(slots)

    def index_keys(self, layer: int) -> torch.Tensor:
        return self.index[layer]

    def resolve(
        self, layer: int, locs: torch.Tensor, distinct: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.rows[layer], self.manager.resolve(layer, locs, distinct)

    def max_resolve_queries(self, topk: int) -> int:
        # The capacity rule (config.max_running): the union of these queries' selections
        # must fit the cache at once.
        return max(1, max_running(self.cache.num_slots, topk))

    def release(self, locs: torch.Tensor) -> None:
        self.manager.release(locs)

    def telemetry(self) -> dict[str, list[int] | list[float]]:
        """Per-layer counters since start (reads the device: call outside a step)."""
        c, m = self.cache, self.manager
        # One readback of every counter (one wait for the step in flight, by the GPU's own
        # stores: kernels/pinned_store.py), not one blocking copy per counter.
        parts = [c.hits, c.misses, c.evictions, c.append_evictions, c.recalled_rows]
        parts += [m.prefetched_rows, m.prefetch_hits, m.release_errors]
        (flat,) = self._telemetry.copy([torch.cat([p.view(-1) for p in parts])]).wait()
        counts = iter(flat.tolist())
        hits, misses, evictions, append_evictions, recalled, prefetched, prefetch_hits = (
            [next(counts) for _ in range(p.numel())] for p in parts[:7]
        )
        row_bytes = self.kv_row_dim * c.rows.element_size()
        return {
            "hits": hits,
            "misses": misses,
            "hit_rate": [h / (h + m) if h + m else 1.0 for h, m in zip(hits, misses, strict=True)],
            "evictions": evictions,
            "append_evictions": append_evictions,
            "recalled_bytes": [r * row_bytes for r in recalled],
            # Decode prefetch: rows copied early, and how many of them were then selected.
            "prefetched_rows": prefetched,
            "prefetch_hits": prefetch_hits,
            # Under auto: decode steps the rule ran the prefetch in, of all decode steps.
            "prefetch_steps": [self.rule.steps_on, self.rule.steps] if self.rule else [],
            # Released ids the release kernel refused on the device (sink, duplicates):
            # nonzero means a caller's token bookkeeping is wrong.
            "release_errors": next(counts),
        }

    def stats(self) -> dict:
        return {
            "backend": "echo",
            "dev_cache_slots_per_layer": self.cache.num_slots,
            "host_tokens": self.host.num_tokens,
            "host_bytes": self.host.nbytes,
            "host_pinned": self.host.pinned,
            # With decode prefetch, its staging buffer and index (built once, at start-up).
            "device_bytes": self.cache.nbytes
            + self.index.nbytes
            + (self.decode_prefetcher.nbytes if self.decode_prefetcher is not None else 0),
            "graph_safe": self.graph_safe,
            "prefetch": [
                name
                for name, on in (
                    ("decode", self.decode_prefetcher),
                    ("prefill", self.prefill_prefetch),
                )
                if on is not None
            ],
            **self.telemetry(),
        }
