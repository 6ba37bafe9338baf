"""A resolve's cache management in four launches instead of five, with the lane work of a
step that evicts nothing in the first launch: programs of one launch hand each other their
counts by look-back. Triton kernels and their launcher; the reference is kernels/alloc.py's
``allocate_reference`` (the same state, bit for bit).

Why: in the five-launch pipeline each launch re-reads the ids and the map and hands its
counts to the next through a kernel boundary, though a step that evicts nothing needs only
a look-up, the lane order of the first misses and a slot from the free stack for each.
Here one launch does all of that (measured on an H200 at batch 48: benchmark/results/
cache_ops.json times both paths in one run, and a profile of this path, named in
docs/ARCHITECTURE.md section 15 "Measured choices", shows this first launch is now most of
such a step: its waits on earlier tiles, each
after a release, cost round trips much as the launch boundaries did, so a call where no
id repeats waits once, not twice):

1. Each program takes the next tile of lanes from a ticket (so it only ever waits for
   programs already running: no assumption about the order the GPU starts them in), looks
   up, stamps its hits and claims its misses (``CLAIM + lane``, an atomic min: the lowest
   lane wins), then publishes its misses count and whether a claim was already there (of
   two lanes with one id, the later to claim sees the other's).
2. Once every earlier tile has published: while no tile up to this one saw a repeated id,
   every miss is a first miss, and the earlier tiles' misses counts sum to the tile's
   first rank (one wait: decode selections repeat an id only where requests share a
   prefix, and then mostly as hits). From the first tile that saw one on, an entry that
   still holds this lane's claim makes it the id's first miss (later tiles only claim
   higher lanes); the tile publishes its first-miss count and, once those of the tiles
   from the flagged one on are in, adds them to the clean tiles' misses.
3. Misses of rank below the free count take their slot from the free stack at once.

The map (host_to_device) of the misses is written in the last launch, not here: a later
tile's atomic-min claim would overwrite a slot written while it still claims. The two slot
launches between evict (histogram, then victims in slot order, the slot tiles again
handing each other their counts) only when the misses outnumber the free slots; in every
other step they read two scalars and end. Appends keep the pipeline: their stack-served
slots would look evictable to the victim scan (an append may evict this step's stamps).
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
    CLAIM,
    Allocation,
    AllocWorkspace,
    _add_age_histogram,
    _boundary,
    _extras_count,
    _extras_onto_stack,
    _slot_bucket,
    _stamp,
    _take_victims,
    _target,
)
from sglang_echo.kernels.cache_layout import CacheState
from sglang_echo.kernels.pdl import ATOMIC_SEM, pdl_prologue

# A lane's reference in ``lane_ref``: its miss rank (>= 0, a first miss), NO_MISS (a hit or
# padding), or DUPLICATE_BASE - first lane (a repeat of an earlier lane's miss).
NO_MISS = -1
DUPLICATE_BASE = -2
_NO_MISS = tl.constexpr(NO_MISS)
_DUPLICATE_BASE = tl.constexpr(DUPLICATE_BASE)
assert CLAIM == -(2**31)


@triton.jit
def _earlier_words(words_ptr, tile, WIDTH: tl.constexpr, first=0):
    """Spin until every tile in [first, tile) has published its word (non-zero), then
    return the words (0 elsewhere). Acquire loads: what a tile wrote before publishing is
    visible after this returns (and a block barrier)."""
    p = tl.arange(0, WIDTH)
    earlier = (p >= first) & (p < tile)
    words = tl.atomic_add(words_ptr + p, 0, mask=earlier, sem="acquire")
    while tl.min(tl.where(earlier, words, 1), 0) == 0:
        words = tl.atomic_add(words_ptr + p, 0, mask=earlier, sem="acquire")
    return tl.where(earlier, words, 0)


@triton.jit
def _publish(words_ptr, tile, word):
    """Publish a tile's word after every thread of the program is done (release)."""
    tl.debug_barrier()
    tl.atomic_xchg(words_ptr + tile, word, sem="release")


@triton.jit
def _misses_and_need(call_counts_ptr):
    """First misses of the call and the free slots at its start (the first launch's last
    tile saved both: the last launch rewrites the layer's free count while its other
    programs still need the old one), and how many misses the free slots cannot serve."""
    misses = tl.load(call_counts_ptr)
    free = tl.load(call_counts_ptr + 1)
    return misses, free, tl.maximum(misses - free, 0)


@triton.jit(do_not_specialize=_PER_CALL)
def _lookup_rank_kernel(
    ids_ptr, lanes, lane_programs, out_ptr, h2d_ptr, d2h_ptr, prio_ptr, clock_ptr, hist_ptr,
    free_count_ptr, free_stack_ptr, miss_ids_ptr, miss_slots_ptr, hits_ptr, ticket_ptr,
    claimed_ptr, counts_ptr, call_counts_ptr, lane_ref_ptr,
    LANES: tl.constexpr, MAXP: tl.constexpr, PDL: tl.constexpr, SEM: tl.constexpr,
):  # fmt: skip
    """Look up, stamp hits, claim misses; rank the first misses in lane order across the
    launch (look-back); serve those the free stack covers. Tiles by ticket."""
    pdl_prologue(PDL)
    tile = tl.atomic_add(ticket_ptr, 1, sem=SEM)
    lane = tile * LANES + tl.arange(0, LANES)
    in_call = lane < lanes
    ids = tl.load(ids_ptr + lane, mask=in_call, other=-1).to(tl.int64)
    valid = ids >= 0
    stamp = _stamp(clock_ptr, False)
    free = tl.load(free_count_ptr).to(tl.int64)  # no launch writes it before the last one
    looked_up = tl.load(h2d_ptr + ids, mask=valid, other=_ABSENT)
    hit = valid & (looked_up >= 0) & (looked_up != _ABSENT)
    miss = valid & ~hit
    tl.store(out_ptr + lane, tl.where(hit, looked_up.to(tl.int64), -1), mask=in_call & ~miss)
    stamps = tl.zeros([LANES], dtype=tl.int64) + stamp
    before = tl.atomic_xchg(prio_ptr + looked_up, stamps, mask=hit, sem=SEM)
    claim = (lane + _CLAIM).to(tl.int32)
    held = tl.atomic_min(h2d_ptr + ids, claim, mask=miss, sem=SEM)
    # A claim already there (of another lane of this call: a previous call leaves none)
    # flags a repeated id; of any two lanes of one id, the later to claim sees it.
    n_miss = tl.sum(miss.to(tl.int64), 0)
    repeat_here = tl.sum((miss & (held < 0)).to(tl.int32), 0) > 0
    if tile == 0:  # the slot launches' histogram starts empty (they add only if evicting)
        tl.store(hist_ptr + tl.arange(0, _BUCKETS), tl.zeros([_BUCKETS], dtype=tl.int32))
    _publish(claimed_ptr, tile, (1 + (n_miss << 1) + repeat_here.to(tl.int64)).to(tl.int32))
    words = _earlier_words(claimed_ptr, tile, MAXP).to(tl.int64) - 1
    p = tl.arange(0, MAXP)
    earlier = p < tile
    # The first tile (up to this one) whose lanes saw a repeated id. Before it, no lane
    # repeats a lower lane's id (the later of the two to claim would have flagged it), so
    # there every miss is a first miss and a tile's count is its misses.
    flagged = tl.min(tl.where(earlier & ((words & 1) != 0), p, MAXP), 0)
    flagged = tl.where(repeat_here, tl.minimum(flagged, tile), flagged)
    clean_misses = tl.sum(tl.where(earlier & (p < flagged), words >> 1, 0), 0)
    if flagged == MAXP:  # no repeat so far: ranks from the misses counts alone
        entry = claim
        first = miss
        n_first = n_miss
        ranked_before = clean_misses
    else:
        # Every lower lane has claimed: an entry holding this lane's claim is the id's
        # first. Tiles from the flagged one on publish and read their first-miss counts.
        tl.debug_barrier()
        entry = tl.atomic_add(h2d_ptr + ids, 0, mask=miss, sem=SEM)
        first = miss & (entry == claim)
        n_first = tl.sum(first.to(tl.int64), 0)
        _publish(counts_ptr, tile, (n_first + 1).to(tl.int32))
        counted = _earlier_words(counts_ptr, tile, MAXP, flagged).to(tl.int64)
        ranked_before = clean_misses + tl.sum(tl.where(counted > 0, counted - 1, 0), 0)
    first_here = first.to(tl.int64)
    tl.atomic_add(hits_ptr, tl.sum((hit & (before != stamp)).to(tl.int64), 0), sem=SEM)
    if tile == lane_programs - 1:  # the call's counts, for the launches after this one
        tl.store(call_counts_ptr, ranked_before + n_first)
        tl.store(call_counts_ptr + 1, free)
    rank = ranked_before + tl.cumsum(first_here, 0) - first_here
    from_stack = first & (rank < free)
    slot = tl.load(free_stack_ptr + (free - 1 - rank), mask=from_stack, other=0).to(tl.int64)
    tl.store(d2h_ptr + slot, ids.to(tl.int32), mask=from_stack)
    tl.store(prio_ptr + slot, stamps, mask=from_stack)
    tl.store(miss_ids_ptr + rank, ids, mask=first)
    tl.store(miss_slots_ptr + rank, slot, mask=from_stack)
    first_lane = (entry.to(tl.int64) - _CLAIM).to(tl.int32)
    duplicate = tl.where(miss, _DUPLICATE_BASE - first_lane, _NO_MISS)
    tl.store(lane_ref_ptr + lane, tl.where(first, rank.to(tl.int32), duplicate), mask=in_call)


@triton.jit(do_not_specialize=_PER_CALL)
def _evict_hist_kernel(
    d2h_ptr, prio_ptr, clock_ptr, hist_ptr, call_counts_ptr, num_slots,
    SLOTS: tl.constexpr, PDL: tl.constexpr, SEM: tl.constexpr,
):  # fmt: skip
    """Age histogram of the evictable slots, only in a step whose misses outnumber the
    free slots."""
    pdl_prologue(PDL)
    _misses, _free, need = _misses_and_need(call_counts_ptr)
    if need > 0:
        _add_age_histogram(
            tl.program_id(0), d2h_ptr, prio_ptr, hist_ptr, _stamp(clock_ptr, False), num_slots,
            APPEND=False, SLOTS=SLOTS, SEM=SEM,
        )  # fmt: skip


# A slot tile's published word: 1 + (older << AT_BITS) + at (at <= SLOT_BLOCK < 2**AT_BITS).
AT_BITS = 20
_AT_BITS = tl.constexpr(AT_BITS)
_AT_MASK = tl.constexpr((1 << AT_BITS) - 1)


@triton.jit(do_not_specialize=_PER_CALL)
def _evict_victims_kernel(
    h2d_ptr, d2h_ptr, prio_ptr, clock_ptr, hist_ptr, call_counts_ptr,
    miss_ids_ptr, miss_slots_ptr, evictions_ptr, extras_ptr, ticket_ptr, slot_words_ptr,
    num_slots, reserve,
    SLOTS: tl.constexpr, MAXS: tl.constexpr, PDL: tl.constexpr, SEM: tl.constexpr,
):  # fmt: skip
    """Victims in slot order (the tiles' older and boundary counts by look-back), each
    serving the miss of rank free + its position or joining the reserve's extras."""
    pdl_prologue(PDL)
    _misses, free, need = _misses_and_need(call_counts_ptr)
    if need > 0:
        tile = tl.atomic_add(ticket_ptr, 1, sem=SEM)
        stamp = _stamp(clock_ptr, False)
        target = _target(need, reserve)
        boundary, older, _evictable = _boundary(hist_ptr, target)
        slot = tile * SLOTS + tl.arange(0, SLOTS)
        bucket = _slot_bucket(slot, d2h_ptr, prio_ptr, stamp, num_slots, False)
        older_here = tl.sum(((bucket >= 0) & (bucket > boundary)).to(tl.int64), 0)
        at_here = tl.sum(((bucket >= 0) & (bucket == boundary)).to(tl.int64), 0)
        _publish(slot_words_ptr, tile, 1 + (older_here << _AT_BITS) + at_here)
        words = _earlier_words(slot_words_ptr, tile, MAXS) - 1
        earlier = words >= 0
        older_before = tl.sum(tl.where(earlier, words >> _AT_BITS, 0), 0)
        at_before = tl.sum(tl.where(earlier, words & _AT_MASK, 0), 0)
        _take_victims(
            slot, bucket, older_before, at_before, boundary, target - older, need, free,
            stamp, h2d_ptr, d2h_ptr, prio_ptr, miss_ids_ptr, miss_slots_ptr, extras_ptr,
            evictions_ptr, SLOTS=SLOTS, SEM=SEM,
        )  # fmt: skip


@triton.jit(do_not_specialize=_PER_CALL)
def _map_misses_kernel(
    ids_ptr, lanes, out_ptr, h2d_ptr, clock_ptr, hist_ptr, call_counts_ptr, free_count_ptr,
    free_stack_ptr, extras_ptr, miss_slots_ptr, miss_count_ptr, misses_ptr, recalled_ptr,
    tickets_ptr, claimed_ptr, counts_ptr, slot_words_ptr, slot_programs, lane_ref_ptr,
    scratch_slot, reserve,
    LANES: tl.constexpr, WORDS: tl.constexpr, PDL: tl.constexpr, SEM: tl.constexpr,
):  # fmt: skip
    """Each miss lane's slot (a repeat reads its first lane's rank), the map of the first
    misses (their slot, or absent again if the cache could not serve them); the reserve's
    victims onto the emptied free stack; program 0 updates the layer's scalars and resets
    the tickets; each program resets its tile's words for the next call."""
    pdl_prologue(PDL)
    pid = tl.program_id(0)
    misses, free, need = _misses_and_need(call_counts_ptr)
    evictable = tl.zeros([], dtype=tl.int64)
    if need > 0:  # the histogram is read only by a step that evicts
        _b, _o, evictable = _boundary(hist_ptr, _target(need, reserve))
    served = tl.minimum(misses, free) + tl.minimum(need, evictable)
    lane = pid * LANES + tl.arange(0, LANES)
    in_call = lane < lanes
    ref = tl.load(lane_ref_ptr + lane, mask=in_call, other=_NO_MISS)
    repeat = ref <= _DUPLICATE_BASE
    first_rank = tl.load(lane_ref_ptr + (_DUPLICATE_BASE - ref), mask=repeat, other=0)
    rank = tl.where(repeat, first_rank, ref).to(tl.int64)
    missed = in_call & (ref != _NO_MISS)
    served_lane = missed & (rank < served)
    slot = tl.load(miss_slots_ptr + rank, mask=served_lane, other=0)
    slot = tl.where(served_lane, slot, scratch_slot)
    tl.store(out_ptr + lane, slot, mask=missed)
    first = in_call & (ref >= 0)
    ids = tl.load(ids_ptr + lane, mask=first, other=0).to(tl.int64)
    tl.store(h2d_ptr + ids, tl.where(served_lane, slot, _ABSENT).to(tl.int32), mask=first)
    tl.store(miss_slots_ptr + rank, slot, mask=first & ~served_lane)
    tl.store(claimed_ptr + pid, 0)
    tl.store(counts_ptr + pid, 0)
    # The reserve's victims onto the emptied free stack, spread over the programs (in
    # program 0 alone its thousands of rows took several dependent rounds).
    extras = _extras_count(need, evictable, reserve)
    _extras_onto_stack(
        extras_ptr, free_stack_ptr, extras, pid * LANES, tl.num_programs(0) * LANES, LANES=LANES
    )
    if pid == 0:
        left = tl.where(need > 0, extras, tl.maximum(free - misses, 0))
        tl.store(free_count_ptr, left.to(tl.int32))
        tl.store(clock_ptr, tl.load(clock_ptr) + 1)
        tl.atomic_add(misses_ptr, misses, sem=SEM)
        tl.atomic_add(recalled_ptr, served, sem=SEM)
        tl.store(miss_count_ptr, served)
        tl.store(tickets_ptr + tl.arange(0, 2), tl.zeros([2], dtype=tl.int32))
        w0 = 0
        while w0 < slot_programs:
            w = w0 + tl.arange(0, WORDS)
            tl.store(slot_words_ptr + w, tl.zeros([WORDS], dtype=tl.int64), mask=w < slot_programs)
            w0 += WORDS


STAGES = ("lookup_rank", "evict_hist", "evict_victims", "map_misses")


def resolve_lookback(
    cache: CacheState,
    layer: int,
    ids: torch.Tensor,
    ws: AllocWorkspace,
    out: torch.Tensor,
    mark: Callable[[], None] = lambda: None,
) -> Allocation:
    """A resolve (not an append) of ``ids`` in four launches; ``out`` gets a slot per lane.
    ``mark`` runs before the first launch and after each (a benchmark's stage events)."""
    if ws.slot_block >= 1 << AT_BITS:
        raise ValueError(
            f"the look-back resolve packs a slot tile's counts in {AT_BITS} bits: slot_block "
            f"must be below {1 << AT_BITS}, got {ws.slot_block}"
        )
    c = cache
    lanes = ids.shape[0]
    lane_programs = triton.cdiv(lanes, ws.lookback_lane_block)
    sp = ws.slot_programs
    h2d, d2h = c.host_to_device[layer], c.device_to_host[layer]
    prio, clock = c.priority[layer], c.clock[layer : layer + 1]
    free_count = c.free_count[layer : layer + 1]
    flags = dict(PDL=ws.pdl, SEM=ATOMIC_SEM, num_warps=ws.lookback_warps, launch_pdl=ws.pdl)
    lane_ticket, slot_ticket = ws.tickets[0:1], ws.tickets[1:2]
    claimed, counts = ws.tile_words[0], ws.tile_words[1]
    mark()
    _lookup_rank_kernel[(lane_programs,)](
        ids, lanes, lane_programs, out, h2d, d2h, prio, clock, ws.hist, free_count,
        c.free_stack[layer], ws.miss_ids, ws.miss_slots, c.hits[layer : layer + 1],
        lane_ticket, claimed, counts, ws.call_counts, ws.lane_ref,
        LANES=ws.lookback_lane_block, MAXP=ws.lookback_programs_pow2, **flags,
    )  # fmt: skip
    mark()
    _evict_hist_kernel[(sp,)](
        d2h, prio, clock, ws.hist, ws.call_counts, c.num_slots,
        SLOTS=ws.slot_block, **flags,
    )  # fmt: skip
    mark()
    _evict_victims_kernel[(sp,)](
        h2d, d2h, prio, clock, ws.hist, ws.call_counts, ws.miss_ids, ws.miss_slots,
        c.evictions[layer : layer + 1], ws.extras, slot_ticket, ws.slot_words, c.num_slots,
        ws.reserve, SLOTS=ws.slot_block, MAXS=triton.next_power_of_2(sp), **flags,
    )  # fmt: skip
    mark()
    _map_misses_kernel[(lane_programs,)](
        ids, lanes, out, h2d, clock, ws.hist, ws.call_counts, free_count, c.free_stack[layer],
        ws.extras, ws.miss_slots, ws.miss_count, c.misses[layer : layer + 1],
        c.recalled_rows[layer : layer + 1], ws.tickets, claimed, counts, ws.slot_words, sp,
        ws.lane_ref, c.scratch_slot, ws.reserve,
        LANES=ws.lookback_lane_block, WORDS=min(1024, triton.next_power_of_2(sp)),
        **flags,
    )  # fmt: skip
    mark()
    return Allocation(out, ws.miss_ids, ws.miss_slots, ws.miss_count)
