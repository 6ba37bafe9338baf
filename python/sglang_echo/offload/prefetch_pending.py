"""The prefetches of ECHO's cache that no resolve has joined yet, per layer.

Why apart from EchoManager: the prefill prefetch maps and starts copying rows the exact
top-k is certain to select before it is known (docs/ARCHITECTURE.md section 6), on a side
stream with its own allocation workspace, and the decode prefetch stages rows the next
resolve's recall takes. Which of those are pending for a layer, chaining them, joining
them (the resolve waits for their maps and copies; append and release wait first) and
counting how many prefetched rows were then selected is bookkeeping of its own; the
manager's resolve only takes what is pending for its layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sglang_echo.kernels.alloc import (
    Allocation,
    AllocWorkspace,
    allocate_kernel,
    allocate_reference,
)
from sglang_echo.kernels.decode_stage import StagedRows
from sglang_echo.kernels.prefill_prefetch import count_prefetch_hits, count_prefetch_hits_reference

Event = torch.cuda.Event | None  # a side stream's event; None: nothing to wait for


@dataclass
class PendingPrefetch:
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


def chain(previous: PendingPrefetch | None) -> tuple[tuple[Allocation, int], ...]:
    """The miss lists of ``previous`` and its earlier links, the last one copied out of
    the workspace that the next allocation overwrites (on the stream that runs it)."""
    if previous is None:
        return ()
    a, n = previous.alloc, previous.lanes
    copy = Allocation(a.slots, a.miss_ids[: n + 1].clone(), a.miss_slots[: n + 1].clone(),
                      a.miss_count.clone())  # fmt: skip
    return (*previous.earlier, (copy, n))


class Prefetches:
    """One EchoManager's pending prefill prefetches and staged decode prefetches, and
    their counters (``prefetched_rows``, ``prefetch_hits``: per layer, on the device)."""

    def __init__(self, manager: Any) -> None:
        """``manager``: the EchoManager (its cache, kernels switch, recall and lane check)."""
        self.m = manager
        cache = manager.cache
        # Prefill prefetch: its own allocation workspace (its miss list is read by the side
        # stream's copy while the resolve's allocation runs), side stream, pending ones.
        self.workspace: AllocWorkspace | None = None
        self.side_stream: torch.cuda.Stream | None = None
        self.pending: dict[int, PendingPrefetch] = {}
        # Staged decode prefetch (offload/decode_prefetcher.py): per layer, the staging
        # the next resolve's recall reads and the side stream's event after its work.
        self.staged: dict[int, tuple[StagedRows, Event, Event]] = {}
        i64 = dict(dtype=torch.int64, device=manager.device)
        self.prefetched_rows = torch.zeros(cache.num_layers, **i64)  # rows prefetched (staged)
        self.prefetch_hits = torch.zeros(cache.num_layers, **i64)  # ... and then selected

    def stage_ready(
        self,
        layer: int,
        staged: StagedRows,
        copied: Event,
        joined: Event = None,
    ) -> None:
        """The decode prefetch staged rows for ``layer``'s coming resolve; ``copied``: the
        side stream's event after its copies, which the recall waits for (None: already
        done); ``joined``: side-stream work the recall does not need (the threshold
        update), which the stream waits for after the recall, so that it runs beside the
        resolve and is still joined before the step ends (a CUDA graph's capture needs
        every forked stream joined)."""
        self.staged[layer] = (staged, copied, joined)

    def prefetch(
        self, layer: int, candidate_ids: torch.Tensor, counts: torch.Tensor | None = None
    ) -> None:
        """EchoManager.prefetch (its docstring says what it guarantees)."""
        m = self.m
        ids = candidate_ids.reshape(-1).to(torch.int64)
        if counts is not None:
            cap = candidate_ids.shape[-1]
            lane = torch.arange(cap, device=ids.device)
            live = (lane[None, :] < counts.reshape(-1, 1)).reshape(-1)
            ids = torch.where(live, ids, torch.full_like(ids, -1))
        m._check_lanes("prefetch", ids.numel())
        # A prefetch of this layer that no resolve has joined yet (prefill: one per query
        # block) is chained, not waited for: the side stream runs prefetches in order, so
        # the next resolve's join covers them all, and the main stream keeps scoring.
        # Nothing on the main stream changes this layer's maps in between (append and
        # release join first).
        previous = self.pending.pop(layer, None)
        kept = (ids,) if previous is None else (ids, previous.inputs)
        side = self.stream()
        if side is None:
            earlier = chain(previous)
            alloc = self.allocate(layer, ids)
            m._recall(layer, alloc)
            self.prefetched_rows[layer : layer + 1] += alloc.miss_count
            self.pending[layer] = PendingPrefetch(alloc, ids.numel(), None, None, kept, earlier)
            return
        side.wait_stream(torch.cuda.current_stream(m.device))  # fork: maps, rows so far
        with torch.cuda.stream(side):
            earlier = chain(previous)  # before this link's allocation reuses the list
            alloc = self.allocate(layer, ids)
            allocated = torch.cuda.Event()
            allocated.record(side)
            m._recall(layer, alloc)
            self.prefetched_rows[layer : layer + 1] += alloc.miss_count
            copied = torch.cuda.Event()
            copied.record(side)
        self.pending[layer] = PendingPrefetch(alloc, ids.numel(), allocated, copied, kept, earlier)

    def stream(self) -> torch.cuda.Stream | None:
        """The side stream prefetch copies run on: CUDA with the Triton kernels only (the
        torch path reads host rows through host-side copies that synchronise anyway)."""
        m = self.m
        if m.device.type != "cuda" or not m.use_kernels:
            return None
        if self.side_stream is None:
            self.side_stream = torch.cuda.Stream(device=m.device)
        return self.side_stream

    def allocate(self, layer: int, ids: torch.Tensor) -> Allocation:
        """Append-mode allocation with its own workspace: its miss list must survive the
        resolve's allocation, which runs while the side stream still copies from it."""
        m = self.m
        if not m.use_kernels:
            return allocate_reference(m.cache, layer, ids, append=True)
        if self.workspace is None:
            self.workspace = AllocWorkspace(m.cache, max_lanes=m.cache.num_slots, pdl=m.pdl)
        return allocate_kernel(m.cache, layer, ids, True, self.workspace)

    def join(self, layer: int) -> None:
        """Wait (on the device) for a prefetch of ``layer`` that no resolve joined."""
        pending = self.pending.pop(layer, None)
        if pending is not None and pending.copied is not None:
            torch.cuda.current_stream(self.m.device).wait_event(pending.copied)

    def join_all(self) -> None:
        """Wait (on the device) for every prefetch no resolve joined."""
        for layer in list(self.pending):
            self.join(layer)

    def count_hits(self, layer: int, pending: PendingPrefetch) -> None:
        """Prefetched rows the resolve then selected: still mapped to their token and
        stamped with the resolve's clock (an unselected one kept the older stamp or was
        evicted). Telemetry; one launch with the kernels."""
        count = count_prefetch_hits if self.m.use_kernels else count_prefetch_hits_reference
        c = self.m.cache
        for a, lanes in (*pending.earlier, (pending.alloc, pending.lanes)):
            count(
                a.miss_ids, a.miss_slots, a.miss_count, lanes, c.device_to_host[layer],
                c.priority[layer], c.clock[layer : layer + 1],
                self.prefetch_hits[layer : layer + 1],
            )  # fmt: skip

    def abandon(self) -> None:
        """Drop the prefetches and staged rows a step left pending without joining them
        (a step that stopped half way: a failed graph capture recorded their events)."""
        self.pending.clear()
        self.staged.clear()
