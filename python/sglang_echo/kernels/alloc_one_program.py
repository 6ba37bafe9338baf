"""Cache management of one small call in one launch: a grid of one program that does the
five-launch pipeline's work (kernels/alloc.py) phase after phase, with a block barrier in
between. Triton kernels and their launcher; the reference is kernels/alloc.py's
``allocate_reference`` (the same state, bit for bit: tests/test_kernel_alloc.py).

Why: for small batches five (or the look-back's four) dependent launches cost more than
the work, and one SM walking the lanes serially wins (calls of at most
``ONE_PROGRAM_LANES`` lanes, kernels/alloc_common.py, which says where it was measured).
kernels/alloc.py's ``allocate_kernel`` dispatches here; this module imports only
kernels/alloc_common.py, never alloc.py back.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from sglang_echo.kernels.alloc_common import (
    _ABSENT,
    _BUCKETS,
    _CLAIM,
    _PER_CALL,
    Allocation,
    AllocWorkspace,
    _boundary,
    _extras_count,
    _extras_onto_stack,
    _first_miss,
    _serve_ranks,
    _slot_bucket,
    _stamp,
    _take_victims,
    _target,
)

# The cache is typed by its protocol: it lives in offload/, which depends on kernels/.
from sglang_echo.kernels.cache_layout import CacheState
from sglang_echo.kernels.pdl import ATOMIC_SEM, pdl_prologue


# ----------------------------------------------------------------------------- kernels
@triton.jit(do_not_specialize=_PER_CALL)
def _one_program_kernel(
    ids_ptr, lanes, out_ptr, h2d_ptr, d2h_ptr, prio_ptr, clock_ptr, hist_ptr,
    free_count_ptr, free_stack_ptr, miss_ids_ptr, miss_slots_ptr, miss_count_ptr,
    extras_ptr, hits_ptr, misses_ptr, evictions_ptr, recalled_ptr, num_slots,
    scratch_slot, reserve,
    APPEND: tl.constexpr, DISTINCT: tl.constexpr, LANES: tl.constexpr, SLOTS: tl.constexpr,
    PDL: tl.constexpr, SEM: tl.constexpr,
):  # fmt: skip
    """The five kernels' work in one program (grid 1), phase after phase with a block
    barrier in between: for small batches, where five dependent launches cost more than
    the work. The slot scans run only in a step that evicts (with the reserve, one step
    in many); the others read the lanes and the free stack only. A resolve of one block
    of lanes takes _one_block_resolve first. ``DISTINCT`` (allocate_kernel's promise):
    hits are stamped with plain stores in either case."""
    pdl_prologue(PDL)
    stamp = _stamp(clock_ptr, APPEND)
    free = tl.load(free_count_ptr).to(tl.int64)
    n_slots = num_slots + 2
    one_block = lanes <= LANES
    if APPEND:
        one_block = lanes < 0  # appends keep the loop below
    if one_block:
        _one_block_resolve(
            ids_ptr, lanes, out_ptr, h2d_ptr, d2h_ptr, prio_ptr, clock_ptr, hist_ptr,
            free_count_ptr, free_stack_ptr, miss_ids_ptr, miss_slots_ptr, miss_count_ptr,
            extras_ptr, hits_ptr, misses_ptr, evictions_ptr, recalled_ptr, num_slots,
            scratch_slot, reserve, stamp, free, n_slots,
            DISTINCT=DISTINCT, LANES=LANES, SLOTS=SLOTS, SEM=SEM,
        )  # fmt: skip
    else:
        # Look-up: hits stamp their slot and get it as their answer, misses claim their id
        # (the lowest lane wins). A call without misses (every selection resident) ends here.
        missed = tl.zeros([], dtype=tl.int32)
        start = 0
        while start < lanes:
            lane = start + tl.arange(0, LANES)
            ids = tl.load(ids_ptr + lane, mask=lane < lanes, other=-1).to(tl.int64)
            valid = ids >= 0
            looked_up = tl.load(h2d_ptr + ids, mask=valid, other=_ABSENT)
            hit = valid & (looked_up >= 0) & (looked_up != _ABSENT)
            answer = tl.where(hit, looked_up.to(tl.int64), scratch_slot)
            tl.store(out_ptr + lane, tl.where(valid, answer, -1), mask=lane < lanes)
            stamps = tl.zeros([LANES], dtype=tl.int64) + stamp
            if APPEND:
                tl.store(prio_ptr + looked_up, stamps, mask=hit)
            elif DISTINCT:  # as in _one_block_resolve: no exchange to wait for
                tl.store(prio_ptr + looked_up, stamps, mask=hit)
                tl.atomic_add(hits_ptr, tl.sum(hit.to(tl.int64), 0), sem=SEM)
            else:
                before = tl.atomic_xchg(prio_ptr + looked_up, stamps, mask=hit, sem=SEM)
                fresh = tl.sum((hit & (before != stamp)).to(tl.int64), 0)
                tl.atomic_add(hits_ptr, fresh, sem=SEM)
            miss = valid & ~hit
            tl.atomic_min(h2d_ptr + ids, (lane + _CLAIM).to(tl.int32), mask=miss, sem=SEM)
            missed += tl.sum(miss.to(tl.int32), 0)
            start += LANES
        if missed > 0:
            _one_program_misses(
                ids_ptr, lanes, out_ptr, h2d_ptr, d2h_ptr, prio_ptr, clock_ptr, hist_ptr,
                free_count_ptr, free_stack_ptr, miss_ids_ptr, miss_slots_ptr, miss_count_ptr,
                extras_ptr, misses_ptr, evictions_ptr, recalled_ptr, num_slots, scratch_slot,
                reserve, stamp, free, n_slots, APPEND=APPEND, LANES=LANES, SLOTS=SLOTS,
                SEM=SEM,
            )  # fmt: skip
        else:
            tl.store(miss_count_ptr, 0)
            tl.store(hist_ptr + tl.arange(0, _BUCKETS), tl.zeros([_BUCKETS], dtype=tl.int32))
    if not APPEND:
        tl.store(clock_ptr, stamp)


@triton.jit
def _one_block_resolve(
    ids_ptr, lanes, out_ptr, h2d_ptr, d2h_ptr, prio_ptr, clock_ptr, hist_ptr,
    free_count_ptr, free_stack_ptr, miss_ids_ptr, miss_slots_ptr, miss_count_ptr,
    extras_ptr, hits_ptr, misses_ptr, evictions_ptr, recalled_ptr, num_slots, scratch_slot,
    reserve, stamp, free, n_slots,
    DISTINCT: tl.constexpr, LANES: tl.constexpr, SLOTS: tl.constexpr, SEM: tl.constexpr,
):  # fmt: skip
    """A resolve whose lanes fit one block (a decode request at top-k 2048), in as few
    dependent round trips as its case allows: a decode step at low load finds every
    selection resident, and its cost is then the look-up's chain alone.

    - Every lane a hit: look up, stamp, answer. ``DISTINCT`` stamps with plain stores and
      counts hit lanes; otherwise an exchange tells a slot's first stamp of the step from
      a repeat's (one round trip more: its value must come back before the count).
    - Misses, no id among them twice, all of them within the free slots: the claims'
      returned values show no repeat, so each miss's rank is its position among the miss
      lanes and its slot comes from the free stack at once (the general path's rank pass
      re-reads every id and map entry first).
    - Anything else (repeated misses, or a step that evicts): the general path, from the
      claims just made. The claims never depend on ``DISTINCT``: a caller's wrong promise
      could over-count hits, never corrupt the maps."""
    lane = tl.arange(0, LANES)
    in_call = lane < lanes
    ids = tl.load(ids_ptr + lane, mask=in_call, other=-1).to(tl.int64)
    valid = ids >= 0
    looked_up = tl.load(h2d_ptr + ids, mask=valid, other=_ABSENT)
    hit = valid & (looked_up >= 0) & (looked_up != _ABSENT)
    miss = valid & ~hit
    tl.store(out_ptr + lane, tl.where(hit, looked_up.to(tl.int64), -1), mask=in_call & ~miss)
    stamps = tl.zeros([LANES], dtype=tl.int64) + stamp
    if DISTINCT:
        tl.store(prio_ptr + looked_up, stamps, mask=hit)
        fresh = tl.sum(hit.to(tl.int64), 0)
    else:
        before = tl.atomic_xchg(prio_ptr + looked_up, stamps, mask=hit, sem=SEM)
        fresh = tl.sum((hit & (before != stamp)).to(tl.int64), 0)
    tl.atomic_add(hits_ptr, fresh, sem=SEM)
    n_miss = tl.sum(miss.to(tl.int64), 0)
    if n_miss == 0:
        tl.store(miss_count_ptr, 0)
        tl.store(hist_ptr + tl.arange(0, _BUCKETS), tl.zeros([_BUCKETS], dtype=tl.int32))
    else:
        claim = (lane + _CLAIM).to(tl.int32)
        held = tl.atomic_min(h2d_ptr + ids, claim, mask=miss, sem=SEM)
        repeats = tl.sum((miss & (held < 0)).to(tl.int32), 0)
        if (repeats > 0) | (n_miss > free):
            _one_program_misses(
                ids_ptr, lanes, out_ptr, h2d_ptr, d2h_ptr, prio_ptr, clock_ptr, hist_ptr,
                free_count_ptr, free_stack_ptr, miss_ids_ptr, miss_slots_ptr, miss_count_ptr,
                extras_ptr, misses_ptr, evictions_ptr, recalled_ptr, num_slots, scratch_slot,
                reserve, stamp, free, n_slots, APPEND=False, LANES=LANES, SLOTS=SLOTS,
                SEM=SEM,
            )  # fmt: skip
        else:
            rank = tl.cumsum(miss.to(tl.int64), 0) - 1
            slot = tl.load(free_stack_ptr + (free - 1 - rank), mask=miss, other=0).to(tl.int64)
            tl.store(h2d_ptr + ids, slot.to(tl.int32), mask=miss)
            tl.store(d2h_ptr + slot, ids.to(tl.int32), mask=miss)
            tl.store(prio_ptr + slot, stamps, mask=miss)
            tl.store(miss_ids_ptr + rank, ids, mask=miss)
            tl.store(miss_slots_ptr + rank, slot, mask=miss)
            tl.store(out_ptr + lane, slot, mask=miss)
            tl.store(miss_count_ptr, n_miss)
            tl.store(free_count_ptr, (free - n_miss).to(tl.int32))
            tl.store(hist_ptr + tl.arange(0, _BUCKETS), tl.zeros([_BUCKETS], dtype=tl.int32))
            tl.atomic_add(misses_ptr, n_miss, sem=SEM)
            tl.atomic_add(recalled_ptr, n_miss, sem=SEM)


@triton.jit
def _one_program_misses(
    ids_ptr, lanes, out_ptr, h2d_ptr, d2h_ptr, prio_ptr, clock_ptr, hist_ptr,
    free_count_ptr, free_stack_ptr, miss_ids_ptr, miss_slots_ptr, miss_count_ptr,
    extras_ptr, misses_ptr, evictions_ptr, recalled_ptr, num_slots, scratch_slot, reserve,
    stamp, free, n_slots, APPEND: tl.constexpr, LANES: tl.constexpr, SLOTS: tl.constexpr,
    SEM: tl.constexpr,
):  # fmt: skip
    """The one-program kernel past its look-up, when some lane missed."""
    tl.debug_barrier()
    # First misses in lane order.
    misses = tl.zeros([], dtype=tl.int64)
    start = 0
    while start < lanes:
        lane = start + tl.arange(0, LANES)
        ids, first = _first_miss(ids_ptr, lanes, h2d_ptr, lane)
        pos = misses + tl.cumsum(first.to(tl.int64), 0) - 1
        tl.store(miss_ids_ptr + pos, ids, mask=first)
        misses += tl.sum(first.to(tl.int64), 0)
        start += LANES
    need = tl.maximum(misses - free, 0)
    target = _target(need, reserve)
    evictable = tl.zeros([], dtype=tl.int64)
    if need > 0:  # victims: an age histogram, then one pass in slot order
        hist = tl.zeros([_BUCKETS], dtype=tl.int32)
        first_slot = 0
        while first_slot < n_slots:
            slot = first_slot + tl.arange(0, SLOTS)
            bucket = _slot_bucket(slot, d2h_ptr, prio_ptr, stamp, num_slots, APPEND)
            hist += tl.histogram(bucket.to(tl.int32), _BUCKETS, mask=bucket >= 0)
            first_slot += SLOTS
        tl.store(hist_ptr + tl.arange(0, _BUCKETS), hist)
        tl.debug_barrier()
        boundary, older, evictable = _boundary(hist_ptr, target)
        quota = target - older
        older_before = tl.zeros([], dtype=tl.int64)
        at_before = tl.zeros([], dtype=tl.int64)
        first_slot = 0
        while first_slot < n_slots:
            slot = first_slot + tl.arange(0, SLOTS)
            bucket = _slot_bucket(slot, d2h_ptr, prio_ptr, stamp, num_slots, APPEND)
            n_older, n_at = _take_victims(
                slot, bucket, older_before, at_before, boundary, quota, need, free, stamp,
                h2d_ptr, d2h_ptr, prio_ptr, miss_ids_ptr, miss_slots_ptr, extras_ptr,
                evictions_ptr, SLOTS=SLOTS, SEM=SEM,
            )  # fmt: skip
            older_before += n_older
            at_before += n_at
            first_slot += SLOTS
    else:  # an empty histogram says no slot was scanned (as the pipeline's count kernel)
        tl.store(hist_ptr + tl.arange(0, _BUCKETS), tl.zeros([_BUCKETS], dtype=tl.int32))
    # Misses from the free stack (a block barrier first: the victim pass wrote maps these
    # lanes read back); unserved ones, only reachable if the cache is too small, give
    # their claim back.
    tl.debug_barrier()
    start = 0
    while start < misses:
        _serve_ranks(
            start + tl.arange(0, LANES), misses, free, need, evictable, stamp, scratch_slot,
            h2d_ptr, d2h_ptr, prio_ptr, free_stack_ptr, miss_ids_ptr, miss_slots_ptr,
            LANES=LANES,
        )  # fmt: skip
        start += LANES
    tl.debug_barrier()
    # The reserve's victims onto the emptied stack (after the reads above), then each
    # lane's slot.
    extras = _extras_count(need, evictable, reserve)
    _extras_onto_stack(extras_ptr, free_stack_ptr, extras, 0, LANES, LANES=LANES)
    start = 0
    while start < lanes:
        lane = start + tl.arange(0, LANES)
        ids = tl.load(ids_ptr + lane, mask=lane < lanes, other=-1).to(tl.int64)
        valid = ids >= 0
        slot = tl.load(h2d_ptr + ids, mask=valid, other=-1).to(tl.int64)
        slot = tl.where(slot == _ABSENT, scratch_slot, slot)
        tl.store(out_ptr + lane, tl.where(valid, slot, -1), mask=lane < lanes)
        start += LANES
    served = tl.minimum(misses, free) + tl.minimum(need, evictable)
    tl.store(miss_count_ptr, served)
    left = tl.where(need > 0, extras, tl.maximum(free - misses, 0))
    tl.store(free_count_ptr, left.to(tl.int32))
    if not APPEND:
        tl.atomic_add(misses_ptr, misses, sem=SEM)
        tl.atomic_add(recalled_ptr, served, sem=SEM)


# ---------------------------------------------------------------------------- launcher
def allocate_one_program(
    cache: CacheState,
    layer: int,
    ids: torch.Tensor,
    append: bool,
    ws: AllocWorkspace,
    out: torch.Tensor,
    distinct: bool = False,
    mark: Callable[[], None] = lambda: None,
) -> Allocation:
    """A resolve or append of ``ids`` (at most ``ws.one_program_lanes`` lanes, not empty)
    in one launch; ``out`` gets a slot per lane. ``distinct``: kernels/alloc.py's
    ``allocate_kernel`` documents the promise. ``mark`` runs before the launch and after
    it (a benchmark's stage events)."""
    c = cache
    lanes = ids.shape[0]
    h2d, d2h = c.host_to_device[layer], c.device_to_host[layer]
    prio, clock = c.priority[layer], c.clock[layer : layer + 1]
    free_count = c.free_count[layer : layer + 1]
    evictions = (c.append_evictions if append else c.evictions)[layer : layer + 1]
    mark()
    _one_program_kernel[(1,)](
        ids, lanes, out, h2d, d2h, prio, clock, ws.hist, free_count, c.free_stack[layer],
        ws.miss_ids, ws.miss_slots, ws.miss_count, ws.extras, c.hits[layer : layer + 1],
        c.misses[layer : layer + 1], evictions, c.recalled_rows[layer : layer + 1],
        c.num_slots, c.scratch_slot, ws.reserve, APPEND=append, DISTINCT=distinct and not append,
        LANES=ws.one_program_block, SLOTS=ws.slot_block, PDL=ws.pdl, SEM=ATOMIC_SEM,
        num_warps=ws.one_program_warps, launch_pdl=ws.pdl,
    )  # fmt: skip
    mark()
    return Allocation(out, ws.miss_ids, ws.miss_slots, ws.miss_count)
