"""A prompt's host locations as contiguous extents, so its rows can go by copy engine.

Why: an arriving prompt's rows (gigabytes at 61 layers for 100K tokens) land in the pinned
host pool. Written by an ``index_copy_`` through the pool's UVA view, every byte is a GPU
store over PCIe: the writing blocks hold SMs while they wait, and decode steps beside a
transfer slow down. A copy of a contiguous range (``Tensor.copy_`` into a pinned slice) runs
on a copy engine and takes no SM. The token allocator hands a prompt back the locations a
finished request held, in the order it took them, so a prompt's locations are a few long
ascending runs (its predecessor's prompt) and a scatter of short ones (decode tokens,
interleaved across a batch): the long runs go by copy engine, the rest by the UVA scatter.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sglang_echo.model.periodic_rows import PeriodicRows

# Shorter runs are not worth a copy launch each (about a megabyte of bf16 rows per layer at
# this size).
MIN_EXTENT_TOKENS = 1024


@dataclass(frozen=True)
class HostExtents:
    """Where a prompt's rows go in the host pool.

    ``runs``: (first prompt position, first host location, length) of each long ascending
    run; ``rest``: the prompt positions outside them (int64, on the CPU)."""

    runs: tuple[tuple[int, int, int], ...]
    rest: torch.Tensor

    @property
    def tokens_in_runs(self) -> int:
        return sum(n for _, _, n in self.runs)


def split_extents(locs: Sequence[int], min_tokens: int = MIN_EXTENT_TOKENS) -> HostExtents:
    """``locs`` (a prompt's host locations in position order) as long runs and the rest.
    A handful of torch CPU ops over the prompt, on the transfer's writer thread before
    its first copy is queued: fast on one thread (runtime/host_threads.py), slow where
    they contend for a per-core pool with the engine thread's."""
    if min_tokens < 1:
        raise ValueError(f"min_tokens must be at least 1, got {min_tokens}")
    values = locs if isinstance(locs, array) and locs.typecode == "q" else array("q", locs)
    n = len(values)
    if n == 0:
        return HostExtents((), torch.zeros(0, dtype=torch.int64))
    t = torch.frombuffer(values, dtype=torch.int64)
    starts = torch.cat(
        [torch.zeros(1, dtype=torch.int64), torch.nonzero(t[1:] - t[:-1] != 1).flatten() + 1]
    )
    lengths = torch.diff(starts, append=torch.tensor([n]))
    long = lengths >= min_tokens
    runs = tuple(
        (s, int(values[s]), k)
        for s, k in zip(starts[long].tolist(), lengths[long].tolist(), strict=True)
    )
    in_short_run = torch.repeat_interleave(~long, lengths)
    return HostExtents(runs, torch.nonzero(in_short_run).flatten())


def copy_runs(
    dst: torch.Tensor, rows: torch.Tensor | PeriodicRows, runs: Sequence[tuple[int, int, int]]
) -> None:
    """Each run (first position, first location, length) of ``rows`` into ``dst`` (one
    layer's pinned host rows) by plain copies, which a copy engine runs: a slice of the
    rows, or for a window into a bank its contiguous stretches of the bank."""
    for pos, first, n in runs:
        if isinstance(rows, PeriodicRows):
            for bank_row, skip, take in rows.segments(pos, n):
                at = first + skip
                dst[at : at + take].copy_(rows.bank[bank_row : bank_row + take], non_blocking=True)
        else:
            dst[first : first + n].copy_(rows[pos : pos + n], non_blocking=True)


def rows_at(rows: torch.Tensor | PeriodicRows, positions: torch.Tensor) -> torch.Tensor:
    """The rows of prompt ``positions``."""
    return rows.gather(positions) if isinstance(rows, PeriodicRows) else rows[positions]


def all_rows(rows: torch.Tensor | PeriodicRows) -> torch.Tensor:
    """Every row, made where it is a window."""
    return rows.materialize() if isinstance(rows, PeriodicRows) else rows
