"""Programmatic dependent launch (PDL) for the short kernels a decode step chains.

Why: a layer's cache management is up to five launches per allocation (kernels/alloc.py,
kernels/alloc_lookback.py) and a recall, each moving a few KB. On an H200 such a launch
costs a few microseconds, mostly spent waiting for the previous kernel to drain and the
next to be scheduled (the study's batch-1 profile, when a decode step still allocated for
its new tokens too: eleven launches per layer; the evidence row "cache-management kernels"
gives the launches' floor, and benchmark/results/cache_ops.json's launch_chaining times
chained against plain). With PDL a
kernel asks for its successor to be scheduled as soon as all of its own programs have
started; the successor's programs then wait in ``griddepcontrol.wait`` until this kernel has
finished and its writes are visible. Every kernel here waits before its first memory access,
so the order of reads and writes is exactly the unchained one: only the scheduling overlaps.
The attribute is captured into CUDA graphs as programmatic edges.

Off under the Triton interpreter (no such instruction) and below sm_90; ``SGLANG_ECHO_PDL=0``
turns it off everywhere. That variable is parsed once, by ``sglang_echo.config`` (kernels
import nothing above themselves): the offload layer passes its value in as ``asked``.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


def pdl_supported(device: torch.device) -> bool:
    """CUDA at sm_90 or newer, compiled (not the interpreter)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _capability(device.index)[0] >= 9


def use_pdl(device: torch.device, asked: bool = True) -> bool:
    """Whether launches on ``device`` chain: ``asked`` where the device supports it, never
    where it does not. ``asked`` is SGLANG_ECHO_PDL handed down (on by default, as that
    variable is): the entry point reads it from ``settings()`` and passes it as the cache's
    ``pdl=`` (``EchoManager``, ``HiSparseKVCache``), which passes it here."""
    return pdl_supported(device) and asked


@functools.cache
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index or 0)


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    """First statement of a chained kernel: wait for the previous kernel's writes, then let
    the next kernel be scheduled. Nothing is read before the wait."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


# The atomics of the cache kernels need atomicity, not ordering: what one program writes is
# read only by later launches (kernel boundaries order memory), so "relaxed" suffices.
# Triton's default "acq_rel" orders each atomic against every other access of its thread
# (timed beside it: cache_ops.json's launch_chaining).
ATOMIC_SEM = "relaxed"
