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


# --------------------------------------------------------------------------- reference
def store_bytes_reference(src: torch.Tensor, dst: torch.Tensor) -> None:
    """The kernel's semantics: ``dst[:] = src`` (both flat uint8 of one length)."""
    dst.copy_(src)


# ------------------------------------------------------------------------------ kernel
# Sizes and offsets change with the batch: one compiled variant for all of them.
@triton.jit(do_not_specialize=("n",), do_not_specialize_on_alignment=("src_ptr", "dst_ptr"))
def _store_bytes_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


# ---------------------------------------------------------------------------- launcher
def store_bytes(src: torch.Tensor, dst: torch.Tensor) -> None:
    """``dst[:] = src`` by one launch on the current stream (flat uint8 tensors of one
    length; ``dst`` may be a pinned buffer's UVA alias)."""
    if src.dtype != torch.uint8 or dst.dtype != torch.uint8 or src.dim() != 1:
        raise ValueError("store_bytes takes flat uint8 tensors")
    if src.numel() != dst.numel():
        raise ValueError(f"store_bytes: {src.numel()} bytes into {dst.numel()}")
    n = src.numel()
    if n:
        _store_bytes_kernel[(triton.cdiv(n, STORE_BLOCK),)](src, dst, n, BLOCK=STORE_BLOCK)


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
    """A ring of pinned slots that device tensors are stored into by ``store_bytes``.

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
        out = []
        for t, off, size in zip(tensors, offsets, sizes, strict=True):
            if size:
                store_bytes(as_bytes(t.contiguous()), alias_slot[off : off + size])
            out.append(host_slot[off : off + size].view(t.dtype).view(t.shape))
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
