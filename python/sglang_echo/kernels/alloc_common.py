"""What the allocation launchers share: kernels/alloc.py (the five-launch pipeline, the
torch reference), kernels/alloc_one_program.py (a small call in one program) and
kernels/alloc_lookback.py (a resolve in four launches).

The victim policy's constants, the launch shape, the ``Allocation`` they return, the
``AllocWorkspace`` they launch into, and the Triton device functions they compile in
(stamp, age bucket, histogram, boundary, victims, the reserve's extras, first misses,
serving ranks from the free stack). They live here, not in alloc.py, so that each launcher
imports them and none imports another back; their reference is alloc.py's
``allocate_reference``, which every launcher matches bit for bit
(tests/test_kernel_alloc.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# The cache is typed by its protocol: it lives in offload/, which depends on kernels/.
# The launch shape and the histogram's width, where the sizing code can read them without
# torch or triton (offload/footprint.py).
from sglang_echo.kernels.alloc_geometry import (
    HIST_BINS,
    LANE_BLOCK,
    LOOKBACK_LANE_BLOCK,
    LOOKBACK_WARPS,
    NUM_BUCKETS,
    NUM_WARPS,
    SLOT_BLOCK,
    workspace_bytes,
)
from sglang_echo.kernels.cache_layout import ABSENT, FREE, CacheState
from sglang_echo.kernels.pdl import use_pdl

CLAIM = -(2**31)  # host_to_device value CLAIM + lane: lane is the id's first miss lane
EXACT_AGES = 224  # ages below this are exact buckets; older ones share log2 buckets
# Calls of at most this many lanes run as one program (_one_program_kernel): up to a batch
# of two decode requests at top-k 2048. Why: one SM walking the lanes serially beats a
# chain of launches while the work is small. On an H200 (cache_ops.json's
# one_program_study, 8 layer-steps per graph replay; the evidence row "cache-management
# kernels") it wins at batches 1 and 2 with every selection resident (a decode node's
# placed prompts at low load: look-ups only); with misses it loses at batch 2 (and, since
# the look-back launches took their own shape, a little at batch 1), and at batch 4 even
# when resident (the first run: docs/ARCHITECTURE.md section 15, "Measured choices").
# Past it, the look-back launches (resolves) or the pipeline (appends).
ONE_PROGRAM_LANES = 4096
# Its width: at batch 1 with every selection resident, 16 warps were the fastest of 4, 8,
# 16 and 32 in five interleaved rounds on an H200, each of its rounds faster than any of
# 32's (the log: docs/ARCHITECTURE.md section 15, "Measured choices").
ONE_PROGRAM_WARPS = 16
ONE_PROGRAM_BLOCK = 2048  # lanes per step of its loops: a batch of one in one step
# (cache_ops.json's one_program_study times 4,096 too: a batch of two in one step)


@dataclass
class Allocation:
    """What one resolve/append produced: a slot per lane, and the compacted misses (ids,
    slots, count on the device) that the recall copies."""

    slots: torch.Tensor  # [lanes] int64, -1 where the lane selected nothing
    miss_ids: torch.Tensor  # [>= lanes] int64; the first ``miss_count`` are valid
    miss_slots: torch.Tensor  # same length, int64
    miss_count: torch.Tensor  # [1] int64


# ------------------------------------------------------------------ device functions
_ABSENT = tl.constexpr(ABSENT)
_CLAIM = tl.constexpr(CLAIM)
_EXACT = tl.constexpr(EXACT_AGES)
_BUCKETS = tl.constexpr(NUM_BUCKETS)
_FREE = tl.constexpr(FREE)
# Arguments that change from call to call (lane counts; prefill appends and resolves have
# any size). Triton would otherwise compile a variant per value class (== 1, multiple of
# 16): compiles in the middle of serving, seconds each.
_PER_CALL = ("lanes", "lane_programs")


@triton.jit
def _stamp(clock_ptr, APPEND: tl.constexpr):
    """The step's logical time: a resolve advances the layer's clock, an append does not."""
    stamp = tl.load(clock_ptr)
    if not APPEND:
        stamp += 1
    return stamp


@triton.jit
def _slot_bucket(slot, d2h_ptr, prio_ptr, stamp, num_slots, APPEND: tl.constexpr):
    """Age bucket of each slot, -1 where the slot may not be evicted."""
    token_slot = (slot >= 1) & (slot <= num_slots)
    owner = tl.load(d2h_ptr + slot, mask=token_slot, other=-1)
    prio = tl.load(prio_ptr + slot, mask=token_slot, other=0)
    if APPEND:  # noqa: SIM108 (a constexpr branch: one of the two is compiled)
        evictable = token_slot & (owner >= 1)
    else:
        evictable = token_slot & (owner >= 1) & (prio < stamp)
    age = stamp - prio
    # floor(log2(over)) from the float64 exponent (exact: ages are far below 2**53), in
    # place of 31 shift-and-compare steps; capped at 31 like the reference.
    over = tl.maximum(age - (_EXACT - 1), 1)
    exponent = (over.to(tl.float64).to(tl.int64, bitcast=True) >> 52) - 1023
    bucket = tl.where(age < _EXACT, age, tl.minimum(exponent, 31) + _EXACT)
    return tl.where(evictable, bucket, -1)


@triton.jit
def _add_age_histogram(
    tile, d2h_ptr, prio_ptr, hist_ptr, stamp, num_slots,
    APPEND: tl.constexpr, SLOTS: tl.constexpr, SEM: tl.constexpr,
):  # fmt: skip
    """Add one tile of slots' evictable ages to the launch's histogram (256 masked bins,
    not 512 with the unevictable slots in the upper half)."""
    slot = tile * SLOTS + tl.arange(0, SLOTS)
    bucket = _slot_bucket(slot, d2h_ptr, prio_ptr, stamp, num_slots, APPEND)
    counts = tl.histogram(bucket.to(tl.int32), _BUCKETS, mask=bucket >= 0)
    tl.atomic_add(hist_ptr + tl.arange(0, _BUCKETS), counts, sem=SEM)


@triton.jit
def _target(need, reserve):
    """Victims wanted: none, or the misses' worth and the reserve."""
    return tl.where(need > 0, need + reserve, 0)


@triton.jit
def _boundary(hist_ptr, need):
    """Boundary bucket (oldest-first suffix count reaches ``need``), the number of
    evictable slots strictly older than it, and the number of evictable slots."""
    bins = tl.arange(0, _BUCKETS)
    h = tl.load(hist_ptr + bins).to(tl.int64)
    total = tl.sum(h, 0)
    suffix = total - tl.cumsum(h, 0) + h
    boundary = tl.max(tl.where(suffix >= need, bins, -1), 0)
    older = tl.sum(tl.where(bins > boundary, h, 0), 0)
    return boundary, older, total


@triton.jit
def _take_victims(
    slot, bucket, older_before, at_before, boundary, quota, need, free, stamp, h2d_ptr,
    d2h_ptr, prio_ptr, miss_ids_ptr, miss_slots_ptr, extras_ptr, evictions_ptr,
    SLOTS: tl.constexpr, SEM: tl.constexpr,
):  # fmt: skip
    """Victims among a block of slots (evictable ones older than the boundary bucket, and
    the boundary's first ``quota`` in slot order, counting the ``older_before`` and
    ``at_before`` of earlier blocks): each serves the miss of rank free + its position, or
    past ``need`` joins the reserve's extras. Returns the block's older and boundary
    counts (the next block's prefix)."""
    is_older = ((bucket >= 0) & (bucket > boundary)).to(tl.int64)
    is_at = ((bucket >= 0) & (bucket == boundary)).to(tl.int64)
    at_rank = at_before + tl.cumsum(is_at, 0) - is_at
    victim = (is_older > 0) | ((is_at > 0) & (at_rank < quota))
    pos = older_before + tl.cumsum(is_older, 0) - is_older + tl.minimum(at_rank, quota)
    serves = victim & (pos < need)
    extra = victim & (pos >= need)
    rank = free + pos
    ids = tl.load(miss_ids_ptr + rank, mask=serves, other=0)
    old_host = tl.load(d2h_ptr + slot, mask=victim, other=0)
    tl.store(h2d_ptr + old_host, _ABSENT, mask=victim)
    tl.store(h2d_ptr + ids, slot.to(tl.int32), mask=serves)
    tl.store(d2h_ptr + slot, tl.where(serves, ids, _FREE).to(tl.int32), mask=victim)
    stamps = tl.zeros([SLOTS], dtype=tl.int64) + stamp
    tl.store(prio_ptr + slot, tl.where(serves, stamps, _FREE), mask=victim)
    tl.store(miss_slots_ptr + rank, slot.to(tl.int64), mask=serves)
    tl.store(extras_ptr + (pos - need), slot.to(tl.int32), mask=extra)
    tl.atomic_add(evictions_ptr, tl.sum(victim.to(tl.int64), 0), sem=SEM)
    return tl.sum(is_older, 0), tl.sum(is_at, 0)


@triton.jit
def _extras_count(need, evictable, reserve):
    """The reserve's victims of a step that evicts (those past its misses' own), else 0."""
    return tl.where(need > 0, tl.maximum(tl.minimum(need + reserve, evictable) - need, 0), 0)


@triton.jit
def _extras_onto_stack(extras_ptr, free_stack_ptr, extras, first, stride, LANES: tl.constexpr):
    """The reserve's ``extras`` victims onto the bottom of the emptied free stack, LANES at a
    time from ``first``, every ``stride`` (one program: 0 and LANES; a launch's programs
    share the move with their own first and stride)."""
    j0 = first
    while j0 < extras:
        j = j0 + tl.arange(0, LANES)
        tl.store(free_stack_ptr + j, tl.load(extras_ptr + j, mask=j < extras), mask=j < extras)
        j0 += stride


@triton.jit
def _serve_ranks(
    rank, misses, free, need, evictable, stamp, scratch_slot, h2d_ptr, d2h_ptr, prio_ptr,
    free_stack_ptr, miss_ids_ptr, miss_slots_ptr, LANES: tl.constexpr,
):  # fmt: skip
    """Misses of these ranks served from the free stack's top; unserved ones (past the
    free slots and the victims: only if the cache is too small) give their claim back."""
    live = rank < misses
    from_stack = live & (rank < free)
    unserved = live & (rank >= free + tl.minimum(need, evictable))
    ids = tl.load(miss_ids_ptr + rank, mask=live, other=0)
    slot = tl.load(free_stack_ptr + (free - 1 - rank), mask=from_stack, other=0)
    tl.store(h2d_ptr + ids, slot, mask=from_stack)
    tl.store(d2h_ptr + slot, ids.to(tl.int32), mask=from_stack)
    tl.store(prio_ptr + slot, tl.zeros([LANES], dtype=tl.int64) + stamp, mask=from_stack)
    tl.store(miss_slots_ptr + rank, slot.to(tl.int64), mask=from_stack)
    tl.store(h2d_ptr + ids, _ABSENT, mask=unserved)
    scratch = tl.zeros([LANES], tl.int64) + scratch_slot
    tl.store(miss_slots_ptr + rank, scratch, mask=unserved)


@triton.jit
def _first_miss(ids_ptr, lanes, h2d_ptr, lane):
    ids = tl.load(ids_ptr + lane, mask=lane < lanes, other=-1).to(tl.int64)
    valid = ids >= 0
    entry = tl.load(h2d_ptr + ids, mask=valid, other=0)
    return ids, valid & (entry == (lane + _CLAIM).to(tl.int32))


# ------------------------------------------------------------------------ workspace
class AllocWorkspace:
    """Scratch buffers of the kernels, allocated once per cache (fixed addresses, so a
    captured graph replays against the same memory), and their launch shape: the module's
    LANE_BLOCK, SLOT_BLOCK, NUM_WARPS, ONE_PROGRAM_* and LOOKBACK_* (read here, not at
    import: tests make workspaces with small blocks by setting them) and whether launches
    chain (PDL). The shape changes speed only, never the state."""

    # Its bytes from sizes alone, at the default geometry (kernels/alloc_geometry.py).
    bytes_for = staticmethod(workspace_bytes)

    def __init__(self, cache: CacheState, max_lanes: int, pdl: bool = True) -> None:
        dev = cache.device
        self.max_lanes = max_lanes
        self.lane_block, self.slot_block, self.num_warps = LANE_BLOCK, SLOT_BLOCK, NUM_WARPS
        # Chained launches (kernels/pdl.py) where the device supports them, unless ``pdl``
        # (the offload layer's SGLANG_ECHO_PDL) is off.
        self.pdl = use_pdl(dev, pdl)
        # Calls of at most this many lanes take the one-program path (0: never); past it a
        # resolve takes kernels/alloc_lookback.py's four launches, an append the five-launch
        # pipeline.
        self.one_program_lanes = ONE_PROGRAM_LANES
        self.one_program_warps = ONE_PROGRAM_WARPS
        # Lanes per step of the one program's loops (a resolve of at most this many takes
        # its one-block path).
        self.one_program_block = ONE_PROGRAM_BLOCK
        # The look-back's lanes per program and warps (all four of its launches).
        self.lookback_lane_block, self.lookback_warps = LOOKBACK_LANE_BLOCK, LOOKBACK_WARPS
        self.slot_programs = triton.cdiv(cache.num_slots + 2, self.slot_block)
        lane_programs = max(1, triton.cdiv(max_lanes, self.lane_block))
        # Width of the kernels' scan over per-block lane counts: fixed per workspace (not
        # per call), so a new lane count never compiles a new kernel variant.
        self.max_lane_programs_pow2 = triton.next_power_of_2(lane_programs)
        self.hist = torch.zeros(HIST_BINS, dtype=torch.int32, device=dev)
        self.lane_counts = torch.zeros(lane_programs, dtype=torch.int32, device=dev)
        self.slot_counts = torch.zeros(2 * self.slot_programs, dtype=torch.int32, device=dev)
        self.miss_ids = torch.zeros(max_lanes + 1, dtype=torch.int64, device=dev)
        self.miss_slots = torch.zeros(max_lanes + 1, dtype=torch.int64, device=dev)
        self.miss_count = torch.zeros(1, dtype=torch.int64, device=dev)
        # Miss lanes of the call in progress (the look-up adds, the finish kernel zeroes).
        self.miss_bound = torch.zeros(1, dtype=torch.int32, device=dev)
        # The reserve's victims of the call in progress (the finish kernel moves them).
        self.reserve = cache.eviction_reserve
        self.extras = torch.zeros(max(1, self.reserve), dtype=torch.int32, device=dev)
        self.buckets = torch.full((cache.num_slots + 2,), -1, dtype=torch.int16, device=dev)
        # The look-back resolve's: tickets (lane tiles, slot tiles), each lane tile's
        # "claimed" and first-miss count words, each slot tile's counts word, the call's
        # first misses and free slots at its start, and each lane's miss rank or first
        # lane. The tickets and words are zero between calls.
        self.tickets = torch.zeros(2, dtype=torch.int32, device=dev)
        lookback_programs = max(1, triton.cdiv(max_lanes, self.lookback_lane_block))
        self.lookback_programs_pow2 = triton.next_power_of_2(lookback_programs)
        self.tile_words = torch.zeros(2, lookback_programs, dtype=torch.int32, device=dev)
        self.slot_words = torch.zeros(self.slot_programs, dtype=torch.int64, device=dev)
        self.call_counts = torch.zeros(2, dtype=torch.int64, device=dev)
        self.lane_ref = torch.zeros(max(1, max_lanes), dtype=torch.int32, device=dev)
