"""Exact LRU simulations of a device KV cache over traced top-k selections (one layer).

Semantics follow ECHO's decode step (docs/ARCHITECTURE.md section 4): first each
request's new token is appended into the cache, then the step's selections are looked up
(the new token is a hit if selected), hits are stamped with the step's clock, and just
enough victims are evicted among slots not used this step, least recently used first
(ties: lower token id), to admit the misses. ``shared`` = ECHO's one cache per layer for
all requests; a per-request buffer (HiSparse) is the same simulation run for each
request alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class CacheTooSmall(ValueError):
    """One step's selections (plus appended tokens) do not fit the cache."""


@dataclass
class LruResult:
    hits: np.ndarray  # [steps]
    lookups: np.ndarray  # [steps]
    evictions: int

    @property
    def hit_rate(self) -> float:
        total = int(self.lookups.sum())
        return float(self.hits.sum()) / total if total else float("nan")


def simulate_lru(
    selections: np.ndarray,
    appended: np.ndarray,
    initial: np.ndarray,
    capacity: int,
) -> LruResult:
    """selections [S, Q, K] token ids (-1 none), appended [S, Q] ids (-1 none), initial [N]
    ids resident before step 0 (in order of use; the last ones are the most recent)."""
    steps = selections.shape[0]
    ids_all = np.concatenate([selections.ravel(), appended.ravel(), initial.ravel()])
    n_ids = int(ids_all.max(initial=-1)) + 1
    last = np.full(max(n_ids, 1), -1, dtype=np.int64)  # last-use stamp; -1 = not resident
    init = initial[initial >= 0]
    init = init[-capacity:] if capacity > 0 else init[:0]
    last[init] = 0
    resident = int(np.count_nonzero(last >= 0))
    hits = np.zeros(steps, dtype=np.int64)
    lookups = np.zeros(steps, dtype=np.int64)
    evictions = 0

    def evict(n: int, stamp: int) -> None:
        nonlocal resident, evictions
        cand = np.flatnonzero((last >= 0) & (last < stamp))
        if cand.size < n:
            raise CacheTooSmall(
                f"capacity {capacity} cannot hold one step's selections and appended tokens"
            )
        order = last[cand] * n_ids + cand
        victims = cand[np.argpartition(order, n - 1)[:n]] if n < cand.size else cand
        last[victims] = -1
        resident -= n
        evictions += n

    for t in range(steps):
        stamp = t + 1
        new = appended[t][appended[t] >= 0]
        new = new[last[new] < 0]
        if new.size:
            overflow = resident + new.size - capacity
            if overflow > 0:
                evict(overflow, stamp)
            last[new] = stamp
            resident += new.size
        sel = np.unique(selections[t][selections[t] >= 0])
        present = last[sel] >= 0
        hits[t] = int(present.sum())
        lookups[t] = sel.size
        last[sel[present]] = stamp
        misses = sel[~present]
        overflow = resident + misses.size - capacity
        if overflow > 0:
            evict(overflow, stamp)
        last[misses] = stamp
        resident += misses.size
    return LruResult(hits, lookups, evictions)


def _offset(positions: np.ndarray, request_offset: np.ndarray) -> np.ndarray:
    return np.where(positions >= 0, positions + request_offset, -1)


def shared_cache_hit_rate(
    sel: np.ndarray, prompt_lens: np.ndarray, initial: np.ndarray, capacity: int
) -> LruResult:
    """ECHO: one cache per layer for all requests. sel [S, R, K] positions (-1 none),
    prompt_lens [R] (decode step t appends position prompt_len + t), initial [R, K]."""
    steps, n_req, _ = sel.shape
    stride = int(prompt_lens.max()) + steps + 1
    offsets = np.arange(n_req, dtype=np.int64) * stride
    appended = prompt_lens[None, :] + np.arange(steps)[:, None]  # [S, R] positions
    return simulate_lru(
        _offset(sel, offsets[None, :, None]),
        _offset(appended, offsets[None, :]),
        _offset(initial, offsets[:, None]).reshape(-1),
        capacity,
    )


def per_request_hit_rate(
    sel: np.ndarray, prompt_lens: np.ndarray, initial: np.ndarray, capacity: int
) -> LruResult:
    """HiSparse-like: each request has its own buffer of ``capacity`` slots per layer."""
    steps, n_req, _ = sel.shape
    hits = np.zeros(steps, dtype=np.int64)
    lookups = np.zeros(steps, dtype=np.int64)
    evictions = 0
    for r in range(n_req):
        appended = (prompt_lens[r] + np.arange(steps))[:, None]
        res = simulate_lru(sel[:, r : r + 1, :], appended, initial[r], capacity)
        hits += res.hits
        lookups += res.lookups
        evictions += res.evictions
    return LruResult(hits, lookups, evictions)
