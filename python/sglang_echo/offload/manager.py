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
(``Prefetches.stage_ready``). What is pending per layer is offload/prefetch_pending.py's;
the host-side check of released ids is offload/release_ids.py's.
"""

from __future__ import annotations

from functools import partial

import torch

from sglang_echo.kernels.alloc import (
    Allocation,
    AllocWorkspace,
    allocate_kernel,
    allocate_reference,
)
from sglang_echo.kernels.cache_layout import ABSENT, FREE
from sglang_echo.kernels.decode_stage import StagedRows, staged_entries
from sglang_echo.kernels.decode_write import (
    PINNED_PRIORITY,
    PROMPT_PRIORITY,
    decode_write_kernel,
    decode_write_reference,
    place_slots_all_layers,
    place_slots_all_layers_kernel,
)
from sglang_echo.kernels.host_copy import upload
from sglang_echo.kernels.release import release_kernel, release_reference
from sglang_echo.offload.device_cache import DeviceCache
from sglang_echo.offload.host_pool import HostKVPool
from sglang_echo.offload.prefetch_pending import Prefetches
from sglang_echo.offload.release_ids import ReleaseIdCheck


class EchoManager:
    """ECHO's cache operations on one host pool and device cache; collaborators:
    ``prefetches`` (what prefetches are pending per layer, and their counters) and
    ``check_release_ids`` (the host-side check of released ids)."""

    def __init__(
        self,
        host: HostKVPool,
        cache: DeviceCache,
        use_kernels: bool | None = None,
        pdl: bool = True,
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
        # Whether a decode step may be captured in a CUDA graph (host rows through the view).
        self.graph_safe = self.host_view is not None
        # Chained launches of the allocation and recall kernels where the device supports
        # them (kernels/pdl.py); the entry point hands SGLANG_ECHO_PDL down (EchoConfig.pdl).
        self.pdl = pdl
        self._workspace: AllocWorkspace | None = None
        self.prefetches = Prefetches(self)
        # The prefetch counters, per layer (the same tensors as the collaborator's).
        self.prefetched_rows = self.prefetches.prefetched_rows  # rows prefetched (staged)
        self.prefetch_hits = self.prefetches.prefetch_hits  # ... and then selected
        # Released lanes refused on the device (sink, duplicates), summed over layers.
        self.release_errors = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.check_release_ids = ReleaseIdCheck(cache.host_tokens)

    # ------------------------------------------------------------------ host I/O
    def _write_host(self, layer: int, locs: torch.Tensor, rows: torch.Tensor) -> None:
        if self.host_view is not None:
            self.host_view[layer].index_copy_(0, locs, rows.to(self.host_view.dtype))
        else:
            self.host.rows[layer].index_copy_(0, locs.cpu(), rows.to("cpu", self.host.rows.dtype))

    def write_host(
        self, layer: int, locs: torch.Tensor, rows: torch.Tensor, residents: bool = False
    ) -> None:
        """Host rows only (no device slot taken, maps untouched): tokens whose KV arrives
        from elsewhere (a decode node's transferred prompt), or a decode step's with
        SGLANG_ECHO_DECODE_PLACE=0. Through the UVA view on CUDA.

        ``residents``: ids already resident get their device row rewritten too. Why: a
        speculative verify writes its rejected positions again the next round, and such a
        location may have been recalled in between; its device row must not keep the old
        bytes (the device row of a resident id always equals its host row)."""
        self.prefetches.join(layer)
        self._write_host(layer, locs, rows)
        if not residents:
            return
        c = self.cache
        ids = locs.reshape(-1).to(torch.int64)
        slots = c.host_to_device[layer].index_select(0, ids).to(torch.int64)
        dest = torch.where(slots != ABSENT, slots, c.scratch_slot)  # the others: the scratch
        c.rows[layer].index_copy_(0, dest, rows.reshape(ids.numel(), -1).to(c.rows.dtype))

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
        self.prefetches.join_all()
        place = place_slots_all_layers_kernel if self.use_kernels else place_slots_all_layers
        return place(self.cache, locs.reshape(-1), PINNED_PRIORITY)

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
        self.prefetches.join(layer)
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
        self.prefetches.join(layer)
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
        self.prefetches.join(layer)
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
        pending = self.prefetches.pending.pop(layer, None)
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        if pending is not None and pending.allocated is not None:
            stream.wait_event(pending.allocated)  # the maps as the prefetch left them
        alloc = self._allocate_selection(layer, locs, distinct)
        if pending is not None and pending.copied is not None:
            # Before our copies: a slot the prefetch is still filling may have just been
            # handed to one of our misses (an unselected prefetch is evictable).
            stream.wait_event(pending.copied)
        staged, copied, joined = self.prefetches.staged.pop(layer, (None, None, None))
        if copied is not None:
            # The allocation above may run while rows are still being staged (staging
            # touches no cache state); the recall reads the staging buffer.
            stream.wait_event(copied)
        self._recall(layer, alloc, staged)
        if joined is not None:
            stream.wait_event(joined)  # the side stream's work ran beside the resolve
        if pending is not None:
            self.prefetches.count_hits(layer, pending)
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

    # ------------------------------------------------------------------ prefetch
    def prefetch(
        self, layer: int, candidate_ids: torch.Tensor, counts: torch.Tensor | None = None
    ) -> None:
        """Map and start copying rows the coming ``resolve`` of ``layer`` will ask for:
        candidate host ids [B, cap] (-1 = none; with ``counts`` [B], lanes at and past
        counts[b] are ignored too). The prefill prefetch's only (offload/prefill_prefetcher.py:
        one call per query block, its proven top-k members that are not resident); the
        decode prefetch stages instead (``Prefetches.stage_ready``).

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
        self.prefetches.prefetch(layer, candidate_ids, counts)

    # ------------------------------------------------------------------- release
    def release(self, locs: torch.Tensor) -> None:
        """Host ids being freed (of any number of finished requests): unmap them in every
        layer and push their slots back, in one launch (kernels/release.py).

        Ids known on the host (a CPU tensor, as the runtime passes them) are checked first:
        the sink (0), ids outside the pool and duplicates raise ``ValueError`` before the
        cache changes. Ids on the device are not read back (no synchronisation): the kernel
        refuses the same lanes itself and counts them in ``release_errors``."""
        c = self.cache
        if locs.device.type == "cpu":
            self.check_release_ids(locs)
        ids = upload(locs.reshape(-1).to(torch.int64), self.device)  # queued, no host wait
        self.prefetches.join_all()
        if self.use_kernels:
            release_kernel(c, ids, self.release_errors)
        else:
            release_reference(c, ids, self.release_errors)
