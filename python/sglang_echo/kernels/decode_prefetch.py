"""Decode intra-query prefetch: while the fp8 indexer scores a request's keys, the same
kernel copies the misses its exact top-k will probably select into free device slots, so
most of the recall happens during the logits instead of after the top-k.

A key is a candidate when its logit beats the request's predicted threshold (``theta[b]``,
offload.predictor.DecodeThresholdPredictor: an EMA of the request's previous exact k-th
scores) and its host id is not resident in the layer's device cache (``host_to_device[id]
== ABSENT``). Each logits program, right after a key block's logits, takes its candidates:

1. a request's first ``cap`` candidates (a per-request counter; the order is the order
   the programs reach it, not position order);
2. a claim of the id (compare-and-swap ABSENT -> PENDING, so an id two requests share is
   fetched once);
3. a free slot from the top of the layer's free stack (a counter; none left: the claim is
   given back and the resolve recalls the token);
4. the maps (the slot is stamped with the layer's current clock, like an append: looking
   last used in the previous step, an unselected fetch is evictable by this step's
   resolve, which keeps its guarantee that every miss finds a slot) and the row, copied
   from pinned host memory through its device alias.

A one-program launch after it settles the free count and resets the counters. The copies
run on the logits kernel's own programs: each waits on its PCIe read
while the SM's other programs compute, so the transfer overlaps the logits with no side
stream, no compaction and no allocation pass. Slots come only from the free stack, which
the resolve's eviction reserve refills (offload/device_cache.py): the fetch never evicts.

Lossless by construction: the logits are computed by the same code as the plain kernel
(kernels/indexer.py ``_fp8_logits_block``), so they are bit-identical to it, the exact
top-k over them decides what attention reads, and a fetched row is a byte copy of its
host row (docs/ARCHITECTURE.md section 6). Which candidates win a contended cap or the
last free slots depends on program order, so the cache state may differ from run to run
there; what attention reads does not. :func:`decode_fetch_reference` is one serialisation
(requests in order, positions in order): the CPU path and the path of the bf16 indexer.

Two one-launch kernels serve the step's epilogue: the threshold update after the exact
top-k (DecodeThresholdPredictor.update's semantics) and the count of fetched rows the
resolve then selected (telemetry).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from sglang_echo.kernels.cache_layout import ABSENT
from sglang_echo.kernels.indexer import (
    DEFAULT_BLOCK_N,
    DEFAULT_BLOCKS_PER_PROGRAM,
    DEFAULT_NUM_STAGES,
    _check,
    _fp8_logits_block,
    fp8_index_logits,
)

PENDING = -3  # host_to_device value of an id being fetched (never a slot, never ABSENT)
_NEVER = -2  # compare value no map entry holds: a masked lane's compare-and-swap fails
WORD_BLOCK = 32  # 4-byte words per copy tile column block (few registers: occupancy)
_PENDING = tl.constexpr(PENDING)
_NEVER_C = tl.constexpr(_NEVER)
_WORD_BLOCK = tl.constexpr(WORD_BLOCK)


class FetchTarget(NamedTuple):
    """One layer of the device cache, as the fetch writes it, and the host rows it reads
    (a device alias of pinned memory on CUDA)."""

    host_to_device: torch.Tensor  # [N_H + 2] int32
    device_to_host: torch.Tensor  # [N_G + 2] int32
    priority: torch.Tensor  # [N_G + 2] int64
    clock: torch.Tensor  # [1] int64
    free_stack: torch.Tensor  # [N_G + 1] int32
    free_count: torch.Tensor  # [1] int32
    host_rows: torch.Tensor  # [N_H + 2, W]
    dev_rows: torch.Tensor  # [N_G + 2, W]
    fetched: torch.Tensor  # [1] int64: rows fetched, summed over steps (telemetry)
    scratch_host: int


class FetchWorkspace:
    """Counters, queue and lists of one fetch (fixed addresses: graph-safe).

    ``ids``/``slots`` [max_rows * cap]: the lists of what the last fetch took, as
    ``lists_shape`` (lists, lanes per list) says: per request (inline: request b's lanes
    are b * cap .. b * cap + cap - 1) or one list in queue order (queue); the first
    ``kept[list]`` lanes of a list hold the host id and slot of each candidate taken, or -1
    and 0 where it lost its claim or found no free slot. ``ready``: an event the fetch's
    copies complete at (queue mode on CUDA), else None."""

    def __init__(self, max_rows: int, cap: int, device: torch.device | str) -> None:
        if max_rows < 1 or cap < 1:
            raise ValueError(f"need max_rows >= 1 and cap >= 1, got {max_rows} and {cap}")
        self.max_rows, self.cap = max_rows, cap
        device = torch.device(device)
        i32 = dict(dtype=torch.int32, device=device)
        self.request_counts = torch.zeros(max_rows, **i32)
        self.taken = torch.zeros(1, **i32)
        # Compare-and-swap targets of the lanes that claim nothing (one per lane: no two
        # lanes of a program contend for an address; their value 0 never matches).
        self.cas_scratch = torch.zeros(1024, **i32)
        self.ids = torch.full((max_rows * cap,), -1, dtype=torch.int64, device=device)
        self.slots = torch.zeros(max_rows * cap, dtype=torch.int64, device=device)
        self.kept = torch.zeros(max_rows, dtype=torch.int64, device=device)
        # Queue mode: candidates in arrival order (-1: not written yet), its tail (the
        # logits kernel appends), head (the copy kernel takes), the logits' done flag.
        self.queue = torch.full((max_rows * cap,), -1, dtype=torch.int64, device=device)
        self.tail = torch.zeros(1, **i32)
        self.head = torch.zeros(1, **i32)
        self.done = torch.zeros(1, **i32)
        self.lists_shape = (0, cap)
        self.ready: torch.cuda.Event | None = None
        self._side: torch.cuda.Stream | None = None

    def side_stream(self) -> torch.cuda.Stream:
        if self._side is None:
            self._side = torch.cuda.Stream(device=self.ids.device)
        return self._side


# ----------------------------------------------------------------------------- kernel
@triton.jit
def _claim_copy(
    loc, want, lane, clock, free0, h2d_ptr, d2h_ptr, prio_ptr, free_stack_ptr, host_ptr,
    dev_ptr, host_stride, dev_stride, taken_ptr, ids_ptr, slots_ptr, cas_scratch_ptr,
    N: tl.constexpr, WORDS: tl.constexpr, ABSENT_ID: tl.constexpr, COPY: tl.constexpr,
):  # fmt: skip
    """Steps 2-4 of the module docstring for the lanes in ``want``; list entry ``lane``."""
    target = tl.where(want, h2d_ptr + loc, cas_scratch_ptr + tl.arange(0, N))
    expect = tl.where(want, ABSENT_ID, _NEVER_C)
    before = tl.atomic_cas(target, expect, tl.zeros_like(expect) + _PENDING)
    won = want & (before == ABSENT_ID)
    w = won.to(tl.int32)
    first = tl.atomic_add(taken_ptr, tl.sum(w, 0))
    k = (first + tl.cumsum(w, 0) - 1).to(tl.int64)
    has = won & (k < free0)
    slot = tl.load(free_stack_ptr + (free0 - 1 - k), mask=has, other=0).to(tl.int64)
    tl.store(h2d_ptr + loc, tl.where(has, slot, ABSENT_ID).to(tl.int32), mask=won)
    tl.store(d2h_ptr + slot, loc.to(tl.int32), mask=has)
    tl.store(prio_ptr + slot, tl.zeros([N], dtype=tl.int64) + clock, mask=has)
    if COPY:
        for w0 in tl.static_range(0, WORDS, _WORD_BLOCK):
            col = w0 + tl.arange(0, _WORD_BLOCK)
            m = has[:, None] & (col[None, :] < WORDS)
            row = tl.load(host_ptr + loc[:, None] * host_stride + col[None, :], mask=m)
            tl.store(dev_ptr + slot[:, None] * dev_stride + col[None, :], row, mask=m)
    tl.store(ids_ptr + lane, tl.where(has, loc, -1), mask=want)
    tl.store(slots_ptr + lane, slot, mask=want)


@triton.jit
def _fp8_logits_fetch_kernel(
    q_ptr, w_ptr, k_ptr, k_scale_ptr, locs_ptr, lens_ptr, out_ptr, theta_ptr,
    h2d_ptr, d2h_ptr, prio_ptr, clock_ptr, free_stack_ptr, free_count_ptr,
    host_ptr, dev_ptr, counts_ptr, taken_ptr, ids_ptr, slots_ptr, cas_scratch_ptr,
    queue_ptr, tail_ptr, qcap,
    length, k_stride, k_scale_stride, locs_stride, out_stride, host_stride, dev_stride, cap,
    H: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr,
    PRECISE_ACC: tl.constexpr, KEYS_AS_M: tl.constexpr, ABSENT_ID: tl.constexpr,
    WORDS: tl.constexpr, COPY: tl.constexpr, QUEUE: tl.constexpr,
):  # fmt: skip
    """The plain logits kernel, plus each key block's candidates: fetched here (inline),
    or (QUEUE) appended to a queue that a concurrent copy kernel drains."""
    b = tl.program_id(0)
    d = tl.arange(0, D)
    h = tl.arange(0, H)
    q = tl.load(q_ptr + b * H * D + h[:, None] * D + d[None, :])
    w = tl.load(w_ptr + b * H + h)
    seq_len = tl.load(lens_ptr + b)
    theta = tl.load(theta_ptr + b)
    clock = tl.load(clock_ptr)
    free0 = tl.load(free_count_ptr).to(tl.int64)  # the settle launch writes it, after
    first = tl.program_id(1) * BLOCKS * BLOCK_N
    for i in range(BLOCKS):
        n = first + i * BLOCK_N + tl.arange(0, BLOCK_N)
        logits, loc, live = _fp8_logits_block(
            q, w, k_ptr, k_scale_ptr, locs_ptr, b, n, seq_len, k_stride, k_scale_stride,
            locs_stride, D=D, PRECISE_ACC=PRECISE_ACC, KEYS_AS_M=KEYS_AS_M,
        )  # fmt: skip
        tl.store(out_ptr + b * out_stride + n, logits, mask=n < length)
        # The residency map is read only for keys above theta: a few per request.
        over = live & (logits > theta)
        slot = tl.load(h2d_ptr + loc, mask=over, other=0)
        cand = over & (slot == ABSENT_ID)
        c = cand.to(tl.int32)
        found = tl.sum(c, 0)
        if found > 0:
            if QUEUE:  # one atomic per block; the copy kernel does the rest
                at = tl.atomic_add(tail_ptr, found) + tl.cumsum(c, 0) - 1
                tl.store(queue_ptr + at, loc, mask=cand & (at < qcap))
            else:  # step 1 (the request's cap), then 2-4 here
                idx = tl.atomic_add(counts_ptr + b, found) + tl.cumsum(c, 0) - 1
                within = cand & (idx < cap)
                _claim_copy(
                    loc, within, b.to(tl.int64) * cap + idx, clock, free0, h2d_ptr, d2h_ptr,
                    prio_ptr, free_stack_ptr, host_ptr, dev_ptr, host_stride, dev_stride,
                    taken_ptr, ids_ptr, slots_ptr, cas_scratch_ptr,
                    N=BLOCK_N, WORDS=WORDS, ABSENT_ID=ABSENT_ID, COPY=COPY,
                )  # fmt: skip


@triton.jit
def _flag_kernel(done_ptr):
    """Queued on the logits' stream after them: the queue is complete."""
    tl.store(done_ptr, 1)


@triton.jit
def _copy_queue_kernel(
    queue_ptr, tail_ptr, head_ptr, done_ptr, qcap, clock_ptr, free_count_ptr,
    h2d_ptr, d2h_ptr, prio_ptr, free_stack_ptr, host_ptr, dev_ptr, host_stride, dev_stride,
    taken_ptr, ids_ptr, slots_ptr, cas_scratch_ptr,
    R: tl.constexpr, WORDS: tl.constexpr, ABSENT_ID: tl.constexpr, SPIN_LIMIT: tl.constexpr,
):  # fmt: skip
    """A few programs, running beside the logits kernel: each takes R queue entries at a
    time, waits until the logits kernel has written them (or has finished), and fetches
    them (steps 2-4). Gives up after SPIN_LIMIT polls: what it leaves is only not
    fetched (the resolve recalls it), never half-mapped."""
    clock = tl.load(clock_ptr)
    free0 = tl.load(free_count_ptr).to(tl.int64)
    r = tl.arange(0, R)
    running = 1
    while running != 0:
        i0 = tl.atomic_add(head_ptr, R)
        g = i0 + r
        if i0 >= qcap:
            running = 0
        else:
            v = tl.full([R], -1, dtype=tl.int64)
            live = g < 0
            done = 0
            waiting = 1
            spins = 0
            while waiting != 0:
                v = tl.load(queue_ptr + g, mask=g < qcap, other=-1, volatile=True)
                done = tl.load(done_ptr, volatile=True)
                end = tl.minimum(tl.load(tail_ptr, volatile=True), qcap)
                live = g < end
                missing = tl.sum((live & (v < 0)).to(tl.int32), 0)
                if (missing == 0) & ((i0 + R <= end) | (done != 0)):
                    waiting = 0
                spins += 1
                if spins >= SPIN_LIMIT:
                    waiting = 0
                    running = 0
            want = live & (v >= 0)
            _claim_copy(
                v, want, g.to(tl.int64), clock, free0, h2d_ptr, d2h_ptr, prio_ptr,
                free_stack_ptr, host_ptr, dev_ptr, host_stride, dev_stride, taken_ptr, ids_ptr,
                slots_ptr, cas_scratch_ptr, N=R, WORDS=WORDS, ABSENT_ID=ABSENT_ID, COPY=True,
            )  # fmt: skip
            end_now = tl.minimum(tl.load(tail_ptr, volatile=True), qcap)
            if (done != 0) & (i0 + R >= end_now):
                running = 0


@triton.jit
def _settle_kernel(
    free_count_ptr, fetched_ptr, counts_ptr, taken_ptr, kept_ptr, cap, batch,
    queue_ptr, tail_ptr, head_ptr, done_ptr, qcap, ROWS: tl.constexpr, QUEUE: tl.constexpr,
):  # fmt: skip
    """After the fetch: the free count, telemetry, the kept counts; counters (and the
    queue) back to their resting values."""
    free0 = tl.load(free_count_ptr).to(tl.int64)
    took = tl.minimum(tl.load(taken_ptr).to(tl.int64), free0)
    tl.store(free_count_ptr, (free0 - took).to(tl.int32))
    tl.store(fetched_ptr, tl.load(fetched_ptr) + took)
    tl.store(taken_ptr, 0)
    if QUEUE:  # one list of qcap lanes: kept[0] of them queued
        end = tl.minimum(tl.load(tail_ptr), qcap)
        tl.store(kept_ptr, end.to(tl.int64))
        i0 = 0
        while i0 < end:
            i = i0 + tl.arange(0, ROWS)
            tl.store(queue_ptr + i, tl.full([ROWS], -1, dtype=tl.int64), mask=i < end)
            i0 += ROWS
        tl.store(tail_ptr, 0)
        tl.store(head_ptr, 0)
        tl.store(done_ptr, 0)
    else:
        r0 = 0
        while r0 < batch:
            r = r0 + tl.arange(0, ROWS)
            live = r < batch
            got = tl.load(counts_ptr + r, mask=live, other=0)
            tl.store(kept_ptr + r, tl.minimum(got, cap).to(tl.int64), mask=live)
            tl.store(counts_ptr + r, tl.zeros([ROWS], dtype=tl.int32), mask=live)
            r0 += ROWS


# ---------------------------------------------------------------------------- launcher
def _as_words(rows: torch.Tensor) -> torch.Tensor:
    """Rows as 4-byte words (every row format here is a multiple of 4 bytes wide)."""
    if rows.dim() != 2 or rows.stride(1) != 1:
        raise ValueError("fetch expects [rows, row_dim] tensors with contiguous rows")
    as_bytes = rows.view(torch.uint8)
    if as_bytes.shape[1] % 4 or as_bytes.stride(0) % 4:
        raise ValueError(f"rows of {as_bytes.shape[1]} bytes: the fetch copies 4-byte words")
    return as_bytes.view(torch.int32)


def _check_fetch(batch: int, length: int, locs, seq_lens, theta, target, ws, cap) -> None:
    if locs.dim() != 2 or locs.shape[0] != batch or locs.shape[1] < length:
        raise ValueError(f"locs must be [B, >= L] = [{batch}, >= {length}] host ids")
    if seq_lens.shape != (batch,):
        raise ValueError(f"seq_lens must be [B] = [{batch}], got {tuple(seq_lens.shape)}")
    if theta.shape != (batch,) or theta.dtype != torch.float32:
        raise ValueError(
            f"theta must be [B] = [{batch}] float32 (DecodeThresholdPredictor.predict), "
            f"got {tuple(theta.shape)} {theta.dtype}"
        )
    h2d = target.host_to_device
    if h2d.dim() != 1 or h2d.dtype != torch.int32:
        raise ValueError("host_to_device must be the layer's 1-D int32 map (DeviceCache)")
    if not 1 <= cap <= ws.cap or batch > ws.max_rows:
        raise ValueError(
            f"a fetch of {batch} requests x {cap} candidates needs a workspace of at least "
            f"that (has {ws.max_rows} x {ws.cap}); cap must be >= 1"
        )
    for name, t in (("locs", locs), ("theta", theta), ("host_to_device", h2d)):
        if t.device != seq_lens.device:
            raise ValueError(f"{name} is on {t.device}, seq_lens on {seq_lens.device}")


FETCH_MODES = ("inline", "queue")
# Copy programs of the queue mode: a bounded share of the SMs, so that the logits keep
# the rest (a recall over every SM overlaps nothing; 33-66 programs hid most of a 10 MB
# recall behind the logits on an H200).
QUEUE_COPY_PROGRAMS = 48
QUEUE_ROWS = 16  # queue entries a copy program takes at a time
SPIN_LIMIT = 1 << 20  # polls before a copy program gives up (never reached in practice)


def fp8_index_logits_fetch(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    key_scales: torch.Tensor,
    locs: torch.Tensor,
    seq_lens: torch.Tensor,
    theta: torch.Tensor,
    target: FetchTarget,
    ws: FetchWorkspace,
    cap: int,
    block_n: int = DEFAULT_BLOCK_N,
    num_warps: int = 4,
    num_stages: int = DEFAULT_NUM_STAGES,
    blocks_per_program: int = DEFAULT_BLOCKS_PER_PROGRAM,
    keys_as_m: bool = True,
    precise_acc: int = 32,
    copy_rows: bool = True,
    mode: str = "inline",
    copy_programs: int = QUEUE_COPY_PROGRAMS,
) -> torch.Tensor:
    """:func:`kernels.indexer.fp8_index_logits` (same arguments, bit-identical logits) that
    also fetches candidates (logit > theta[b], not resident) into free slots of ``target``
    (see the module docstring), without host synchronisation:

    - ``mode="inline"``: at most ``cap`` per request, by the logits kernel's programs;
      then a one-program settle launch.
    - ``mode="queue"``: the logits kernel appends candidates to a queue (at most
      ``max_rows * cap`` in all) that ``copy_programs`` programs drain concurrently, on a
      side stream on CUDA (fork and join by events: capturable); ``ws.ready`` is the event
      the maps and rows are complete at, which the resolve must wait for.

    ``ws`` gets the lists of what was fetched (telemetry: :func:`count_fetch_hits`).
    ``copy_rows=False`` (inline, benchmarks only: the fetch's cost without its copies)
    maps the slots but leaves their rows stale."""
    if mode not in FETCH_MODES:
        raise ValueError(f"mode must be one of {FETCH_MODES}, got {mode!r}")
    if keys.stride(1) != 1:
        raise ValueError("keys need unit stride along D")
    _check(q, weights, keys, key_scales, locs, seq_lens)
    batch, heads, dim = q.shape
    length = locs.shape[1]
    _check_fetch(batch, length, locs, seq_lens, theta, target, ws, cap)
    queue = mode == "queue"
    ws.lists_shape = (1, ws.queue.numel()) if queue else (batch, cap)
    ws.ready = None
    if length == 0 or batch == 0:
        ws.kept.zero_()
        return fp8_index_logits(q, weights, keys, key_scales, locs, seq_lens)
    if max(block_n, QUEUE_ROWS) > ws.cas_scratch.numel():
        raise ValueError(f"block_n {block_n} exceeds the workspace's {ws.cas_scratch.numel()}")
    host_w, dev_w = _as_words(target.host_rows), _as_words(target.dev_rows)
    if host_w.shape[1] != dev_w.shape[1]:
        raise ValueError("host and device rows must have the same width")
    out = torch.empty(batch, length, dtype=torch.float32, device=q.device)
    grid = (batch, triton.cdiv(length, block_n * blocks_per_program))
    t = target
    qcap = ws.queue.numel()
    maps = (t.host_to_device, t.device_to_host, t.priority)

    def logits() -> None:
        _fp8_logits_fetch_kernel[grid](
            q.contiguous(), weights.contiguous().float(), keys, key_scales, locs, seq_lens,
            out, theta.contiguous(), *maps, t.clock, t.free_stack, t.free_count, host_w,
            dev_w, ws.request_counts, ws.taken, ws.ids, ws.slots, ws.cas_scratch, ws.queue,
            ws.tail, qcap, length, keys.stride(0), key_scales.stride(0), locs.stride(0),
            out.stride(0), host_w.stride(0), dev_w.stride(0), cap,
            H=heads, D=dim, BLOCK_N=block_n, BLOCKS=blocks_per_program,
            PRECISE_ACC=precise_acc, KEYS_AS_M=keys_as_m, ABSENT_ID=ABSENT,
            WORDS=host_w.shape[1], COPY=copy_rows, QUEUE=queue, num_warps=num_warps,
            num_stages=num_stages,
        )  # fmt: skip

    def copy_queue() -> None:
        _copy_queue_kernel[(max(1, copy_programs),)](
            ws.queue, ws.tail, ws.head, ws.done, qcap, t.clock, t.free_count, *maps,
            t.free_stack, host_w, dev_w, host_w.stride(0), dev_w.stride(0), ws.taken, ws.ids,
            ws.slots, ws.cas_scratch, R=QUEUE_ROWS, WORDS=host_w.shape[1], ABSENT_ID=ABSENT,
            SPIN_LIMIT=SPIN_LIMIT, num_warps=4,
        )  # fmt: skip

    def settle() -> None:
        _settle_kernel[(1,)](
            t.free_count, t.fetched, ws.request_counts, ws.taken, ws.kept, cap, batch,
            ws.queue, ws.tail, ws.head, ws.done, qcap, ROWS=1024, QUEUE=queue,
        )  # fmt: skip

    if not queue:
        logits()
        settle()
    elif q.device.type != "cuda":  # the interpreter runs launches in order: drain after
        logits()
        _flag_kernel[(1,)](ws.done)
        copy_queue()
        settle()
    else:
        main, side = torch.cuda.current_stream(q.device), ws.side_stream()
        side.wait_stream(main)  # fork: the maps and counters as the stream left them
        with torch.cuda.stream(side):
            copy_queue()  # polls while the logits run
        logits()
        _flag_kernel[(1,)](ws.done)
        with torch.cuda.stream(side):
            settle()
            ws.ready = torch.cuda.Event()
            ws.ready.record(side)
    return out


# ---------------------------------------------------------------------------- reference
def decode_fetch_reference(
    scores: torch.Tensor,
    locs: torch.Tensor,
    seq_lens: torch.Tensor,
    theta: torch.Tensor,
    target: FetchTarget,
    ws: FetchWorkspace,
    cap: int,
) -> None:
    """The fetch from computed scores [B, L] (positions at and past seq_lens[b] ignored),
    serialised in request order, then position order: the semantics the kernel meets up to
    the order in which programs win contended candidates and slots. Fixed shapes, no host
    synchronisation."""
    if scores.dim() != 2:
        raise ValueError(f"scores must be [B, L], got shape {tuple(scores.shape)}")
    batch, length = scores.shape
    _check_fetch(batch, length, locs, seq_lens, theta, target, ws, cap)
    dev = scores.device
    t = target
    ws.ids.fill_(-1)
    ws.kept.zero_()
    ws.lists_shape, ws.ready = (batch, cap), None
    if length == 0 or batch == 0:
        return
    locs = locs[:, :length].to(torch.int64)
    pos = torch.arange(length, device=dev)
    visible = pos[None, :] < seq_lens.to(torch.int64)[:, None]
    key = torch.where(visible, locs, torch.zeros_like(locs))
    h2d = t.host_to_device
    flag = visible & (scores.to(torch.float32) > theta[:, None]) & (h2d[key] == ABSENT)
    rank = torch.cumsum(flag.to(torch.int64), 1) - 1
    take = flag & (rank < cap)
    dest = torch.where(take, rank, torch.full_like(rank, cap))  # column cap: dropped
    listed = torch.full((batch, cap + 1), -1, dtype=torch.int64, device=dev)
    listed.scatter_(1, dest, torch.where(take, locs, torch.full_like(locs, -1)))
    flat = listed[:, :cap].reshape(-1)
    valid = flat >= 0
    # First occurrence in (request, position) order claims an id two requests share.
    sort_key = torch.where(valid, flat, torch.full_like(flat, t.scratch_host))
    sorted_key, order = torch.sort(sort_key, stable=True)
    starts = sorted_key != torch.nn.functional.pad(sorted_key[:-1], (1, 0), value=-1)
    won = valid & torch.zeros_like(valid).scatter_(0, order, starts)
    k = torch.cumsum(won.to(torch.int64), 0) - 1
    free0 = t.free_count.to(torch.int64).reshape(())
    has = won & (k < free0)
    at = (free0 - 1 - k).clamp(min=0, max=t.free_stack.shape[0] - 1)
    slot = torch.where(has, t.free_stack[at].to(torch.int64), 0)
    scratch_slot = t.device_to_host.shape[0] - 1
    fetch_id = torch.where(has, flat, t.scratch_host)
    fetch_slot = torch.where(has, slot, scratch_slot)
    h2d.scatter_(0, fetch_id, fetch_slot.to(torch.int32))
    h2d.narrow(0, t.scratch_host, 1).fill_(ABSENT)
    t.device_to_host.scatter_(0, fetch_slot, fetch_id.to(torch.int32))
    t.device_to_host.narrow(0, scratch_slot, 1).fill_(-1)
    t.priority.scatter_(0, fetch_slot, t.clock.expand_as(fetch_slot))
    t.priority.narrow(0, scratch_slot, 1).fill_(-1)
    rows = t.host_rows.index_select(0, fetch_id.to(t.host_rows.device)).to(t.dev_rows.device)
    t.dev_rows.index_copy_(0, fetch_slot, rows.to(t.dev_rows.dtype))
    took = has.sum()
    t.free_count.copy_((free0 - took).to(torch.int32).reshape(1))
    t.fetched.add_(took)
    lanes = torch.arange(batch * cap, device=dev)
    ws.ids[lanes] = torch.where(has, flat, -1)
    ws.slots[lanes] = slot
    ws.kept[:batch] = flag.sum(1).clamp(max=cap)


# ------------------------------------------------ step epilogue: thresholds, telemetry
# One launch each instead of a dozen tiny torch ops on the main stream: at hit rate 1.0
# these sit on the critical path of every layer's decode step.
@triton.jit
def _threshold_kernel(
    theta_ptr, finite_ptr, kth_ptr, rows_ptr, n, kth_stride, alpha, LANES: tl.constexpr
):  # fmt: skip
    lane = tl.program_id(0) * LANES + tl.arange(0, LANES)
    live = lane < n
    row = tl.load(rows_ptr + lane, mask=live, other=0).to(tl.int64)
    new = tl.load(kth_ptr + lane * kth_stride, mask=live, other=0.0).to(tl.float32)
    old = tl.load(theta_ptr + row, mask=live, other=0.0)
    was_finite = tl.load(finite_ptr + row, mask=live, other=0) != 0
    new_finite = tl.abs(new) < float("inf")
    blend = was_finite & new_finite
    # Zeros where a value is infinite: no inf - inf on lanes that keep ``new`` anyway.
    a = tl.where(blend, new, 0.0)
    b = tl.where(blend, old, 0.0)
    value = tl.where(blend, alpha * a + (1.0 - alpha) * b, new)
    tl.store(theta_ptr + row, value, mask=live)
    tl.store(finite_ptr + row, new_finite, mask=live)


def update_thresholds(
    theta: torch.Tensor, finite: torch.Tensor, kth: torch.Tensor, rows: torch.Tensor, alpha: float
) -> None:
    """DecodeThresholdPredictor.update (its reference) in one launch: for distinct request
    rows, theta[row] = EMA(alpha) of the new k-th score where both are finite, else the
    new score; finite[row] = whether the new score is finite. ``kth`` may be strided (a
    column of the sorted scores: no copy). Floating-point contraction is off, so the
    result matches the torch ops bit for bit."""
    if theta.dtype != torch.float32 or finite.dtype != torch.bool:
        raise ValueError("theta must be float32 and finite bool (DecodeThresholdPredictor)")
    if kth.shape != rows.shape or kth.dim() != 1:
        raise ValueError(
            f"expected kth [B] and rows [B], got {tuple(kth.shape)}, {tuple(rows.shape)}"
        )
    n = kth.numel()
    if n == 0:
        return
    lanes = min(1024, triton.next_power_of_2(n))
    _threshold_kernel[(triton.cdiv(n, lanes),)](
        theta, finite, kth, rows.contiguous(), n, kth.stride(0), float(alpha), LANES=lanes,
        enable_fp_fusion=False,
    )  # fmt: skip


@triton.jit
def _hits_kernel(
    ids_ptr, slots_ptr, kept_ptr, d2h_ptr, prio_ptr, clock_ptr, hits_ptr, lanes, cap,
    LANES: tl.constexpr,
):  # fmt: skip
    """Lists of ``cap`` lanes per request, the first kept[r] of request r live."""
    lane = tl.program_id(0) * LANES + tl.arange(0, LANES)
    row = lane // cap
    live = (lane < lanes) & (lane - row * cap < tl.load(kept_ptr + row, mask=lane < lanes))
    ids = tl.load(ids_ptr + lane, mask=live, other=-1)
    slots = tl.load(slots_ptr + lane, mask=live, other=0)
    owner = tl.load(d2h_ptr + slots, mask=live, other=-1).to(tl.int64)
    stamp = tl.load(prio_ptr + slots, mask=live, other=-1)
    hit = live & (ids >= 0) & (owner == ids) & (stamp == tl.load(clock_ptr))
    tl.atomic_add(hits_ptr, tl.sum(hit.to(tl.int64), 0))


def _count_hits(ids, slots, kept, lanes, cap, d2h, prio, clock, hits) -> None:
    if lanes == 0:
        return
    block = 1024  # fixed: list sizes vary (prefill), one compiled variant
    _hits_kernel[(triton.cdiv(lanes, block),)](
        ids, slots, kept, d2h, prio, clock, hits, lanes, cap, LANES=block
    )


def _count_hits_reference(ids, slots, kept, lanes, cap, d2h, prio, clock, hits) -> None:
    lane = torch.arange(lanes, device=ids.device)
    live = (lane % cap) < kept[lane // cap] if lanes else lane.bool()
    slots = torch.where(live, slots[:lanes], 0)
    owner = d2h[slots].to(torch.int64)
    selected = prio[slots] == clock.reshape(())
    hits += (live & (ids[:lanes] >= 0) & (owner == ids[:lanes]) & selected).sum()


def count_fetch_hits(
    ws: FetchWorkspace,
    batch: int,
    cap: int,
    device_to_host: torch.Tensor,
    priority: torch.Tensor,
    clock: torch.Tensor,
    hits: torch.Tensor,
    use_kernel: bool = True,
) -> None:
    """hits[0] += fetched rows (the lists of the last fetch into ``ws``: ``batch`` requests
    of ``cap`` lanes) that the resolve then selected: still owned by their token and
    stamped with the layer's clock. One launch (``use_kernel``), else plain torch."""
    count = _count_hits if use_kernel else _count_hits_reference
    count(ws.ids, ws.slots, ws.kept, batch * cap, cap, device_to_host, priority, clock, hits)


def count_prefetch_hits(
    miss_ids: torch.Tensor,
    miss_slots: torch.Tensor,
    miss_count: torch.Tensor,
    lanes: int,
    device_to_host: torch.Tensor,
    priority: torch.Tensor,
    clock: torch.Tensor,
    hits: torch.Tensor,
    use_kernel: bool = True,
) -> None:
    """The same for one flat miss list (a prefill prefetch's allocation): its first
    ``miss_count`` lanes, at most ``lanes``."""
    count = _count_hits if use_kernel else _count_hits_reference
    count(miss_ids, miss_slots, miss_count, lanes, max(1, lanes), device_to_host, priority,
          clock, hits)  # fmt: skip
