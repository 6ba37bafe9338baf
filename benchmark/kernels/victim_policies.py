"""Hit rates of victim policies on one selection trace, simulated with the same rules as
ECHO's per-layer cache (one shared cache, this step's selections protected, misses take
free slots first). Exact LRU needs a global sort of every slot's last use each step; the
bucketed LRU of kernels/alloc.py needs a 256-bin histogram; CLOCK needs a hand and a
reference bit per slot; FIFO needs only insertion order.
"""

from __future__ import annotations

import torch

from sglang_echo.kernels.alloc import age_bucket, victim_mask

POLICIES = ("lru_exact", "lru_bucketed", "clock", "fifo")


class PolicySim:
    def __init__(self, policy: str, slots: int, host_tokens: int, device: torch.device) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose from {POLICIES}")
        self.policy = policy
        self.slots = slots
        self.owner = torch.full((slots,), -1, dtype=torch.int64, device=device)
        self.where = torch.full((host_tokens,), -1, dtype=torch.int64, device=device)
        self.last_use = torch.zeros(slots, dtype=torch.int64, device=device)
        self.inserted = torch.zeros(slots, dtype=torch.int64, device=device)
        self.ref = torch.zeros(slots, dtype=torch.bool, device=device)
        self.hand = 0
        self.clock = 0
        self.hits = 0
        self.misses = 0

    def step(self, ids: torch.Tensor) -> None:
        """One resolve of the unique host ids ``ids`` (1-D)."""
        self.clock += 1
        slot = self.where[ids]
        hit = slot >= 0
        self.hits += int(hit.sum())
        hit_slots = slot[hit]
        self.last_use[hit_slots] = self.clock
        self.ref[hit_slots] = True
        miss_ids = ids[~hit]
        n = miss_ids.numel()
        self.misses += n
        if n == 0:
            return
        free = (self.owner < 0).nonzero().squeeze(1)
        take_free = free[:n]
        need = n - take_free.numel()
        victims = self._victims(need) if need > 0 else take_free[:0]
        old = self.owner[victims]
        self.where[old] = -1
        dest = torch.cat((take_free, victims))
        self.owner[dest] = miss_ids
        self.where[miss_ids] = dest
        self.last_use[dest] = self.clock
        self.inserted[dest] = self.clock
        self.ref[dest] = False

    def _victims(self, need: int) -> torch.Tensor:
        evictable = (self.owner >= 0) & (self.last_use < self.clock)
        idx = torch.arange(self.slots, device=self.owner.device)
        if self.policy == "lru_exact":
            key = torch.where(evictable, self.last_use, torch.iinfo(torch.int64).max)
            return torch.sort(key, stable=True).indices[:need]
        if self.policy == "fifo":
            key = torch.where(evictable, self.inserted, torch.iinfo(torch.int64).max)
            return torch.sort(key, stable=True).indices[:need]
        if self.policy == "lru_bucketed":
            bucket = torch.where(evictable, age_bucket(self.clock - self.last_use), -1)
            return idx[victim_mask(bucket, torch.tensor(need, device=idx.device))]
        # CLOCK: sweep from the hand; referenced slots get a second chance (bit cleared).
        order = torch.roll(idx, -self.hand)
        cand = evictable[order]
        unref = cand & ~self.ref[order]
        picked = order[unref][:need]
        if picked.numel() < need:  # a full sweep cleared every bit: take referenced ones
            rest = order[cand & self.ref[order]][: need - picked.numel()]
            picked = torch.cat((picked, rest))
            self.ref[order[cand]] = False
        else:
            last = int((order == picked[-1]).nonzero()[0, 0])
            swept = order[: last + 1]
            self.ref[swept] = False
        self.hand = (int(picked[-1]) + 1) % self.slots
        return picked

    @property
    def hit_rate(self) -> float:
        return self.hits / max(1, self.hits + self.misses)


def policy_hit_rates(
    trace: torch.Tensor, slots: int, host_tokens: int, warmup_steps: int
) -> dict[str, float]:
    """trace [steps, batch, topk] host ids (-1 = none): each policy's hit rate after
    ``warmup_steps`` steps."""
    rates = {}
    for policy in POLICIES:
        sim = PolicySim(policy, slots, host_tokens, trace.device)
        for t in range(trace.shape[0]):
            if t == warmup_steps:
                sim.hits = sim.misses = 0
            ids = trace[t].reshape(-1)
            sim.step(torch.unique(ids[ids >= 0]))
        rates[policy] = sim.hit_rate
    return rates
