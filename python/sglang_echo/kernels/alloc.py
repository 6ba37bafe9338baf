"""Cache management of one layer in one resolve or append: look up, protect, choose
victims, allocate, update both maps; Triton kernels, their launcher and the torch reference.
The launcher dispatches small calls to kernels/alloc_one_program.py (one launch) and larger
resolves to kernels/alloc_lookback.py (four); appends past the one program run the
five-launch pipeline here.

Victim policy: **bucketed LRU.** A slot's age is ``stamp - priority`` (steps since its last
use); ages below 224 are their own bucket (exact LRU for the last 224 steps) and older ages
share 32 log2-spaced buckets. Victims come from the oldest buckets first; inside the
boundary bucket the lowest slots go first; victims are handed to the misses in ascending
slot order. This needs one 256-bin histogram and two prefix counts over the slots instead
of a global sort of 260K priorities, and it is the policy the torch reference implements
too, so both give bit-identical state.

Misses are served in lane order of their first occurrence: the first ``free_count`` from
the top of the free stack, the rest by the victims. Duplicated ids (a prefill chunk's
queries overlap) are allocated once: each miss lane writes ``CLAIM + lane`` into
``host_to_device`` with an atomic min, so after the look-up kernel the entry names the
lowest lane, deterministically. Every count stays on the device and every launch has a
grid fixed by shapes, so the whole sequence can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_echo.kernels.alloc_common import (
    _ABSENT,
    _CLAIM,
    _PER_CALL,
    EXACT_AGES,
    HIST_BINS,
    NUM_BUCKETS,
    Allocation,
    AllocWorkspace,
    _add_age_histogram,
    _boundary,
    _extras_count,
    _first_miss,
    _serve_ranks,
    _slot_bucket,
    _stamp,
    _take_victims,
    _target,
)
from sglang_echo.kernels.alloc_lookback import resolve_lookback
from sglang_echo.kernels.alloc_one_program import allocate_one_program

# The cache is typed by its protocol: it lives in offload/, which depends on kernels/.
from sglang_echo.kernels.cache_layout import ABSENT, FREE, CacheState
from sglang_echo.kernels.pdl import ATOMIC_SEM, pdl_prologue


# --------------------------------------------------------------------------- reference
def age_bucket(age: torch.Tensor) -> torch.Tensor:
    """Bucket of a slot's age: exact below EXACT_AGES, then floor(log2) buckets up to 255."""
    over = (age - (EXACT_AGES - 1)).clamp(min=1)
    log2 = torch.frexp(over.to(torch.float64)).exponent.to(age.dtype) - 1  # exact
    return torch.where(age < EXACT_AGES, age, EXACT_AGES + log2.clamp(max=31))


def victim_mask(bucket: torch.Tensor, need: torch.Tensor) -> torch.Tensor:
    """Slots to evict for ``need`` misses among the evictable ones (bucket >= 0): oldest
    buckets first, lowest slots first inside the boundary bucket."""
    evictable = bucket >= 0
    counts = torch.zeros(NUM_BUCKETS + 1, dtype=torch.int64, device=bucket.device)
    counts.scatter_add_(0, bucket + 1, evictable.to(torch.int64))  # bin 0: not evictable
    suffix = counts[1:].flip(0).cumsum(0).flip(0)  # suffix[b]: evictable with bucket >= b
    b = torch.arange(NUM_BUCKETS, device=bucket.device)
    boundary = torch.where(suffix >= need, b, -1).max()
    at_boundary = boundary.clamp(min=0).view(1)  # gather, not indexing: no host read
    older_or_all = suffix.gather(0, at_boundary) - counts.gather(0, at_boundary + 1)
    older = torch.where(boundary >= 0, older_or_all[0], 0)
    at = evictable & (bucket == boundary)
    return evictable & (bucket > boundary) | at & (torch.cumsum(at, 0) <= need - older)


def allocate_reference(
    cache: CacheState, layer: int, ids: torch.Tensor, append: bool
) -> Allocation:
    """Plain-torch semantics of the kernels (fixed shapes, no host synchronisation)."""
    c = cache
    h2d, d2h, prio = c.host_to_device[layer], c.device_to_host[layer], c.priority[layer]
    lanes = ids.shape[0]
    dev = ids.device
    stamp = c.clock[layer] + (0 if append else 1)
    valid = ids >= 0
    key = torch.where(valid, ids, torch.full_like(ids, c.scratch_host))
    looked_up = h2d[key].to(torch.int64)
    hit = valid & (looked_up != ABSENT)
    miss = valid & ~hit
    # First occurrence of each id in lane order (a stable sort keeps equal ids in order).
    sorted_key, order = torch.sort(key, stable=True)
    starts = sorted_key != torch.nn.functional.pad(sorted_key[:-1], (1, 0), value=-1)
    first = torch.zeros_like(valid).scatter_(0, order, starts)
    first_miss = miss & first
    slot_idx = torch.where(hit, looked_up, torch.full_like(looked_up, c.scratch_slot))
    hit_slots = torch.zeros(c.num_slots + 2, dtype=torch.bool, device=dev)
    hit_slots.index_fill_(0, slot_idx, True)
    hit_slots.index_fill_(0, slot_idx.new_full((1,), c.scratch_slot), False)
    prio.copy_(torch.where(hit_slots, stamp, prio))

    n_miss = first_miss.sum()
    free = c.free_count[layer].to(torch.int64)
    need = (n_miss - free).clamp(min=0)
    reserve = c.eviction_reserve
    target = torch.where(need > 0, need + reserve, 0)  # victims wanted: the reserve too
    slot_range = torch.arange(c.num_slots + 2, device=dev)
    occupied = (d2h >= 1) & (slot_range >= 1) & (slot_range <= c.num_slots)
    evictable = occupied if append else occupied & (prio < stamp)
    bucket = torch.where(evictable, age_bucket(stamp - prio), torch.full_like(prio, -1))
    victim = victim_mask(bucket, target)
    cap = lanes + reserve  # victims beyond it: none (need <= lanes)
    vpos = torch.where(victim, torch.cumsum(victim, 0) - 1, cap)
    victims = torch.full((cap + 1,), c.scratch_slot, dtype=torch.int64, device=dev)
    victims.scatter_(0, vpos.clamp(max=cap), slot_range)
    n_victims = victim.sum()

    rank = torch.cumsum(first_miss, 0) - 1
    from_stack = first_miss & (rank < free)
    by_victim = first_miss & ~from_stack & (rank - free < n_victims)
    served = from_stack | by_victim
    stack_pos = (free - 1 - rank).clamp(min=0, max=c.num_slots - 1)
    victim_pos = (rank - free).clamp(min=0, max=lanes)
    slot = torch.where(
        from_stack, c.free_stack[layer][stack_pos].to(torch.int64), victims[victim_pos]
    )
    slot = torch.where(served, slot, torch.full_like(slot, c.scratch_slot))

    scratch_host = torch.full_like(ids, c.scratch_host)
    old_host = d2h[slot].to(torch.int64)
    h2d.scatter_(0, torch.where(by_victim, old_host, scratch_host), ABSENT)
    h2d.scatter_(0, torch.where(served, ids, scratch_host), slot.to(torch.int32))
    d2h.scatter_(0, slot, torch.where(served, ids, FREE).to(torch.int32))
    prio.scatter_(0, slot, stamp.expand(lanes))
    # The reserve: victims past the misses' are unmapped and left on the free stack, in
    # slot order from its bottom (every free slot was taken: need > 0).
    n_extra = torch.where(need > 0, (n_victims - need).clamp(min=0), 0)
    j = torch.arange(reserve, device=dev)
    is_extra = j < n_extra
    extra_slot = victims[(need + j).clamp(max=cap)]
    extra_at = torch.where(is_extra, extra_slot, torch.full_like(extra_slot, c.scratch_slot))
    old_extra_host = d2h[extra_at].to(torch.int64)
    h2d.scatter_(0, torch.where(is_extra, old_extra_host, c.scratch_host), ABSENT)
    d2h.scatter_(0, extra_at, FREE)
    prio.scatter_(0, extra_at, FREE)
    stack_at = torch.where(is_extra, j, c.num_slots)  # the stack's scratch entry: stays 0
    c.free_stack[layer].scatter_(0, stack_at, torch.where(is_extra, extra_slot, 0).to(torch.int32))
    # Scratch entries back to their resting values (narrow + fill: no host-to-device copy).
    h2d.narrow(0, c.scratch_host, 1).fill_(ABSENT)
    d2h.narrow(0, c.scratch_slot, 1).fill_(FREE)
    prio.narrow(0, c.scratch_slot, 1).fill_(FREE)

    out = torch.where(valid, h2d[key].to(torch.int64), -1)
    out = torch.where(out == ABSENT, torch.full_like(out, c.scratch_slot), out)
    dest = torch.where(first_miss, rank, lanes)
    miss_ids = torch.zeros(lanes + 1, dtype=torch.int64, device=dev).scatter_(0, dest, ids)
    miss_slots = torch.zeros_like(miss_ids).scatter_(0, dest, slot)
    served_count = served.sum()
    c.free_count[layer] = torch.where(need > 0, n_extra, (free - n_miss).clamp(min=0)).to(
        torch.int32
    )
    n_evicted = by_victim.sum() + n_extra
    if append:
        c.append_evictions[layer] += n_evicted
    else:
        c.clock[layer] = stamp
        c.hits[layer] += hit_slots.sum()
        c.misses[layer] += n_miss
        c.evictions[layer] += n_evicted
        c.recalled_rows[layer] += served_count
    return Allocation(out, miss_ids, miss_slots, served_count.view(1))


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _reserve_onto_stack(
    extras_ptr, free_stack_ptr, free_count_ptr, need, evictable, free, misses,
    RESERVE: tl.constexpr, LANES: tl.constexpr,
):  # fmt: skip
    """After an eviction, the reserve's victims (``extras``) onto the emptied free stack
    from its bottom; then the layer's free count: those extras, or what the misses left."""
    extras = _extras_count(need, evictable, RESERVE)
    for j0 in tl.static_range(0, RESERVE, LANES):  # masked past the extras
        j = j0 + tl.arange(0, LANES)
        moved = tl.load(extras_ptr + j, mask=j < extras, other=0)
        tl.store(free_stack_ptr + j, moved, mask=j < extras)
    left = tl.where(need > 0, extras, tl.maximum(free - misses, 0))
    tl.store(free_count_ptr, left.to(tl.int32))


@triton.jit(do_not_specialize=_PER_CALL)
def _lookup_kernel(
    ids_ptr, lanes, h2d_ptr, prio_ptr, clock_ptr, hist_ptr, miss_bound_ptr,
    LANES: tl.constexpr, HIST: tl.constexpr, PDL: tl.constexpr, SEM: tl.constexpr,
):  # fmt: skip
    """Hits stamp their slot (a plain store: duplicates write the same stamp, and appends
    count no hits); misses claim their id (the lowest lane wins) and bound the call's
    misses from above (miss lanes, duplicates included) for the count kernel."""
    pdl_prologue(PDL)
    pid = tl.program_id(0)
    lane = pid * LANES + tl.arange(0, LANES)
    ids = tl.load(ids_ptr + lane, mask=lane < lanes, other=-1).to(tl.int64)
    valid = ids >= 0
    stamp = _stamp(clock_ptr, True)
    looked_up = tl.load(h2d_ptr + ids, mask=valid, other=_ABSENT)
    hit = valid & (looked_up >= 0) & (looked_up != _ABSENT)
    stamps = tl.zeros([LANES], dtype=tl.int64) + stamp
    tl.store(prio_ptr + looked_up, stamps, mask=hit)
    claim = (lane + _CLAIM).to(tl.int32)
    missed = valid & ~hit
    tl.atomic_min(h2d_ptr + ids, claim, mask=missed, sem=SEM)
    tl.atomic_add(miss_bound_ptr, tl.sum(missed.to(tl.int32), 0), sem=SEM)
    if pid == 0:
        tl.store(hist_ptr + tl.arange(0, HIST), tl.zeros([HIST], dtype=tl.int32))


@triton.jit(do_not_specialize=_PER_CALL)
def _count_kernel(
    ids_ptr, lanes, h2d_ptr, d2h_ptr, prio_ptr, clock_ptr, hist_ptr, lane_counts_ptr,
    free_count_ptr, miss_bound_ptr, num_slots, slot_programs,
    LANES: tl.constexpr, SLOTS: tl.constexpr, PDL: tl.constexpr, SEM: tl.constexpr,
):  # fmt: skip
    """Slot programs: histogram of evictable ages, only where the misses could outnumber
    the free slots (only then is anything evicted, and only then do the rank and assign
    kernels read it; before the cache fills, no step scans its slots). Lane programs:
    first misses per block."""
    pdl_prologue(PDL)
    pid = tl.program_id(0)
    stamp = _stamp(clock_ptr, True)
    if pid < slot_programs:
        could_evict = tl.load(miss_bound_ptr) > tl.load(free_count_ptr)
        if could_evict:
            _add_age_histogram(
                pid, d2h_ptr, prio_ptr, hist_ptr, stamp, num_slots,
                APPEND=True, SLOTS=SLOTS, SEM=SEM,
            )  # fmt: skip
    else:
        l_block = pid - slot_programs
        l_lane = l_block * LANES + tl.arange(0, LANES)
        _, l_first = _first_miss(ids_ptr, lanes, h2d_ptr, l_lane)
        tl.store(lane_counts_ptr + l_block, tl.sum(l_first.to(tl.int32), 0))


@triton.jit(do_not_specialize=_PER_CALL)
def _rank_kernel(
    ids_ptr, lanes, h2d_ptr, d2h_ptr, prio_ptr, clock_ptr, hist_ptr, lane_counts_ptr,
    slot_counts_ptr, free_count_ptr, miss_ids_ptr, miss_count_ptr, buckets_ptr,
    num_slots, slot_programs, lane_programs, reserve,
    LANES: tl.constexpr, SLOTS: tl.constexpr, MAXP: tl.constexpr, PDL: tl.constexpr,
    SEM: tl.constexpr,
):  # fmt: skip
    """Lane programs: compact first misses in lane order. Slot programs: count the slots
    older than the boundary bucket and in it, per block."""
    pdl_prologue(PDL)
    pid = tl.program_id(0)
    stamp = _stamp(clock_ptr, True)
    p = tl.arange(0, MAXP)
    per_block = tl.load(lane_counts_ptr + p, mask=p < lane_programs, other=0).to(tl.int64)
    misses = tl.sum(per_block, 0)
    if pid < slot_programs:
        free = tl.load(free_count_ptr).to(tl.int64)
        need = tl.maximum(misses - free, 0)
        boundary, _older, evictable = _boundary(hist_ptr, _target(need, reserve))
        if need > 0:  # nothing is evicted otherwise: the assign kernel reads none of this
            slot = pid * SLOTS + tl.arange(0, SLOTS)
            bucket = _slot_bucket(slot, d2h_ptr, prio_ptr, stamp, num_slots, True)
            # Saved for the assign kernel: there the free-stack programs fill free slots
            # while victim programs run, and re-reading owner and priority could see one
            # half of it.
            tl.store(buckets_ptr + slot, bucket.to(tl.int16), mask=slot < num_slots + 2)
            older_here = (bucket >= 0) & (bucket > boundary)
            at_here = (bucket >= 0) & (bucket == boundary)
            tl.store(slot_counts_ptr + 2 * pid, tl.sum(older_here.to(tl.int32), 0))
            tl.store(slot_counts_ptr + 2 * pid + 1, tl.sum(at_here.to(tl.int32), 0))
        if pid == 0:
            served = tl.minimum(misses, free) + tl.minimum(need, evictable)
            tl.store(miss_count_ptr, served)
    else:
        l_block = pid - slot_programs
        l_before = tl.sum(tl.where(p < l_block, per_block, 0), 0)
        l_lane = l_block * LANES + tl.arange(0, LANES)
        l_ids, l_first = _first_miss(ids_ptr, lanes, h2d_ptr, l_lane)
        l_pos = l_before + tl.cumsum(l_first.to(tl.int64), 0) - 1
        tl.store(miss_ids_ptr + l_pos, l_ids, mask=l_first)


@triton.jit(do_not_specialize=_PER_CALL)
def _assign_kernel(
    h2d_ptr, d2h_ptr, prio_ptr, clock_ptr, hist_ptr, lane_counts_ptr, slot_counts_ptr,
    free_count_ptr, free_stack_ptr, miss_ids_ptr, miss_slots_ptr, evictions_ptr, buckets_ptr,
    extras_ptr, num_slots, slot_programs, lane_programs, scratch_slot, reserve,
    LANES: tl.constexpr, SLOTS: tl.constexpr, MAXP: tl.constexpr, MAXS: tl.constexpr,
    PDL: tl.constexpr, SEM: tl.constexpr,
):  # fmt: skip
    """Slot programs evict their victims into the misses they serve (miss rank = free +
    victim position in slot order), and the victims past the misses (the reserve) into
    the extras list the finish kernel puts on the free stack (lane programs read the stack
    in this launch); lane programs serve the misses from the free stack and give unserved
    ones back (only reachable if the cache is too small)."""
    pdl_prologue(PDL)
    pid = tl.program_id(0)
    stamp = _stamp(clock_ptr, True)
    p = tl.arange(0, MAXP)
    misses = tl.sum(tl.load(lane_counts_ptr + p, mask=p < lane_programs, other=0).to(tl.int64), 0)
    free = tl.load(free_count_ptr).to(tl.int64)
    need = tl.maximum(misses - free, 0)
    boundary, older, evictable = _boundary(hist_ptr, _target(need, reserve))
    if pid < slot_programs and need > 0:  # victims only when the free slots fall short
        q = tl.arange(0, MAXS)
        earlier = q < pid
        older_before = tl.sum(tl.load(slot_counts_ptr + 2 * q, mask=earlier, other=0), 0)
        at_before = tl.sum(tl.load(slot_counts_ptr + 2 * q + 1, mask=earlier, other=0), 0)
        slot = pid * SLOTS + tl.arange(0, SLOTS)
        bucket = tl.load(buckets_ptr + slot, mask=slot < num_slots + 2, other=-1).to(tl.int64)
        _take_victims(
            slot, bucket, older_before, at_before, boundary, _target(need, reserve) - older,
            need, free, stamp, h2d_ptr, d2h_ptr, prio_ptr, miss_ids_ptr, miss_slots_ptr,
            extras_ptr, evictions_ptr, SLOTS=SLOTS, SEM=SEM,
        )  # fmt: skip
    elif pid >= slot_programs:
        _serve_ranks(
            (pid - slot_programs) * LANES + tl.arange(0, LANES), misses, free, need, evictable,
            stamp, scratch_slot, h2d_ptr, d2h_ptr, prio_ptr, free_stack_ptr, miss_ids_ptr,
            miss_slots_ptr, LANES=LANES,
        )  # fmt: skip


@triton.jit(do_not_specialize=_PER_CALL)
def _finish_kernel(
    ids_ptr, lanes, out_ptr, h2d_ptr, hist_ptr, lane_counts_ptr, free_count_ptr,
    free_stack_ptr, extras_ptr, miss_bound_ptr, lane_programs, scratch_slot,
    LANES: tl.constexpr, MAXP: tl.constexpr, RESERVE: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Every lane reads its slot; program 0 updates the layer's scalars and, after an
    eviction, puts the reserve's victims on the emptied free stack."""
    pdl_prologue(PDL)
    pid = tl.program_id(0)
    lane = pid * LANES + tl.arange(0, LANES)
    ids = tl.load(ids_ptr + lane, mask=lane < lanes, other=-1).to(tl.int64)
    valid = ids >= 0
    slot = tl.load(h2d_ptr + ids, mask=valid, other=-1).to(tl.int64)
    slot = tl.where(slot == _ABSENT, scratch_slot, slot)
    tl.store(out_ptr + lane, tl.where(valid, slot, -1), mask=lane < lanes)
    if pid == 0:
        p = tl.arange(0, MAXP)
        per_block = tl.load(lane_counts_ptr + p, mask=p < lane_programs, other=0)
        misses = tl.sum(per_block.to(tl.int64), 0)
        free = tl.load(free_count_ptr).to(tl.int64)
        need = tl.maximum(misses - free, 0)
        _b, _o, evictable = _boundary(hist_ptr, _target(need, RESERVE))
        _reserve_onto_stack(
            extras_ptr, free_stack_ptr, free_count_ptr, need, evictable, free, misses,
            RESERVE=RESERVE, LANES=LANES,
        )  # fmt: skip
        tl.store(miss_bound_ptr, 0)  # for the next call's look-up to count into


# ---------------------------------------------------------------------------- launcher
STAGES = ("lookup", "count", "rank", "assign", "finish")


def allocate_kernel(
    cache: CacheState,
    layer: int,
    ids: torch.Tensor,
    append: bool,
    ws: AllocWorkspace,
    stage_events: list | None = None,
    distinct: bool = False,
) -> Allocation:
    """The kernels' version of :func:`allocate_reference`: one launch for a call of at
    most ``ws.one_program_lanes`` lanes (kernels/alloc_one_program.py), else four for a resolve (kernels/alloc_lookback.py)
    and five for an append; no host sync.

    ``distinct``: the caller promises no id occurs twice among ``ids`` (one query's top-k:
    its positions are distinct, and so are their host ids; a decode step of requests that
    share no location). A resolve in the one program then stamps its hits with plain
    stores, one dependent round trip less (per loop step) than the exchange that tells a
    repeated hit from a first one; the look-back launches ignore it. The promise feeds the
    hit counter only: a wrong one over-counts hits and changes nothing else (the misses'
    claims still find repeats).

    ``stage_events`` (benchmarks only): a list that gets one recorded CUDA event before the
    first launch and one after each launch (STAGES, or alloc_lookback.STAGES for a
    look-back resolve), for a per-kernel time breakdown."""

    def mark() -> None:
        if stage_events is not None:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            stage_events.append(event)

    c = cache
    lanes = ids.shape[0]
    if lanes > ws.max_lanes:
        raise ValueError(f"{lanes} lanes exceed the allocation workspace ({ws.max_lanes})")
    if ws.reserve != c.eviction_reserve:
        raise ValueError(
            f"the workspace was made for an eviction reserve of {ws.reserve}, the cache has "
            f"{c.eviction_reserve}; make the workspace from this cache"
        )
    ids = ids.contiguous()
    out = torch.empty(lanes, dtype=torch.int64, device=ids.device)
    if lanes == 0:
        ws.miss_count.zero_()
        return Allocation(out, ws.miss_ids, ws.miss_slots, ws.miss_count)
    if lanes <= ws.one_program_lanes:
        return allocate_one_program(c, layer, ids, append, ws, out, distinct, mark)
    h2d, d2h = c.host_to_device[layer], c.device_to_host[layer]
    prio, clock = c.priority[layer], c.clock[layer : layer + 1]
    free_count = c.free_count[layer : layer + 1]
    lane_programs = triton.cdiv(lanes, ws.lane_block)
    sp = ws.slot_programs
    maxp = ws.max_lane_programs_pow2
    maxs = triton.next_power_of_2(sp)
    launch = dict(num_warps=ws.num_warps, launch_pdl=ws.pdl)
    flags = dict(LANES=ws.lane_block, PDL=ws.pdl, SEM=ATOMIC_SEM, **launch)
    evictions = (c.append_evictions if append else c.evictions)[layer : layer + 1]
    if not append:
        return resolve_lookback(c, layer, ids, ws, out, mark)
    mark()
    _lookup_kernel[(lane_programs,)](
        ids, lanes, h2d, prio, clock, ws.hist, ws.miss_bound, HIST=HIST_BINS, **flags,
    )  # fmt: skip
    mark()
    both = (sp + lane_programs,)
    _count_kernel[both](
        ids, lanes, h2d, d2h, prio, clock, ws.hist, ws.lane_counts, free_count, ws.miss_bound,
        c.num_slots, sp, SLOTS=ws.slot_block, **flags,
    )  # fmt: skip
    mark()
    _rank_kernel[both](
        ids, lanes, h2d, d2h, prio, clock, ws.hist, ws.lane_counts, ws.slot_counts,
        free_count, ws.miss_ids, ws.miss_count, ws.buckets, c.num_slots, sp, lane_programs,
        ws.reserve, SLOTS=ws.slot_block, MAXP=maxp, **flags,
    )  # fmt: skip
    mark()
    _assign_kernel[both](
        h2d, d2h, prio, clock, ws.hist, ws.lane_counts, ws.slot_counts, free_count,
        c.free_stack[layer], ws.miss_ids, ws.miss_slots, evictions, ws.buckets, ws.extras,
        c.num_slots, sp, lane_programs, c.scratch_slot, ws.reserve, SLOTS=ws.slot_block,
        MAXP=maxp, MAXS=maxs, **flags,
    )  # fmt: skip
    mark()
    _finish_kernel[(lane_programs,)](
        ids, lanes, out, h2d, ws.hist, ws.lane_counts, free_count, c.free_stack[layer],
        ws.extras, ws.miss_bound, lane_programs, c.scratch_slot,
        LANES=ws.lane_block, MAXP=maxp, RESERVE=ws.reserve, PDL=ws.pdl, **launch,
    )  # fmt: skip
    mark()
    return Allocation(out, ws.miss_ids, ws.miss_slots, ws.miss_count)
