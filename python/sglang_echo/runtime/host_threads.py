"""Torch's CPU thread pool kept to one thread where the model runs on a GPU.

Why: the engine's host work between steps is small torch ops over a request's token
locations (a prompt's ids checked on release, its locations staged for upload), called
from several threads at once (the engine thread, a decode node's transfer writer). With
torch's default pool (one thread per core) each such op starts a parallel region; regions
from two threads compete for the same cores, and ops of a tenth of a millisecond alone
took tens of milliseconds on a busy two-core machine. One thread makes them cost what
their work costs. The model's own work is on the GPU, so nothing there is lost; on the
CPU the model's matmuls need the pool, so it is left alone. ``OMP_NUM_THREADS``, when set,
is the operator's choice and is kept. The server's engine applies it (in its own process,
or in the server's); a library caller (a test, a notebook) keeps its pool.
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger("sglang_echo.host_threads")


def limit_host_threads(device: torch.device) -> int | None:
    """One intra-op thread for a CUDA engine (unless ``OMP_NUM_THREADS`` is set); returns
    the count it replaced, or None where it changed nothing."""
    if device.type != "cuda" or os.environ.get("OMP_NUM_THREADS"):
        return None
    before = torch.get_num_threads()
    if before <= 1:
        return None
    torch.set_num_threads(1)
    log.info(
        "torch CPU threads %d -> 1 (the engine's host work is small ops from several "
        "threads; set OMP_NUM_THREADS to choose)",
        before,
    )
    return before
