"""A prompt's MLA rows as a window into a small bank of rows, for emulated KV arrival.

Why: a PD decode node measured alone (the fake transfer) must put a prompt's rows where a
real transfer would, at the cost a real one has on the decode GPU: none (RDMA lands them
in host memory). Generating 100K random rows per layer per prompt took the decode's SMs
and bounded how fast prompts could arrive. A window into a per-layer bank of a few
thousand random rows (position p's row is ``bank[(offset + p) % P]``) is as deterministic
per prompt, costs nothing to make, and its contiguous stretches go by copy engine straight
from the bank into the host pool. The rows' values never decide which tokens a step
selects (the index keys do), so a periodic pattern changes no measured behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PeriodicRows:
    """``length`` rows, position p's being ``bank[(offset + p) % len(bank)]``."""

    bank: torch.Tensor  # [P, row_dim]
    offset: int
    length: int

    def __post_init__(self) -> None:
        if self.bank.dim() != 2 or self.bank.shape[0] < 1:
            raise ValueError(f"the bank must be [P >= 1, row_dim], got {tuple(self.bank.shape)}")
        if not 0 <= self.offset < self.bank.shape[0]:
            raise ValueError(f"offset {self.offset} is outside the bank of {self.bank.shape[0]}")

    @property
    def period(self) -> int:
        return int(self.bank.shape[0])

    def bank_index(self, positions: torch.Tensor) -> torch.Tensor:
        """The bank rows of prompt ``positions`` (int64, on the bank's device)."""
        return (positions.to(self.bank.device, torch.int64) + self.offset) % self.period

    def gather(self, positions: torch.Tensor) -> torch.Tensor:
        return self.bank.index_select(0, self.bank_index(positions))

    def materialize(self) -> torch.Tensor:
        """All ``length`` rows [length, row_dim] (what a backend without a copy path takes)."""
        return self.gather(torch.arange(self.length, device=self.bank.device))

    def segments(self, start: int, count: int) -> list[tuple[int, int, int]]:
        """Positions start..start+count-1 as contiguous bank stretches: (bank row, offset
        from ``start``, rows), in position order; each is one plain copy."""
        if start < 0 or count < 0 or start + count > self.length:
            raise ValueError(f"positions {start}..{start + count} are outside 0..{self.length}")
        out = []
        done = 0
        while done < count:
            first = (self.offset + start + done) % self.period
            take = min(count - done, self.period - first)
            out.append((first, done, take))
            done += take
        return out

    def with_bank(self, bank: torch.Tensor) -> PeriodicRows:
        """The same window over another bank of the same period (its stored form)."""
        if bank.shape[0] != self.period:
            raise ValueError(f"a bank of {bank.shape[0]} rows for a period of {self.period}")
        return PeriodicRows(bank, self.offset, self.length)
