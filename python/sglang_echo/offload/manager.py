"""ECHO's cache operations: append, resolve (look up, protect, evict, allocate, recall)
and release.

Allocation semantics live in kernels/alloc.py (bucketed-LRU victims, misses served in lane
order, duplicates allocated once): its Triton kernels on CUDA, its torch reference on the
CPU, bit-identical to each other. ``append`` and ``resolve`` use fixed shapes and keep
every count on the device: no host synchronisation, so a decode step can be captured in a
CUDA graph. Masked-off lanes write to scratch entries (slot N_G + 1, host id N_H + 1).

``prefetch`` (the prefill prefetch's, docs/ARCHITECTURE.md section 6) maps and starts
copying rows the exact top-k is certain to select before it is known; see its docstring.
The decode prefetch allocates nothing: it stages rows, which ``resolve``'s recall takes
(``stage_ready``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from sglang_echo.config import settings
from sglang_echo.kernels.alloc import (
    Allocation,
    AllocWorkspace,
    allocate_kernel,
    allocate_reference,
)
from sglang_echo.kernels.cache_layout import FREE
from sglang_echo.kernels.decode_stage import StagedRows, staged_entries
from sglang_echo.kernels.decode_write import (
    PINNED_PRIORITY,
    PROMPT_PRIORITY,
    decode_write_kernel,
    decode_write_reference,
    place_slots_all_layers,
)
from sglang_echo.kernels.host_copy import upload
from sglang_echo.kernels.prefill_prefetch import count_prefetch_hits, count_prefetch_hits_reference
from sglang_echo.kernels.release import release_kernel, release_reference
from sglang_echo.offload.device_cache import DeviceCache
from sglang_echo.offload.host_pool import HostKVPool

_Event = torch.cuda.Event | None  # a side stream's event; None: nothing to wait for


@dataclass
class _PendingPrefetch:
    """A prefetch of one layer that ``resolve`` has not joined yet."""

    alloc: Allocation
    lanes: int
    allocated: torch.cuda.Event | None  # side stream: maps updated (None: synchronous)
    copied: torch.cuda.Event | None  # side stream: rows copied
    inputs: tuple  # candidate tensors (also of chained earlier prefetches), kept alive
    # until the side stream is joined
    # Chained earlier prefetches of the layer (prefill: one per query block): copies of
    # their miss lists (the workspace is reused by the next link), so that the resolve
    # counts the hits of every block, not only the last one's.
    earlier: tuple[tuple[Allocation, int], ...] = ()


class EchoManager:
    def __init__(
        self,
        host: HostKVPool,
        cache: DeviceCache,
        use_kernels: bool | None = None,
        pdl: bool | None = None,
    ) -> None:
        if host.num_tokens != cache.host_tokens or host.num_layers != cache.num_layers:
            raise ValueError("host pool and device cache disagree on tokens or layers")
        self.host = host
        self.cache = cache
        self.device = cache.device
        # Kernels on the cache's device read/write host rows through this view; None means
        # host-side copies (correct, but they synchronise and cannot be graph-captured).
        self.host_view = host.view_for(self.device)
        # On CUDA the Triton recall kernel moves the rows; the torch path is the reference.
        self.use_kernels = (
            use_kernels if use_kernels is not None else self.device.type == "cuda"
        ) and self.host_view is not None
        # Chained launches of the allocation and recall kernels where the device supports
        # them (kernels/pdl.py): SGLANG_ECHO_PDL from the process's settings unless given.
        self.pdl = settings().pdl if pdl is None else pdl
        self._workspace: AllocWorkspace | None = None
        # Prefill prefetch: its own allocation workspace (its miss list is read by the side
        # stream's copy while the resolve's allocation runs), side stream, counters.
        self._prefetch_workspace: AllocWorkspace | None = None
        self._side_stream: torch.cuda.Stream | None = None
        self._pending: dict[int, _PendingPrefetch] = {}
        # Staged decode prefetch (offload/decode_prefetcher.py): per layer, the staging
        # the next resolve's recall reads and the side stream's event after its work.
        self._staged: dict[int, tuple[StagedRows, _Event, _Event]] = {}
        i64 = dict(dtype=torch.int64, device=self.device)
        self.prefetched_rows = torch.zeros(cache.num_layers, **i64)  # rows prefetched (staged)
        self.prefetch_hits = torch.zeros(cache.num_layers, **i64)  # ... and then selected
        # Released lanes refused on the device (sink, duplicates), summed over layers.
        self.release_errors = torch.zeros(1, **i64)
        self._release_marks: torch.Tensor | None = None  # host scratch of the id check

    @property
    def graph_safe(self) -> bool:
        return self.host_view is not None

    # ------------------------------------------------------------------ host I/O
    def _write_host(self, layer: int, locs: torch.Tensor, rows: torch.Tensor) -> None:
        if self.host_view is not None:
            self.host_view[layer].index_copy_(0, locs, rows.to(self.host_view.dtype))
        else:
            self.host.rows[layer].index_copy_(0, locs.cpu(), rows.to("cpu", self.host.rows.dtype))

    def write_host(self, layer: int, locs: torch.Tensor, rows: torch.Tensor) -> None:
        """Host rows only (no device slot, maps untouched): tokens whose KV arrives from
        elsewhere (a decode node's transferred prompt). Through the UVA view on CUDA."""
        self._join(layer)
        self._write_host(layer, locs, rows)

    def write_decode(self, layer: int, locs: torch.Tensor, rows: torch.Tensor) -> None:
        """A decode step's new tokens: host rows, and device slots from the free stack
        while it has room (kernels/decode_write.py: one launch, never evicts), so that the
        step's resolve finds them resident instead of recalling them. Distinct ids."""
        write = decode_write_kernel if self.use_kernels else decode_write_reference
        self._write_placed(layer, locs, rows, write)

    def reserve_prompt(self, locs: torch.Tensor) -> torch.Tensor:
        """A transferring prompt's device slots in every layer, taken from the free stacks
        while they last (never evicting) and pinned (``PINNED_PRIORITY``) until
        ``unpin_prompt``: call on the decode stream, which orders it with the steps that
        share the free stacks. Returns the slots [layers, n] (the scratch slot where none
        was free); the rows are written by ``EchoKVCache.fill_prompt``, on any stream."""
        for layer in list(self._pending):
            self._join(layer)
        return place_slots_all_layers(self.cache, locs.reshape(-1), PINNED_PRIORITY)

    def unpin_prompt(self, slots: torch.Tensor) -> None:
        """The prompt has arrived: its slots [layers, n] get the placed rows' priority (the
        oldest, so the rows no step selects are the first victims). On the decode stream."""
        c = self.cache
        c.priority.scatter_(1, slots, PROMPT_PRIORITY)
        c.priority.narrow(1, c.scratch_slot, 1).fill_(FREE)

    def write_prompt(self, layer: int, locs: torch.Tensor, rows: torch.Tensor) -> None:
        """A decode node's transferred prompt: host rows, and device slots while the free
        stack has room, never evicting (dynamic residency: at low load a request's whole
        prompt stays on the device and its decode steps only look up). Placed rows get the
        oldest priority, so under pressure the ones no step selected go first. Torch, not
        the one-program kernel: written once per request, eagerly, at any length."""
        self._write_placed(
            layer, locs, rows, partial(decode_write_reference, priority_of_placed=PROMPT_PRIORITY)
        )

    def _write_placed(self, layer: int, locs: torch.Tensor, rows: torch.Tensor, write) -> None:
        """Host rows of ``locs`` and device rows where ``write`` places them."""
        self._join(layer)
        c = self.cache
        host = self.host_view if self.host_view is not None else self.host.rows
        ids = locs.reshape(-1).to(torch.int64)
        rows = rows.reshape(ids.numel(), -1).to(c.rows.dtype)
        write(c, layer, ids, rows, host[layer], c.rows[layer])

    def _read_host(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        if self.host_view is not None:
            return self.host_view[layer].index_select(0, ids)
        return self.host.rows[layer].index_select(0, ids.cpu()).to(self.device)

    def _check_lanes(self, op: str, lanes: int) -> None:
        """Shape-only guard (no device read): more lanes than slots could need more
        victims than exist. EchoConfig.validate makes this unreachable from the runtime."""
        if lanes > self.cache.num_slots:
            raise ValueError(
                f"ECHO {op} of {lanes} tokens exceeds the {self.cache.num_slots}-slot device "
                "cache; split it (chunked prefill) or raise NSA_DEV_CACHE_SIZE"
            )

    # ------------------------------------------------------------------ allocation
    def _allocate(
        self, layer: int, ids: torch.Tensor, append: bool, distinct: bool = False
    ) -> Allocation:
        """Look up, protect, evict, allocate and map (kernels/alloc.py): the Triton kernels
        on CUDA, their torch reference elsewhere; both leave bit-identical state."""
        if not self.use_kernels:
            return allocate_reference(self.cache, layer, ids, append)
        if self._workspace is None:
            self._workspace = AllocWorkspace(
                self.cache, max_lanes=self.cache.num_slots, pdl=self.pdl
            )
        return allocate_kernel(self.cache, layer, ids, append, self._workspace, distinct=distinct)

    def _allocate_selection(
        self, layer: int, locs: torch.Tensor, distinct: bool = False
    ) -> Allocation:
        """A resolve's allocation of selections [Q, K]. Distinct ids (the caller's word,
        or one query: a top-k's positions are distinct, and so are their host ids) spare
        the one-program look-up a round trip (allocate_kernel's ``distinct``)."""
        distinct = distinct or (locs.dim() == 2 and locs.shape[0] == 1)
        return self._allocate(
            layer, locs.reshape(-1).to(torch.int64), append=False, distinct=distinct
        )

    # -------------------------------------------------------------------- append
    def append(self, layer: int, locs: torch.Tensor, rows: torch.Tensor) -> None:
        """New tokens (host ids not yet resident) -> host rows and fresh device slots."""
        self._check_lanes("append", locs.numel())
        self._join(layer)
        self._write_host(layer, locs, rows)
        self._place(layer, locs, rows)

    def insert(self, layer: int, locs: torch.Tensor, rows: torch.Tensor) -> None:
        """Tokens whose host rows are already written and whose ``rows`` are on the
        device (a prompt the SGLang plugin prefilled locally and staged): map them into
        the cache, stamped now (evictable like any appended token), and copy the rows
        device to device, so the first decode step finds them resident instead of
        recalling them over PCIe. Host ids may already be resident (rewritten in place,
        same bytes)."""
        self._check_lanes("insert", locs.numel())
        self._join(layer)
        self._place(layer, locs, rows)

    def _place(self, layer: int, locs: torch.Tensor, rows: torch.Tensor) -> None:
        c = self.cache
        alloc = self._allocate(layer, locs.reshape(-1).to(torch.int64), append=True)
        c.rows[layer].index_copy_(0, alloc.slots, rows.to(c.rows.dtype))

    # ------------------------------------------------------------------- resolve
    def resolve(self, layer: int, locs: torch.Tensor, distinct: bool = False) -> torch.Tensor:
        """Selected host ids [Q, K] (-1 = none) -> device slots [Q, K] (-1 = none);
        ``distinct``: no id occurs twice (KVCache.resolve).

        Afterwards every selected token is resident and its device row equals its host row.
        """
        self._check_lanes("resolve", locs.numel())
        pending = self._pending.pop(layer, None)
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        if pending is not None and pending.allocated is not None:
            stream.wait_event(pending.allocated)  # the maps as the prefetch left them
        alloc = self._allocate_selection(layer, locs, distinct)
        if pending is not None and pending.copied is not None:
            # Before our copies: a slot the prefetch is still filling may have just been
            # handed to one of our misses (an unselected prefetch is evictable).
            stream.wait_event(pending.copied)
        staged, copied, joined = self._staged.pop(layer, (None, None, None))
        if copied is not None:
            # The allocation above may run while rows are still being staged (staging
            # touches no cache state); the recall reads the staging buffer.
            stream.wait_event(copied)
        self._recall(layer, alloc, staged)
        if joined is not None:
            stream.wait_event(joined)  # the side stream's work ran beside the resolve
        if pending is not None:
            self._count_prefetch_hits(layer, pending)
        return alloc.slots.view(locs.shape)

    def _recall(self, layer: int, alloc: Allocation, staged: StagedRows | None = None) -> None:
        """Copy the rows of the served misses (the first ``miss_count`` of the list); with
        ``staged``, those the decode prefetch staged come from its buffer."""
        c = self.cache
        if self.use_kernels:
            from sglang_echo.kernels.recall import recall_rows  # triton only where used

            recall_rows(
                self.host_view[layer], c.rows[layer], alloc.miss_ids, alloc.miss_slots,
                alloc.miss_count, pdl=self.pdl, staged=staged,
            )  # fmt: skip
            return
        live = torch.arange(alloc.miss_ids.shape[0], device=self.device) < alloc.miss_count
        fetch = torch.where(live, alloc.miss_ids, c.scratch_host)
        slots = torch.where(live, alloc.miss_slots, c.scratch_slot)
        rows = self._read_host(layer, fetch).to(c.rows.dtype)
        if staged is not None:
            entry = staged_entries(torch.where(live, fetch, -1), staged)
            hit = entry >= 0
            rows = torch.where(hit[:, None], staged.rows[entry.clamp(min=0)], rows)
            staged.hits.add_(hit.sum())
        c.rows[layer].index_copy_(0, slots, rows)

    # ------------------------------------------------------------- staged prefetch
    def stage_ready(
        self,
        layer: int,
        staged: StagedRows,
        copied: _Event,
        joined: _Event = None,
    ) -> None:
        """The decode prefetch staged rows for ``layer``'s coming resolve; ``copied``: the
        side stream's event after its copies, which the recall waits for (None: already
        done); ``joined``: side-stream work the recall does not need (the threshold
        update), which the stream waits for after the recall, so that it runs beside the
        resolve and is still joined before the step ends (a CUDA graph's capture needs
        every forked stream joined)."""
        self._staged[layer] = (staged, copied, joined)

    # ------------------------------------------------------------------ prefetch
    def prefetch(
        self, layer: int, candidate_ids: torch.Tensor, counts: torch.Tensor | None = None
    ) -> None:
        """Map and start copying rows the coming ``resolve`` of ``layer`` will ask for:
        candidate host ids [B, cap] (-1 = none; with ``counts`` [B], lanes at and past
        counts[b] are ignored too). The prefill prefetch's only (offload/prefill_prefetcher.py:
        one call per query block, its proven top-k members that are not resident); the
        decode prefetch stages instead (``stage_ready``).

        Allocation: the same kernels/reference as append and resolve, in append mode: the
        candidates are stamped with the layer's current clock (not the resolve's clock + 1)
        and any resident token may be a victim, oldest bucket first. Nothing needs
        protection for correctness: the host holds every row and the exact top-k's
        ``resolve`` looks everything up again afterwards (an evicted token that is selected
        is a miss and is recalled). Stamped with the current clock, an unselected prefetch
        looks last used in the previous step: older than this step's selections, so the
        resolve may evict it at once, and later victim choices take it before those. This
        keeps the resolve's guarantee: all but this step's selections are evictable, so
        its misses always find slots.

        Copies: on CUDA with the Triton kernels, the allocation and the row copies run on
        a side stream forked from the current one (event fork/join, so it captures in a
        CUDA graph); ``resolve`` waits for the allocation before its own, and for the
        copies before its recall and the attention that follows. Elsewhere everything runs
        synchronously, on the current stream.
        """
        ids = candidate_ids.reshape(-1).to(torch.int64)
        if counts is not None:
            cap = candidate_ids.shape[-1]
            lane = torch.arange(cap, device=ids.device)
            live = (lane[None, :] < counts.reshape(-1, 1)).reshape(-1)
            ids = torch.where(live, ids, torch.full_like(ids, -1))
        self._check_lanes("prefetch", ids.numel())
        # A prefetch of this layer that no resolve has joined yet (prefill: one per query
        # block) is chained, not waited for: the side stream runs prefetches in order, so
        # the next resolve's join covers them all, and the main stream keeps scoring.
        # Nothing on the main stream changes this layer's maps in between (append and
        # release join first).
        previous = self._pending.pop(layer, None)
        kept = (ids,) if previous is None else (ids, previous.inputs)
        side = self._prefetch_stream()
        if side is None:
            earlier = self._chain(previous)
            alloc = self._allocate_prefetch(layer, ids)
            self._recall(layer, alloc)
            self.prefetched_rows[layer : layer + 1] += alloc.miss_count
            self._pending[layer] = _PendingPrefetch(alloc, ids.numel(), None, None, kept, earlier)
            return
        side.wait_stream(torch.cuda.current_stream(self.device))  # fork: maps, rows so far
        with torch.cuda.stream(side):
            earlier = self._chain(previous)  # before this link's allocation reuses the list
            alloc = self._allocate_prefetch(layer, ids)
            allocated = torch.cuda.Event()
            allocated.record(side)
            self._recall(layer, alloc)
            self.prefetched_rows[layer : layer + 1] += alloc.miss_count
            copied = torch.cuda.Event()
            copied.record(side)
        self._pending[layer] = _PendingPrefetch(
            alloc, ids.numel(), allocated, copied, kept, earlier
        )

    @staticmethod
    def _chain(previous: _PendingPrefetch | None) -> tuple[tuple[Allocation, int], ...]:
        """The miss lists of ``previous`` and its earlier links, the last one copied out of
        the workspace that the next allocation overwrites (on the stream that runs it)."""
        if previous is None:
            return ()
        a, n = previous.alloc, previous.lanes
        copy = Allocation(a.slots, a.miss_ids[: n + 1].clone(), a.miss_slots[: n + 1].clone(),
                          a.miss_count.clone())  # fmt: skip
        return (*previous.earlier, (copy, n))

    def _prefetch_stream(self) -> torch.cuda.Stream | None:
        """The side stream prefetch copies run on: CUDA with the Triton kernels only (the
        torch path reads host rows through host-side copies that synchronise anyway)."""
        if self.device.type != "cuda" or not self.use_kernels:
            return None
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(device=self.device)
        return self._side_stream

    def _allocate_prefetch(self, layer: int, ids: torch.Tensor) -> Allocation:
        """Append-mode allocation with its own workspace: its miss list must survive the
        resolve's allocation, which runs while the side stream still copies from it."""
        if not self.use_kernels:
            return allocate_reference(self.cache, layer, ids, append=True)
        if self._prefetch_workspace is None:
            self._prefetch_workspace = AllocWorkspace(
                self.cache, max_lanes=self.cache.num_slots, pdl=self.pdl
            )
        return allocate_kernel(self.cache, layer, ids, True, self._prefetch_workspace)

    def _join(self, layer: int) -> None:
        """Wait (on the device) for a prefetch of ``layer`` that no resolve joined."""
        pending = self._pending.pop(layer, None)
        if pending is not None and pending.copied is not None:
            torch.cuda.current_stream(self.device).wait_event(pending.copied)

    def _count_prefetch_hits(self, layer: int, pending: _PendingPrefetch) -> None:
        """Prefetched rows the resolve then selected: still mapped to their token and
        stamped with the resolve's clock (an unselected one kept the older stamp or was
        evicted). Telemetry; one launch with the kernels."""
        count = count_prefetch_hits if self.use_kernels else count_prefetch_hits_reference
        c = self.cache
        for a, lanes in (*pending.earlier, (pending.alloc, pending.lanes)):
            count(
                a.miss_ids, a.miss_slots, a.miss_count, lanes, c.device_to_host[layer],
                c.priority[layer], c.clock[layer : layer + 1],
                self.prefetch_hits[layer : layer + 1],
            )  # fmt: skip

    # ------------------------------------------------------------------- release
    def abandon_pending(self) -> None:
        """Drop the prefetches and staged rows a step left pending without joining them
        (a step that stopped half way: a failed graph capture recorded their events)."""
        self._pending.clear()
        self._staged.clear()

    def release(self, locs: torch.Tensor) -> None:
        """Host ids being freed (of any number of finished requests): unmap them in every
        layer and push their slots back, in one launch (kernels/release.py).

        Ids known on the host (a CPU tensor, as the runtime passes them) are checked first:
        the sink (0), ids outside the pool and duplicates raise ``ValueError`` before the
        cache changes. Ids on the device are not read back (no synchronisation): the kernel
        refuses the same lanes itself and counts them in ``release_errors``."""
        c = self.cache
        if locs.device.type == "cpu":
            self._check_release_ids(locs)
        ids = upload(locs.reshape(-1).to(torch.int64), self.device)  # queued, no host wait
        for layer in list(self._pending):
            self._join(layer)
        if self.use_kernels:
            release_kernel(c, ids, self.release_errors)
        else:
            release_reference(c, ids, self.release_errors)

    def _check_release_ids(self, locs: torch.Tensor) -> None:
        """Refuse the sink, ids outside [1, N_H] and duplicates (a duplicate would push one
        slot twice, and two tokens would later share it). A few vectorised passes over
        the ids on the host, outside the decode step."""
        ids = locs.reshape(-1).to(torch.int64)
        if ids.numel() == 0:
            return
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 1 or hi > self.cache.host_tokens:
            bad = lo if lo < 1 else hi
            what = "the padding sink (host row 0)" if bad == 0 else f"host id {bad}"
            raise ValueError(
                f"release of {what}: released ids must be tokens of the host pool, "
                f"1..{self.cache.host_tokens}; the caller's token bookkeeping is corrupt"
            )
        if self._release_marks is None:
            self._release_marks = torch.zeros(self.cache.host_tokens + 2, dtype=torch.int32)
        # Each id's entry gets one of its lanes (the last write wins); an id listed twice
        # then reads back another lane's number in one of its lanes. Every entry read was
        # written in this call, so the scratch needs no reset.
        lanes = torch.arange(ids.numel(), dtype=torch.int32)
        marks = self._release_marks
        marks[ids] = lanes
        twice = marks[ids] != lanes
        if bool(twice.any()):
            dup = int(ids[twice][0])
            raise ValueError(
                f"release lists host id {dup} more than once: its slot would be pushed twice "
                "and later shared by two tokens; release each token once"
            )
