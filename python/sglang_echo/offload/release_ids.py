"""The host-side check of host ids released from ECHO's cache.

Why apart from EchoManager: a release of the sink, of an id outside the pool or of an id
listed twice would corrupt the cache for good (a slot pushed twice is later shared by two
tokens), so ids known on the host are refused before the cache changes; the check keeps a
host scratch of its own and knows nothing of the cache's operations.
"""

from __future__ import annotations

import torch


class ReleaseIdCheck:
    """Refuses the sink, ids outside [1, N_H] and duplicates among released host ids."""

    def __init__(self, host_tokens: int) -> None:
        self.host_tokens = host_tokens
        self.marks: torch.Tensor | None = None  # host scratch of the duplicate check

    def __call__(self, locs: torch.Tensor) -> None:
        """Refuse the sink, ids outside [1, N_H] and duplicates (a duplicate would push one
        slot twice, and two tokens would later share it). A few vectorised passes over
        the ids on the host, outside the decode step."""
        ids = locs.reshape(-1).to(torch.int64)
        if ids.numel() == 0:
            return
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 1 or hi > self.host_tokens:
            bad = lo if lo < 1 else hi
            what = "the padding sink (host row 0)" if bad == 0 else f"host id {bad}"
            raise ValueError(
                f"release of {what}: released ids must be tokens of the host pool, "
                f"1..{self.host_tokens}; the caller's token bookkeeping is corrupt"
            )
        if self.marks is None:
            self.marks = torch.zeros(self.host_tokens + 2, dtype=torch.int32)
        # Each id's entry gets one of its lanes (the last write wins); an id listed twice
        # then reads back another lane's number in one of its lanes. Every entry read was
        # written in this call, so the scratch needs no reset.
        lanes = torch.arange(ids.numel(), dtype=torch.int32)
        marks = self.marks
        marks[ids] = lanes
        twice = marks[ids] != lanes
        if bool(twice.any()):
            dup = int(ids[twice][0])
            raise ValueError(
                f"release lists host id {dup} more than once: its slot would be pushed twice "
                "and later shared by two tokens; release each token once"
            )
