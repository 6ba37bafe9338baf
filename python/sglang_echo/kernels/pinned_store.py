"""Small device results to pinned host memory by the GPU's own stores: the Triton kernel,
its launcher, the torch reference, and the ring of pinned slots the engine reads from.

Why not ``host.copy_(device, non_blocking=True)``: that copy runs on a copy engine, and a
copy engine takes the copies of every stream in turn. A decode node's arrivals stream
hundreds of MB of KV rows to the host pool through the same device-to-host engine, so a
step's few-byte readbacks (its sampled tokens, the prefetch rule's counters) waited behind
the arrival's chunks, and the next step's launch waited behind them: the GPU idled for
milliseconds between steps (``benchmark/decode_node_probe.py --trace``; the record names
the gaps). Written by a kernel through the slot's UVA alias, a readback takes a few SM
cycles and a PCIe write, and never queues behind bulk copies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sglang_echo.kernels.host_copy import cuda_alias_of_pinned

STORE_BLOCK = 1024  # bytes per program
SLOT_ALIGN = 16  # each tensor's offset in a slot: any dtype's view stays aligned
MAX_SEGMENTS = 6  # sources one launch stores: a step's results (tokens, flags, log-probs)


# --------------------------------------------------------------------------- reference
def store_segments_reference(
    sources: Sequence[torch.Tensor], dst: torch.Tensor, offsets: Sequence[int]
) -> None:
    """The kernel's semantics: ``dst[off : off + len(src)] = src`` for each source (flat
    uint8); bytes of ``dst`` outside every segment are left as they are."""
    for src, off in zip(sources, offsets, strict=True):
        dst[off : off + src.numel()].copy_(src)


# ------------------------------------------------------------------------------ kernel
@triton.jit
def _store_segment(dst_ptr, src_ptr, n, off, offs):
    mask = (offs >= off) & (offs < off + n)
    tl.store(dst_ptr + offs, tl.load(src_ptr + (offs - off), mask=mask), mask=mask)


_SIZES = (*(f"n{i}" for i in range(MAX_SEGMENTS)), *(f"o{i}" for i in range(MAX_SEGMENTS)))
_POINTERS = ("dst_ptr", *(f"s{i}" for i in range(MAX_SEGMENTS)))


# Every segment is a fixed argument (an unused one has no bytes) and sizes and offsets
# change with the batch: one compiled variant serves every step, so none compiles mid-run.
@triton.jit(do_not_specialize=_SIZES, do_not_specialize_on_alignment=_POINTERS)
def _store_segments_kernel(
    dst_ptr, s0, n0, o0, s1, n1, o1, s2, n2, o2, s3, n3, o3, s4, n4, o4, s5, n5, o5,
    BLOCK: tl.constexpr,
):  # fmt: skip
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    _store_segment(dst_ptr, s0, n0, o0, offs)
    _store_segment(dst_ptr, s1, n1, o1, offs)
    _store_segment(dst_ptr, s2, n2, o2, offs)
    _store_segment(dst_ptr, s3, n3, o3, offs)
    _store_segment(dst_ptr, s4, n4, o4, offs)
    _store_segment(dst_ptr, s5, n5, o5, offs)


# ---------------------------------------------------------------------------- launcher
def store_segments(
    sources: Sequence[torch.Tensor], dst: torch.Tensor, offsets: Sequence[int]
) -> None:
    """``dst[off : off + len(src)] = src`` for up to ``MAX_SEGMENTS`` flat uint8 sources by
    one launch on the current stream (``dst`` may be a pinned buffer's UVA alias): one
    launch, not one per tensor, because each launch costs the engine thread host time
    every decode step."""
    if not 0 < len(sources) <= MAX_SEGMENTS or len(offsets) != len(sources):
        raise ValueError(
            f"store_segments takes 1 to {MAX_SEGMENTS} sources with one offset each, "
            f"got {len(sources)} sources and {len(offsets)} offsets"
        )
    if dst.dtype != torch.uint8 or dst.dim() != 1:
        raise ValueError("store_segments stores into a flat uint8 tensor")
    args: list = [dst]
    end = 0
    for src, off in zip(sources, offsets, strict=True):
        if src.dtype != torch.uint8 or src.dim() != 1:
            raise ValueError("store_segments takes flat uint8 sources (see as_bytes)")
        if off < end or off + src.numel() > dst.numel():
            raise ValueError(
                f"store_segments: a segment of {src.numel()} bytes at {off} overlaps the "
                f"one before it (which ends at {end}) or passes the end ({dst.numel()})"
            )
        end = off + src.numel()
        args += [src, src.numel(), off]
    args += [dst, 0, 0] * (MAX_SEGMENTS - len(sources))  # unused: no bytes
    if end:
        _store_segments_kernel[(triton.cdiv(end, STORE_BLOCK),)](*args, BLOCK=STORE_BLOCK)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes, flat: a view, so a store into it lands in ``t``."""
    if not t.is_contiguous():
        raise ValueError("as_bytes takes a contiguous tensor (a copy would take the bytes)")
    return t.reshape(-1).view(torch.uint8)


# --------------------------------------------------------------------------------- ring
@dataclass(eq=False)
class Readback:
    """Host copies of some device tensors, landing when ``done`` fires."""

    host: list[torch.Tensor]
    done: torch.cuda.Event | None
    ring: PinnedReadback | None = None
    slot: int = -1
    generation: int = -1

    def wait(self) -> list[torch.Tensor]:
        """The host tensors, once their copies have landed."""
        if self.done is not None:
            self.done.synchronize()
        if self.ring is not None and self.ring.generations[self.slot] != self.generation:
            raise RuntimeError(
                f"a readback's pinned slot was reused before it was read (the ring has "
                f"{len(self.ring.generations)} slots): read each readback before that many "
                "more are queued"
            )
        return self.host


class PinnedReadback:
    """A ring of pinned slots that device tensors are stored into by ``store_segments``.

    A slot is reused ``slots`` readbacks later: the engine reads each step's results one
    step after it is launched, far inside that. A readback read after its slot was reused
    raises instead of returning another step's bytes. Off CUDA, or where pinned memory has
    no UVA alias, or for more bytes than a slot holds, it copies as torch does."""

    def __init__(self, device: torch.device, slot_bytes: int = 1 << 16, slots: int = 8) -> None:
        self.device = device
        self.slot_bytes = slot_bytes
        self.generations = [0] * slots
        self._next = 0
        self.host: torch.Tensor | None = None
        self.alias: torch.Tensor | None = None
        if device.type == "cuda":
            self.host = torch.zeros(slots, slot_bytes, dtype=torch.uint8, pin_memory=True)
            self.alias = cuda_alias_of_pinned(self.host)

    def copy(self, tensors: Sequence[torch.Tensor]) -> Readback:
        """Queue host copies of ``tensors`` (on ``device``) on the current stream."""
        sizes = [t.numel() * t.element_size() for t in tensors]
        offsets, end = [], 0
        for size in sizes:
            offsets.append(end)
            end += -(-size // SLOT_ALIGN) * SLOT_ALIGN
        if self.alias is None or end > self.slot_bytes:
            return copy_by_torch(tensors)
        slot = self._next
        self._next = (slot + 1) % len(self.generations)
        self.generations[slot] += 1
        host_slot, alias_slot = self.host[slot], self.alias[slot]
        stored = [
            (as_bytes(t.contiguous()), off)
            for t, off in zip(tensors, offsets, strict=True)
            if t.numel()
        ]
        for first in range(0, len(stored), MAX_SEGMENTS):  # one launch for a step's results
            chunk = stored[first : first + MAX_SEGMENTS]
            store_segments([b for b, _ in chunk], alias_slot, [off for _, off in chunk])
        out = [
            host_slot[off : off + size].view(t.dtype).view(t.shape)
            for t, off, size in zip(tensors, offsets, sizes, strict=True)
        ]
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        return Readback(out, done, self, slot, self.generations[slot])


def copy_by_torch(tensors: Sequence[torch.Tensor]) -> Readback:
    """Host copies by torch's own copies (a copy engine on CUDA, queued without waiting):
    the fallback, and what a caller without a ring gets."""
    out, done = [], None
    for t in tensors:
        pinned = t.device.type == "cuda"
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned)
        host.copy_(t, non_blocking=pinned)
        out.append(host)
    if any(t.device.type == "cuda" for t in tensors):
        done = torch.cuda.Event()
        done.record()
    return Readback(out, done)
