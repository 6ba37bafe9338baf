"""Programmatic dependent launch (PDL) for the short kernels a decode step chains.

Why: a layer's cache management is five launches per allocation and a recall, each moving a
few KB. On an H200 such a launch costs a few microseconds, mostly spent waiting for the
previous kernel to drain and the next to be scheduled (the study's batch-1 profile, when a
decode step still allocated for its new tokens too: ~38 us per layer over eleven launches;
benchmark/results/cache_ops.json's launch_chaining times chained against plain). With PDL a
kernel asks for its successor to be scheduled as soon as all of its own programs have
started; the successor's programs then wait in ``griddepcontrol.wait`` until this kernel has
finished and its writes are visible. Every kernel here waits before its first memory access,
so the order of reads and writes is exactly the unchained one: only the scheduling overlaps.
The attribute is captured into CUDA graphs as programmatic edges.

Off under the Triton interpreter (no such instruction) and below sm_90; ``SGLANG_ECHO_PDL=0``
turns it off everywhere.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

ENV_PDL = "SGLANG_ECHO_PDL"


def env_switch(name: str, environ: dict | None = None, default: bool = True) -> bool:
    """A kernel switch: 1 = on, 0 = off, unset or empty = ``default``."""
    raw = (os.environ if environ is None else environ).get(name)
    if raw is None or not raw.strip():
        return default
    if raw.strip() in ("0", "1"):
        return raw.strip() == "1"
    raise ValueError(f"{name}={raw!r} is not understood; set it to 1 (on) or 0 (off).")


def env_choice(name: str, choices: tuple[str, ...], environ: dict | None = None) -> str:
    """A kernel choice: one of ``choices`` (case and spaces ignored), unset or empty = the
    first; anything else is an error naming the allowed values."""
    raw = (os.environ if environ is None else environ).get(name, "")
    value = raw.strip().lower() or choices[0]
    if value not in choices:
        raise ValueError(
            f"{name}={raw!r} is not understood; set it to one of {', '.join(choices)} "
            f"(or leave it unset for {choices[0]})."
        )
    return value


def pdl_requested(environ: dict | None = None) -> bool:
    """``SGLANG_ECHO_PDL``: unset or 1 = on where supported, 0 = off."""
    return env_switch(ENV_PDL, environ)


def pdl_supported(device: torch.device) -> bool:
    """CUDA at sm_90 or newer, compiled (not the interpreter)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _capability(device.index)[0] >= 9


def use_pdl(device: torch.device, asked: bool | None = None) -> bool:
    """Whether launches on ``device`` chain: ``asked`` (None: the default, SGLANG_ECHO_PDL)
    where the device supports it, never where it does not."""
    return pdl_supported(device) and (pdl_requested() if asked is None else asked)


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
# read only by later launches (kernel boundaries order memory), so "relaxed" suffices. The
# default "acq_rel" orders each atomic against every other access of its thread.
ATOMIC_SEM = "relaxed"
ATOMIC_SEMS = ("relaxed", "acq_rel")
