"""Release of finished requests' tokens from every layer's device cache in one launch:
the Triton kernel, its launcher and the torch reference.

Why one launch: a release used to be a dozen torch ops per layer, so under SGLang's 61
layers a finished request cost hundreds of launches. Here one program per layer walks the released host
ids in lane order (so the free stack gets exactly the order the per-layer torch version
gave), unmaps each resident token (``host_to_device`` -> ABSENT, ``device_to_host`` and
``priority`` -> FREE) and pushes its slot onto the layer's free stack.

Bad ids never corrupt the cache: the sink (host id 0) is never unmapped, and a slot is
pushed only by the lane that owns it (the kernel exchanges ``device_to_host[slot]`` with
FREE and pushes only when it got its own id back), so a duplicated id cannot push one
slot twice. Each refused lane adds one to ``errors`` (per layer), which callers read at
their next host synchronisation; callers that know the ids on the host refuse them before
launching (offload/manager.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_echo.kernels.cache_layout import ABSENT, FREE, CacheState

RELEASE_BLOCK = 1024
RELEASE_WARPS = 8
_ABSENT = tl.constexpr(ABSENT)
_FREE = tl.constexpr(FREE)


# --------------------------------------------------------------------------- reference
def release_reference(cache: CacheState, ids: torch.Tensor, errors: torch.Tensor) -> None:
    """Plain-torch semantics of the kernel, all layers at once (a fixed number of ops
    whatever the layer count). ``ids`` [n] int64 host ids; ``errors`` [1] int64 counter.
    Among duplicated ids the first lane owns the slot (the kernel may pick another lane of
    the same block: with duplicates both leave a consistent cache, not always the same
    stack order)."""
    c = cache
    layers = c.host_to_device.shape[0]
    n = ids.numel()
    if n == 0:
        return
    dev = ids.device
    ok = ids > 0
    key = torch.where(ok, ids, torch.full_like(ids, c.scratch_host))
    slot = c.host_to_device[:, key].to(torch.int64)  # [L, n]
    resident = ok & (slot != ABSENT)
    target = torch.where(resident, slot, torch.full_like(slot, c.scratch_slot))
    lane = torch.arange(n, device=dev).expand(layers, n)
    owner = torch.full((layers, c.num_slots + 2), n, dtype=torch.int64, device=dev)
    owner.scatter_reduce_(1, target, lane, reduce="amin")
    holder = c.device_to_host.gather(1, target).to(torch.int64)
    mine = resident & (owner.gather(1, target) == lane) & (holder == ids)
    errors += (~ok).sum() * layers + (resident & ~mine).sum()
    rank = torch.cumsum(mine.to(torch.int64), 1) - 1
    free = c.free_count.to(torch.int64).unsqueeze(1)
    push_at = torch.where(mine, free + rank, torch.full_like(rank, c.num_slots))
    c.free_stack.scatter_(1, push_at, torch.where(mine, slot, 0).to(c.free_stack.dtype))
    c.free_stack[:, c.num_slots] = 0  # the stack's scratch entry
    freed = torch.where(mine, slot, torch.full_like(slot, c.scratch_slot))
    c.device_to_host.scatter_(1, freed, FREE)
    c.priority.scatter_(1, freed, FREE)
    c.device_to_host[:, c.scratch_slot] = FREE
    c.priority[:, c.scratch_slot] = FREE
    c.host_to_device.scatter_(1, key.expand(layers, n), ABSENT)
    c.host_to_device[:, c.scratch_host] = ABSENT
    c.free_count += mine.sum(1).to(c.free_count.dtype)


# ------------------------------------------------------------------------------ kernel
# The count and the ids' alignment change with every release (a slice of a finished
# request's locations): one compiled variant serves them all.
@triton.jit(do_not_specialize=("n",), do_not_specialize_on_alignment=("ids_ptr",))
def _release_kernel(
    ids_ptr,
    n,
    h2d_ptr,
    d2h_ptr,
    prio_ptr,
    stack_ptr,
    free_count_ptr,
    errors_ptr,
    h2d_stride,
    slot_stride,
    stack_stride,
    BLOCK: tl.constexpr,
):
    layer = tl.program_id(0).to(tl.int64)
    h2d = h2d_ptr + layer * h2d_stride
    d2h = d2h_ptr + layer * slot_stride
    prio = prio_ptr + layer * slot_stride
    stack = stack_ptr + layer * stack_stride
    top = tl.load(free_count_ptr + layer).to(tl.int64)
    refused = top * 0
    start = n * 0
    while start < n:  # a while loop: the interpreter cannot range() over a runtime bound
        lane = start + tl.arange(0, BLOCK)
        live = lane < n
        host = tl.load(ids_ptr + lane, mask=live, other=0)
        ok = live & (host > 0)
        slot = tl.load(h2d + host, mask=ok, other=_ABSENT).to(tl.int64)
        resident = ok & (slot != _ABSENT)
        # The owner of a slot gets its own id back; a duplicate lane gets FREE.
        held = tl.atomic_xchg(d2h + slot, _FREE, mask=resident, sem="relaxed")
        mine = resident & (held == host)
        rank = tl.cumsum(mine.to(tl.int64), 0) - 1
        tl.store(stack + top + rank, slot.to(tl.int32), mask=mine)
        tl.store(prio + slot, _FREE, mask=mine)
        tl.store(h2d + host, _ABSENT, mask=ok)
        top += tl.sum(mine.to(tl.int64), 0)
        refused += tl.sum((live & ~ok).to(tl.int64), 0)
        refused += tl.sum((resident & ~mine).to(tl.int64), 0)
        start += BLOCK
    tl.store(free_count_ptr + layer, top.to(tl.int32))
    tl.atomic_add(errors_ptr, refused, sem="relaxed")


# ---------------------------------------------------------------------------- launcher
def release_kernel(cache: CacheState, ids: torch.Tensor, errors: torch.Tensor) -> None:
    """The kernel's version of :func:`release_reference`: one launch for every layer."""
    n = ids.numel()
    if n == 0:
        return
    c = cache
    for name, t in (("host_to_device", c.host_to_device), ("device_to_host", c.device_to_host)):
        if t.stride(1) != 1:
            raise ValueError(f"the cache's {name} must be row-major")
    _release_kernel[(c.host_to_device.shape[0],)](
        ids.contiguous(), n, c.host_to_device, c.device_to_host, c.priority, c.free_stack,
        c.free_count, errors, c.host_to_device.stride(0), c.device_to_host.stride(0),
        c.free_stack.stride(0), BLOCK=RELEASE_BLOCK, num_warps=RELEASE_WARPS,
    )  # fmt: skip
