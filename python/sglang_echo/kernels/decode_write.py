"""A decode step's new KV rows: written to the host pool and, while the layer's free stack
has room, placed in device slots too, in one launch; the Triton kernel, its launcher and
the torch reference.

Why: the exact top-k of a decode step nearly always selects the token the step just
wrote. Written to the host only, that token is a miss in every layer of every step, and
its recall is one latency-bound read over PCIe per request and layer, plus an allocation
that serves a miss, where every other selection hits (an H200's batch-1 profile: most of
ECHO's cost when nothing needs offloading). Here the kernel that writes the host row also
takes a slot from the top of the free stack, maps it and writes the row there: the step's
resolve then finds the token resident, its allocation ends after the look-up and its
recall copies nothing. One launch replaces the host write's one, so a step launches no
more kernels than before, and nothing here evicts: the resolve's eviction reserve refills
the free stack. When the stack is empty the token stays host-only and the resolve
recalls it, as any miss.

Semantics per lane, in lane order: the host row is written (host id 0, the padding sink's
row, too, as a plain write would); an id that is not resident (``host_to_device`` ABSENT)
is placed while free slots last, popped from the top of the stack and stamped with the
layer's clock (like an append: it looks last used in the previous step, so it is evictable
unless this step selects it); an id that is already resident gets its device row rewritten
too, so the device row always equals the host row. Ids must be distinct (one new token
per request).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_echo.kernels.cache_layout import ABSENT, FREE, CacheState

# Priority of a transferred prompt's placed rows (decode_write_reference): older than any
# stamp a resolve or an append gives (clocks start at 0 and a resolve stamps clock + 1).
PROMPT_PRIORITY = 0
# Priority of a prompt's slots while its rows are still being written (a decode node's
# transfer): above any stamp a step can give, so no resolve evicts them before they arrive.
PINNED_PRIORITY = 1 << 62
WRITE_LANES = 16  # rows per step of the one program's loop
WRITE_WARPS = 4
_ABSENT = tl.constexpr(ABSENT)


@triton.jit
def _take_slots(loc, live, h2d_ptr, stack_ptr, free0, taken):
    """The placement rule for one step of lanes, in lane order: an id (> 0) not resident
    takes the next slot popped from the top of the stack (``taken`` popped before) while
    ``free0`` last. Returns (new, placed, slot, resident, old slot as int64)."""
    token = live & (loc > 0)
    old = tl.load(h2d_ptr + loc, mask=token, other=_ABSENT)
    new = token & (old == _ABSENT)
    rank = taken + tl.cumsum(new.to(tl.int32), 0) - 1
    placed = new & (rank < free0)
    slot = tl.load(stack_ptr + (free0 - 1 - rank), mask=placed, other=0).to(tl.int64)
    resident = token & (old != _ABSENT)
    return new, placed, slot, resident, old.to(tl.int64)


@triton.jit(do_not_specialize=("lanes",))
def _decode_write_kernel(
    rows_ptr, locs_ptr, lanes, host_ptr, dev_ptr, h2d_ptr, d2h_ptr, prio_ptr, clock_ptr,
    free_stack_ptr, free_count_ptr, row_stride, host_stride, dev_stride,
    WORDS: tl.constexpr, WORD_BLOCK: tl.constexpr, LANES: tl.constexpr,
):  # fmt: skip
    """One program: the free count is read once and written once, so the stack's pops
    need no atomics and their order is the lanes' (the reference's)."""
    free0 = tl.load(free_count_ptr)
    clock = tl.load(clock_ptr)
    taken = free0 * 0
    start = 0
    while start < lanes:  # a while, not a range: the trip count is a runtime value
        lane = start + tl.arange(0, LANES)
        live = lane < lanes
        loc = tl.load(locs_ptr + lane, mask=live, other=0).to(tl.int64)
        new, placed, slot, resident, old = _take_slots(
            loc, live, h2d_ptr, free_stack_ptr, free0, taken
        )
        dest = tl.where(placed, slot, tl.where(resident, old, 0))
        to_dev = placed | resident
        for w0 in tl.static_range(0, WORDS, WORD_BLOCK):
            col = w0 + tl.arange(0, WORD_BLOCK)
            in_row = col[None, :] < WORDS
            v = tl.load(rows_ptr + lane[:, None] * row_stride + col[None, :],
                        mask=live[:, None] & in_row)  # fmt: skip
            tl.store(host_ptr + loc[:, None] * host_stride + col[None, :], v,
                     mask=live[:, None] & in_row)  # fmt: skip
            tl.store(dev_ptr + dest[:, None] * dev_stride + col[None, :], v,
                     mask=to_dev[:, None] & in_row)  # fmt: skip
        tl.store(h2d_ptr + loc, slot.to(tl.int32), mask=placed)
        tl.store(d2h_ptr + slot, loc.to(tl.int32), mask=placed)
        tl.store(prio_ptr + slot, tl.zeros_like(slot) + clock, mask=placed)
        taken += tl.sum(new.to(tl.int32), 0)
        start += LANES
    tl.store(free_count_ptr, free0 - tl.minimum(taken, free0))


def as_words(rows: torch.Tensor) -> torch.Tensor:
    """The widest of 4-, 2- and 1-byte words that tiles a row and its stride."""
    b = rows.view(torch.uint8)
    for dtype, size in ((torch.int32, 4), (torch.int16, 2)):
        if b.shape[1] % size == 0 and b.stride(0) % size == 0:
            return b.view(dtype)
    return b


def _check(rows, locs, host_rows, dev_rows) -> None:
    if rows.dim() != 2 or locs.dim() != 1 or rows.shape[0] != locs.shape[0]:
        raise ValueError(
            f"expected rows [n, W] and locs [n], got {tuple(rows.shape)} and {tuple(locs.shape)}"
        )
    for name, t in (("rows", rows), ("host_rows", host_rows), ("dev_rows", dev_rows)):
        if t.dim() != 2 or t.stride(1) != 1 or t.dtype != dev_rows.dtype:
            raise ValueError(f"{name} must be [*, W] {dev_rows.dtype} with contiguous rows")
        if t.shape[1] != dev_rows.shape[1]:
            raise ValueError(f"{name} rows are {t.shape[1]} wide, device rows {dev_rows.shape[1]}")


def decode_write_kernel(
    cache: CacheState,
    layer: int,
    locs: torch.Tensor,
    rows: torch.Tensor,
    host_rows: torch.Tensor,
    dev_rows: torch.Tensor,
) -> None:
    """The module's write for one layer of ``cache``: ``rows`` [n, W] (the pools' dtype)
    of host ids ``locs`` [n] into ``host_rows`` (on CUDA the pinned pool's device alias)
    and, where placed, ``dev_rows`` (the layer's device rows); the layer's maps, clock and
    free stack. One program; fixed shapes, no host synchronisation (CUDA-graph safe)."""
    _check(rows, locs, host_rows, dev_rows)
    n = locs.numel()
    if n == 0:
        return
    c = cache
    src, host, dev = as_words(rows.contiguous()), as_words(host_rows), as_words(dev_rows)
    words = src.shape[1]
    _decode_write_kernel[(1,)](
        src, locs.contiguous(), n, host, dev, c.host_to_device[layer], c.device_to_host[layer],
        c.priority[layer], c.clock[layer : layer + 1], c.free_stack[layer],
        c.free_count[layer : layer + 1], src.stride(0), host.stride(0), dev.stride(0),
        WORDS=words, WORD_BLOCK=min(128, triton.next_power_of_2(words)), LANES=WRITE_LANES,
        num_warps=WRITE_WARPS,
    )  # fmt: skip


def decode_write_reference(
    cache: CacheState,
    layer: int,
    locs: torch.Tensor,
    rows: torch.Tensor,
    host_rows: torch.Tensor,
    dev_rows: torch.Tensor,
    priority_of_placed: int | None = None,
) -> None:
    """Plain torch (fixed shapes, no host synchronisation) of :func:`decode_write_kernel`.
    ``host_rows`` may live on the CPU while the rest is on a device (the CPU path's pool);
    the cache's scratch entries are left at their resting values.

    ``priority_of_placed``: the priority placed rows get instead of the layer's clock. A
    decode node's transferred prompt is placed with 0 (``PROMPT_PRIORITY``), the oldest a
    slot can be, so under pressure its never-selected rows are the first victims; torch
    is this path's implementation too (a prompt is written once, eagerly, at any length,
    where the kernel's single program would loop over every row)."""
    _check(rows, locs, host_rows, dev_rows)
    if locs.numel() == 0:
        return
    host_rows.index_copy_(0, locs.to(host_rows.device), rows.to(host_rows.device))
    dest = place_slots(cache, layer, locs, priority_of_placed)
    dev_rows.index_copy_(0, dest, rows)


def place_slots(
    cache: CacheState, layer: int, locs: torch.Tensor, priority_of_placed: int | None = None
) -> torch.Tensor:
    """The maps' part of :func:`decode_write_reference` (no row is written): ids not yet
    resident take free slots while they last, in lane order, mapped both ways with the
    layer's clock (or ``priority_of_placed``) as their priority. Returns each lane's
    device slot [n] int64: its new slot, its slot if it was resident, else the scratch slot.
    Why apart: a decode node reserves a transferring prompt's slots on the decode stream
    (ordered with the steps that share the free stack) while the rows are written beside
    it on the transfer's stream (``PINNED_PRIORITY`` until they arrive)."""
    stamp = (
        cache.clock[layer : layer + 1].reshape(1, 1)
        if priority_of_placed is None
        else priority_of_placed
    )
    return _place(cache, slice(layer, layer + 1), locs, stamp)[0]


def place_slots_all_layers(cache: CacheState, locs: torch.Tensor, priority: int) -> torch.Tensor:
    """:func:`place_slots` for every layer at once (each layer's own maps and free stack,
    ``priority`` for every placed slot): one launch per op instead of one per op and
    layer. Returns the slots [layers, n] int64. Why: a decode node reserves a long
    prompt's slots in every layer on the engine thread; one pass per layer multiplied
    its launches by the layer count. The reference of :func:`place_slots_all_layers_kernel`."""
    return _place(cache, slice(None), locs, priority)


PLACE_LANES = 1024  # ids per step of each layer's loop


# The prompt's locations are a view into its table row, so their alignment changes per
# prompt: one compiled variant for every arrival (their loads are gathers anyway).
@triton.jit(do_not_specialize=("lanes", "priority"), do_not_specialize_on_alignment=("locs_ptr",))
def _place_all_layers_kernel(
    locs_ptr, lanes, dest_ptr, h2d_ptr, d2h_ptr, prio_ptr, stack_ptr, free_count_ptr,
    h2d_stride, d2h_stride, prio_stride, stack_stride, priority, scratch_slot,
    LANES: tl.constexpr,
):  # fmt: skip
    """One program per layer: its free count is read once and written once, so its
    stack's pops need no atomics and their order is the lanes' (the reference's)."""
    layer = tl.program_id(0).to(tl.int64)
    h2d = h2d_ptr + layer * h2d_stride
    d2h = d2h_ptr + layer * d2h_stride
    prio = prio_ptr + layer * prio_stride
    stack = stack_ptr + layer * stack_stride
    free0 = tl.load(free_count_ptr + layer)
    taken = free0 * 0
    start = 0
    while start < lanes:  # a while, not a range: the trip count is a runtime value
        lane = start + tl.arange(0, LANES)
        live = lane < lanes
        loc = tl.load(locs_ptr + lane, mask=live, other=0).to(tl.int64)
        new, placed, slot, resident, old = _take_slots(loc, live, h2d, stack, free0, taken)
        dest = tl.where(placed, slot, tl.where(resident, old, scratch_slot))
        tl.store(h2d + loc, slot.to(tl.int32), mask=placed)
        tl.store(d2h + slot, loc.to(tl.int32), mask=placed)
        tl.store(prio + slot, tl.zeros_like(slot) + priority, mask=placed)
        tl.store(dest_ptr + layer * lanes + lane, dest, mask=live)
        taken += tl.sum(new.to(tl.int32), 0)
        start += LANES
    tl.store(free_count_ptr + layer, free0 - tl.minimum(taken, free0))


def place_slots_all_layers_kernel(
    cache: CacheState, locs: torch.Tensor, priority: int
) -> torch.Tensor:
    """:func:`place_slots_all_layers` in one launch (a program per layer), the same slots
    and the same state. Why: the torch form is dozens of launches over [layers, n], each a
    few microseconds of the engine thread's CPU, per admitted prompt, while the running
    requests wait for the next step; this is one. Ids must be distinct (a prompt's
    locations are). Fixed shapes, no host synchronisation."""
    c = cache
    loc = locs.reshape(-1).contiguous()
    n, layers = loc.numel(), c.host_to_device.shape[0]
    dest = torch.empty(layers, n, dtype=torch.int64, device=loc.device)
    if n == 0:
        return dest
    for t in (c.host_to_device, c.device_to_host, c.priority, c.free_stack):
        if t.stride(1) != 1:
            raise ValueError("the cache's per-layer maps must have contiguous rows")
    _place_all_layers_kernel[(layers,)](
        loc, n, dest, c.host_to_device, c.device_to_host, c.priority, c.free_stack,
        c.free_count, c.host_to_device.stride(0), c.device_to_host.stride(0),
        c.priority.stride(0), c.free_stack.stride(0), priority, c.scratch_slot,
        LANES=PLACE_LANES, num_warps=WRITE_WARPS,
    )  # fmt: skip
    return dest


def _place(
    cache: CacheState, layers: slice, locs: torch.Tensor, stamp: int | torch.Tensor
) -> torch.Tensor:
    """The placement rule, once, over the layers ``layers`` (views of the cache's [L, ...]
    tensors, changed in place); ``stamp``: the placed slots' priority, an int or [L, 1]."""
    c = cache
    h2d, d2h = c.host_to_device[layers], c.device_to_host[layers]
    prio, stack, free_count = c.priority[layers], c.free_stack[layers], c.free_count[layers]
    n_layers = h2d.shape[0]
    loc = locs.reshape(1, -1).to(torch.int64)
    token = loc > 0
    key = torch.where(token, loc, torch.full_like(loc, c.scratch_host)).expand(n_layers, -1)
    old = h2d.gather(1, key).to(torch.int64)
    new = token & (old == ABSENT)
    rank = torch.cumsum(new.to(torch.int64), 1) - 1
    free0 = free_count.to(torch.int64).reshape(n_layers, 1)
    placed = new & (rank < free0)
    top = stack.shape[1] - 1
    popped = stack.gather(1, (free0 - 1 - rank).clamp(min=0, max=top)).to(torch.int64)
    slot = torch.where(placed, popped, c.scratch_slot)
    resident = token & (old != ABSENT)
    dest = torch.where(placed, slot, torch.where(resident, old, c.scratch_slot))
    ids = loc.expand(n_layers, -1)
    h2d.scatter_(1, torch.where(placed, ids, c.scratch_host), slot.to(torch.int32))
    d2h.scatter_(1, slot, torch.where(placed, ids, FREE).to(torch.int32))
    prio.scatter_(1, slot, torch.where(placed, stamp, FREE))
    h2d.narrow(1, c.scratch_host, 1).fill_(ABSENT)
    d2h.narrow(1, c.scratch_slot, 1).fill_(FREE)
    prio.narrow(1, c.scratch_slot, 1).fill_(FREE)
    free_count.sub_(torch.minimum(new.sum(1), free0.reshape(-1)).to(free_count.dtype))
    return dest
