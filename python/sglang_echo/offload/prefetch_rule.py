"""When the decode prefetch runs under SGLANG_NSA_FUSE_LOGITS_RECALL_DECODE=auto: a
measured rule on the previous decode step's miss fraction.

Why a rule: the staged prefetch (kernels/decode_stage.py) pays when a step recalls many
rows and costs a few percent when it recalls few (the chunked logits, the side stream's
kernels beside the top-k). On an H200 (benchmark/results/decode_prefetch.json, batch 16
x 128K; the evidence row "decode prefetch") it was faster where a tenth of the selections
or more missed and slower where nearly all hit, so it runs when the previous step missed
at least ``AUTO_MISS_FRACTION`` of its selections. Decode steps
of a running batch select mostly the same tokens, so the last step's misses predict the
next one's.

The counters are the device cache's cumulative hits and misses per layer. Before and
after each decode step they are stored to pinned host memory without waiting, by the GPU
through the buffer's UVA alias (kernels/pinned_store.py: a copy engine would queue them
behind an arrival's bulk copies); the difference is the decode step's own, whatever
prefill chunks ran in between. The caller reads them before the next decode step, when the
step's results have long been synchronised (sampling reads the logits), so the rule never
stalls the device.
Under CUDA graphs the runner keeps one graph per (batch size, prefetch on or off) and
replays the one the rule picks.
"""

from __future__ import annotations

import torch

from sglang_echo.kernels.host_copy import cuda_alias_of_pinned
from sglang_echo.kernels.pinned_store import as_bytes, store_bytes

# Prefetch from this miss fraction of a decode step's selections up: between the hit
# rates where the staged prefetch was last faster and slower on the H200 (the evidence
# row "decode prefetch").
AUTO_MISS_FRACTION = 0.07


class DecodePrefetchRule:
    def __init__(
        self, device: torch.device, layers: int, threshold: float = AUTO_MISS_FRACTION
    ) -> None:
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"miss fraction threshold must be in [0, 1], got {threshold}")
        self.threshold = float(threshold)
        pin = device.type == "cuda"
        # Two slots, one per decode step in turn, each [before, after] x [hits, misses] x
        # layers with the event recorded after its copies: with overlap scheduling a step
        # is launched while the one before still runs, so ``decide`` reads the newest slot
        # whose copies have landed (the step before the previous one, then).
        self._counts = torch.zeros(2, 2, 2, layers, dtype=torch.int64, pin_memory=pin)
        self._counts_alias = cuda_alias_of_pinned(self._counts) if pin else None
        self._copied = [torch.cuda.Event() if pin else None for _ in range(2)]
        self._filled = [False, False]  # copies queued and not yet read
        self._slot = 0  # where the coming step's copies go
        self.on = False  # the first decode step has no measurement: off
        self.steps_on = 0
        self.steps = 0

    def _snapshot(self, which: int, hits: torch.Tensor, misses: torch.Tensor) -> None:
        if self._counts_alias is not None:
            dst = self._counts_alias[self._slot, which]
            store_bytes(as_bytes(hits), as_bytes(dst[0]))
            store_bytes(as_bytes(misses), as_bytes(dst[1]))
            return
        async_copy = hits.device.type == "cuda"
        self._counts[self._slot, which, 0].copy_(hits, non_blocking=async_copy)
        self._counts[self._slot, which, 1].copy_(misses, non_blocking=async_copy)

    def before_step(self, hits: torch.Tensor, misses: torch.Tensor) -> None:
        """Enqueue the copy of the counters (device tensors [layers] int64)."""
        self._filled[self._slot] = False  # being overwritten: not readable until after_step
        self._snapshot(0, hits, misses)

    def after_step(self, hits: torch.Tensor, misses: torch.Tensor) -> None:
        self._snapshot(1, hits, misses)
        event = self._copied[self._slot]
        if event is not None:
            event.record()
        self._filled[self._slot] = True
        self._slot = 1 - self._slot

    def _landed(self, slot: int) -> bool:
        event = self._copied[slot]
        return self._filled[slot] and (event is None or event.query())

    def decide(self) -> bool:
        """Whether the coming decode step prefetches: the miss fraction of the newest decode
        step whose counters have landed in pinned memory (the previous one, or with a step
        still running the one before; none new: the decision stays, as a mode changes speed
        only, never what a step selects)."""
        self.steps += 1
        newest, older = 1 - self._slot, self._slot
        slot = newest if self._landed(newest) else older if self._landed(older) else None
        if slot is not None:
            (h0, m0), (h1, m1) = self._counts[slot].sum(dim=2).tolist()
            d_hits, d_misses = h1 - h0, m1 - m0
            # each measurement decides once, and none older than it after it
            self._filled[slot] = False
            if slot == newest:
                self._filled[older] = False
            selected = d_hits + d_misses
            self.on = selected > 0 and d_misses >= self.threshold * selected
        self.steps_on += int(self.on)
        return self.on
