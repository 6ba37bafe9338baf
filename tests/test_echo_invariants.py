"""Stateful property tests of the ECHO memory system (docs/ARCHITECTURE.md section 8),
on CPU.

A model of live requests drives ``EchoKVCache``: requests start (prefill writes), decode
(write one token each as the runtime does, to the host only, then one top-k resolve per
layer), run prefill-like resolves whose rows overlap, and finish (release, host ids go
back to the allocator and get reused). The machines run the configuration users run, the
default eviction reserve and decode-mode writes with placement; variants keep reserve 0
and append, or write decode tokens to the host only.
After every operation the device cache's tensors are read directly and checked against
the invariants of the design:

* ``host_to_device`` and ``device_to_host`` are inverse bijections over resident tokens,
  and only ids of live requests are ever mapped;
* free + used = N_G, and the free stack's first ``free_count`` entries are the free slots;
* slot 0 <-> host row 0 never moves;
* after a resolve every selected token is resident and its device row equals its host row
  byte for byte; -1 stays -1; equal ids share a slot;
* with need = max(0, misses - free): no eviction when need is 0, else need victims plus
  the reserve's extra ones (as many as there are unselected residents), left free; hits +
  misses = distinct ids, and the victims are the oldest unselected slots by bucketed age
  (then lowest slot), as kernels/alloc.py documents;
* release returns every resident slot of the request;
* host rows of live requests never change; every resident device row equals its host row.

N_G is the legal minimum for MAX_REQ requests x TOPK (the config check is asserted too).
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from sglang_echo.config import ConfigError, EchoConfig
from sglang_echo.kernels.alloc import age_bucket
from sglang_echo.offload.device_cache import ABSENT, FREE
from sglang_echo.offload.echo_cache import EchoKVCache
from sglang_echo.runtime.token_table import TokenSlotAllocator

NUM_LAYERS = 2
ROW_DIM = 8
INDEX_DIM = 4
MAX_REQ = 3  # requests per decode step
TOPK = 4
N_G = MAX_REQ * TOPK  # legal minimum device cache size (chunk size <= N_G)
N_H = 64
MAX_PREFILL = 12  # tokens written by one start (one prefill chunk); <= N_G


def _marks_broken(fn):
    """After a failed check the state is garbage: remember it, so teardown skips its checks
    (otherwise Hypothesis sees a second, different failure and shrinks both)."""

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        try:
            return fn(self, *args, **kwargs)
        except BaseException:
            self.broken = True
            raise

    return wrapper


class EchoModel:
    """The cache under test plus a shadow of what the test wrote, with checked operations."""

    def __init__(
        self,
        n_g: int = N_G,
        n_h: int = N_H,
        reserve: int | None = None,
        decode_writes: bool = True,
        decode_place: bool = True,
    ) -> None:
        self.n_g = n_g
        self.n_h = n_h
        # None: the default reserve for N_G, as a server runs; decode_writes: a decode
        # step's tokens go through write(..., decode=True), as the runtime does, placed in
        # free slots (decode_place, the default) or host-only; else appended.
        config = EchoConfig(
            offload=True, dev_cache_size=n_g, eviction_reserve=reserve, decode_place=decode_place
        )
        self.reserve = config.eviction_reserve
        self.decode_writes = decode_writes
        self.decode_place = decode_place
        self.kv = EchoKVCache(
            config,
            num_layers=NUM_LAYERS,
            host_tokens=n_h,
            kv_row_dim=ROW_DIM,
            index_dim=INDEX_DIM,
            dtype=torch.float32,
            device="cpu",
        )
        self.c = self.kv.cache
        self.alloc = TokenSlotAllocator(n_h)
        self.broken = False
        self.live: dict[int, list[int]] = {}
        # A verify's rejected positions per request: the last ids of its live list, held
        # and written again by its next verify (runtime/speculative.py).
        self.tail: dict[int, int] = {}
        self.next_rid = 0
        self.counter = 0
        # What the test wrote to each (layer, host id): the host must keep exactly this.
        self.expected_host = torch.zeros_like(self.kv.host.rows)

    # ------------------------------------------------------------------ helpers
    def live_ids(self) -> set[int]:
        return {h for ids in self.live.values() for h in ids}

    def _fresh_rows(self, n: int, dim: int) -> torch.Tensor:
        """Rows unique across the whole run (exact in float32), so byte equality means
        the right row landed in the right place."""
        base = self.counter
        self.counter += n * dim
        vals = torch.arange(base, base + n * dim, dtype=torch.float64).reshape(n, dim)
        return (vals * 0.25 - 1000.0).to(torch.float32)

    def _snapshot(self, layer: int) -> dict:
        c = self.c
        return {
            "h2d": c.host_to_device[layer].tolist(),
            "d2h": c.device_to_host[layer].tolist(),
            "prio": c.priority[layer].tolist(),
            "clock": int(c.clock[layer]),
            "free": int(c.free_count[layer]),
            "hits": int(c.hits[layer]),
            "misses": int(c.misses[layer]),
            "evictions": int(c.evictions[layer]),
            "append_evictions": int(c.append_evictions[layer]),
            "recalled": int(c.recalled_rows[layer]),
        }

    def _resident(self, snap: dict) -> dict[int, int]:
        """host id -> slot for every resident token of a snapshot."""
        h2d = snap["h2d"]
        return {h: h2d[h] for h in range(1, self.n_h + 1) if h2d[h] != ABSENT}

    def _check_victims(
        self, before: dict, after: dict, protected: set[int], n_evicted: int, what: str
    ) -> None:
        """Exactly ``n_evicted`` unprotected resident tokens left, the oldest by bucketed
        age (kernels/alloc.age_bucket; ties: lowest slot); every other resident token kept
        its slot."""
        res_before, res_after = self._resident(before), self._resident(after)
        gone = {h for h in res_before if h not in res_after}
        assert not gone & protected, f"{what}: evicted protected ids {sorted(gone & protected)}"
        assert len(gone) == n_evicted, f"{what}: {len(gone)} tokens left, counter says {n_evicted}"
        for h, s in res_before.items():
            if h not in gone:
                assert res_after[h] == s, f"{what}: id {h} moved from slot {s} to {res_after[h]}"
        prio, stamp = before["prio"], after["clock"]
        age = lambda h: int(age_bucket(torch.tensor(stamp - prio[res_before[h]])))  # noqa: E731
        candidates = sorted(
            (h for h in res_before if h not in protected),
            key=lambda h: (-age(h), res_before[h]),
        )
        assert gone == set(candidates[:n_evicted]), (
            f"{what}: evicted {sorted(gone)}, oldest were {candidates[:n_evicted]}"
        )

    def _check_eviction_count(
        self, before: dict, after: dict, demand: int, evicted: int, evictable: int, what: str
    ) -> None:
        """``demand`` new slots with ``before['free']`` free: no eviction if they fit;
        otherwise the misses' victims plus the reserve's extras (as many as there are
        evictable residents), and exactly the extras stay free."""
        need = max(0, demand - before["free"])
        if need == 0:
            assert evicted == 0, f"{what}: {demand} fit in {before['free']} free, {evicted} evicted"
            assert after["free"] == before["free"] - demand, what
            return
        extra = min(self.reserve, evictable - need)
        assert evicted == need + extra, (
            f"{what}: need {need} (+ reserve {self.reserve}, {evictable} evictable) evicted {evicted}"
        )
        assert after["free"] == extra, f"{what}: {after['free']} free after, expected {extra}"

    # --------------------------------------------------------------- operations
    @_marks_broken
    def write_decode(self, layer: int, locs: list[int]) -> None:
        """A decode step's ``cache.write(..., decode=True)`` of fresh ids: host rows and
        index keys; with placement, the first min(tokens, free) ids in lane order take the
        slots on top of the free stack, stamped with the layer's clock, their rows written
        there; the rest stay host-only. Nothing is evicted, no other mapping moves, no
        counter changes."""
        before = self._snapshot(layer)
        assert all(before["h2d"][h] == ABSENT for h in locs), "a fresh id was mapped"
        self.write_verify(layer, locs)

    @_marks_broken
    def write_verify(self, layer: int, locs: list[int]) -> None:
        """``write_decode`` of a verify's lanes, fresh ids and ids of rejected positions
        written again: an id resident before keeps its slot and gets the new row there
        (with placement and without); with placement the absent ones take the slots on top
        of the free stack in lane order while they last, stamped with the layer's clock."""
        rows = self._fresh_rows(len(locs), ROW_DIM)
        keys = self._fresh_rows(len(locs), INDEX_DIM)
        before = self._snapshot(layer)
        stack = self.c.free_stack[layer].tolist()
        t = torch.tensor(locs, dtype=torch.int64)
        self.kv.write(layer, t, rows, keys, decode=True)
        self.expected_host[layer, t] = rows
        assert torch.equal(self.kv.host.rows[layer, t], rows)
        assert torch.equal(self.kv.index_keys(layer)[t], keys)
        after = self._snapshot(layer)
        placed = []
        for i, h in enumerate(locs):
            s = before["h2d"][h]
            if s != ABSENT:  # rewritten in place
                assert after["h2d"][h] == s, f"id {h} moved from slot {s}"
                assert torch.equal(self.c.rows[layer, s], rows[i]), f"slot {s}: stale row"
            elif self.decode_place and len(placed) < before["free"]:
                s = stack[before["free"] - 1 - len(placed)]
                placed.append(h)
                assert after["h2d"][h] == s and after["d2h"][s] == h, f"id {h}: not in slot {s}"
                assert after["prio"][s] == before["clock"], f"slot {s}: not stamped now"
                assert torch.equal(self.c.rows[layer, s], rows[i]), f"slot {s}: wrong row"
            else:
                assert after["h2d"][h] == ABSENT, f"id {h} mapped with no free slot"
        assert after["free"] == before["free"] - len(placed)
        for key in ("clock", "hits", "misses", "evictions", "append_evictions", "recalled"):
            assert after[key] == before[key], f"layer {layer}: a decode write moved {key}"
        res_before, res_after = self._resident(before), self._resident(after)
        assert all(res_after.get(h) == s for h, s in res_before.items()), "a resident moved"
        assert set(res_after) - set(res_before) == set(placed)

    @_marks_broken
    def verify(
        self, rid: int, q: int, pick: Callable[[list[int], int], list[int]], accept: int
    ) -> None:
        """A verify of ``q`` positions of one request: its rejected tail and fresh ids
        written (``write_verify``), then per layer ONE resolve of its q lanes, lane j
        selecting among positions 0..committed + j (the lanes repeat ids), then ``accept``
        + 1 positions committed; the rest is the tail the next verify writes again."""
        ids = self.live[rid]
        held = self.tail.get(rid, 0)
        new = self.alloc.alloc(q - held)
        ids.extend(new)
        committed = len(ids) - q
        lanes = ids[committed:]
        for layer in range(NUM_LAYERS):
            self.write_verify(layer, lanes)
        for layer in range(NUM_LAYERS):
            sel = []
            for j in range(q):
                chosen = pick(ids[: committed + j + 1], layer)
                sel.append(chosen + [-1] * (TOPK - len(chosen)))
            self.resolve(layer, sel)
        self.tail[rid] = q - (accept + 1)

    @_marks_broken
    def write(self, layer: int, locs: list[int]) -> None:
        """``cache.write`` of fresh rows for new host ids, checked."""
        n = len(locs)
        rows = self._fresh_rows(n, ROW_DIM)
        keys = self._fresh_rows(n, INDEX_DIM)
        before = self._snapshot(layer)
        t = torch.tensor(locs, dtype=torch.int64)
        self.kv.write(layer, t, rows, keys)
        self.expected_host[layer, t] = rows
        after = self._snapshot(layer)
        c = self.c

        assert torch.equal(self.kv.host.rows[layer, t], rows)
        assert torch.equal(self.kv.index_keys(layer)[t], keys)
        for i, h in enumerate(locs):
            s = after["h2d"][h]
            assert 1 <= s <= self.n_g, f"layer {layer}: appended id {h} got slot {s}"
            assert after["d2h"][s] == h
            assert torch.equal(c.rows[layer, s], rows[i]), f"layer {layer}: device row of {h}"
        assert len({after["h2d"][h] for h in locs}) == n, "appended ids share a slot"
        n_evicted = after["append_evictions"] - before["append_evictions"]
        evictable = len(self._resident(before))  # an append may evict any resident token
        self._check_eviction_count(
            before, after, n, n_evicted, evictable, f"layer {layer} append of {n}"
        )
        self._check_victims(before, after, set(locs), n_evicted, f"layer {layer} append")

    @_marks_broken
    def resolve(self, layer: int, sel: list[list[int]]) -> None:
        """``cache.resolve`` of a [Q, TOPK] selection (-1 = none), checked."""
        c = self.c
        before = self._snapshot(layer)
        sel_t = torch.tensor(sel, dtype=torch.int64)
        buffer, out = self.kv.resolve(layer, sel_t)
        after = self._snapshot(layer)

        assert buffer.data_ptr() == c.rows[layer].data_ptr()
        assert out.shape == sel_t.shape
        out_l = out.tolist()
        slot_of: dict[int, int] = {}
        for q, row in enumerate(sel):
            for k, h in enumerate(row):
                s = out_l[q][k]
                if h == -1:
                    assert s == -1, f"layer {layer}: padding at [{q},{k}] resolved to {s}"
                    continue
                assert 1 <= s <= self.n_g, f"layer {layer}: id {h} resolved to slot {s}"
                assert after["h2d"][h] == s, (
                    f"layer {layer}: id {h} -> {s}, map says {after['h2d'][h]}"
                )
                assert after["d2h"][s] == h
                assert slot_of.setdefault(h, s) == s, f"layer {layer}: id {h} got two slots"
                assert torch.equal(c.rows[layer, s], self.kv.host.rows[layer, h]), (
                    f"layer {layer}: device row of id {h} (slot {s}) differs from its host row"
                )
        assert len(set(slot_of.values())) == len(slot_of), "distinct ids share a slot"

        distinct = set(slot_of)
        was_resident = {h for h in distinct if before["h2d"][h] != ABSENT}
        hits = after["hits"] - before["hits"]
        misses = after["misses"] - before["misses"]
        evictions = after["evictions"] - before["evictions"]
        assert hits + misses == len(distinct), f"layer {layer}: {hits}+{misses} != {len(distinct)}"
        assert misses == len(distinct - was_resident)
        assert after["recalled"] - before["recalled"] == misses
        for h in was_resident:
            assert after["h2d"][h] == before["h2d"][h], f"layer {layer}: hit {h} moved"
        evictable = len(set(self._resident(before)) - distinct)
        self._check_eviction_count(
            before, after, misses, evictions, evictable, f"layer {layer} resolve"
        )
        self._check_victims(before, after, distinct, evictions, f"layer {layer} resolve")

    @_marks_broken
    def start(self, n: int) -> int:
        locs = self.alloc.alloc(n)
        assert not set(locs) & self.live_ids(), "allocator handed out a live id"
        for layer in range(NUM_LAYERS):
            self.write(layer, locs)
        rid = self.next_rid
        self.next_rid += 1
        self.live[rid] = list(locs)
        return rid

    @_marks_broken
    def decode(self, rids: list[int], pick: Callable[[list[int], int], list[int]]) -> None:
        """One decode step: append one token to each request, then resolve each layer.

        ``pick(ids, layer)`` returns the (distinct) ids a request selects in that layer."""
        assert 1 <= len(rids) <= MAX_REQ
        new = self.alloc.alloc(len(rids))
        for rid, h in zip(rids, new, strict=True):
            self.live[rid].append(h)
        for layer in range(NUM_LAYERS):
            (self.write_decode if self.decode_writes else self.write)(layer, new)
        for layer in range(NUM_LAYERS):
            sel = []
            for rid in rids:
                chosen = pick(self.live[rid], layer)
                assert len(chosen) == len(set(chosen)) <= TOPK
                sel.append(chosen + [-1] * (TOPK - len(chosen)))
            self.resolve(layer, sel)

    @_marks_broken
    def finish(self, rid: int) -> None:
        locs = self.live.pop(rid)
        self.tail.pop(rid, None)
        c = self.c
        free_before = c.free_count.tolist()
        resident_before = [
            sum(int(c.host_to_device[layer, h]) != ABSENT for h in locs)
            for layer in range(NUM_LAYERS)
        ]
        slots_before = [
            {int(c.host_to_device[layer, h]) for h in locs} - {ABSENT}
            for layer in range(NUM_LAYERS)
        ]
        self.kv.release(torch.tensor(locs, dtype=torch.int64))
        for layer in range(NUM_LAYERS):
            h2d = c.host_to_device[layer]
            assert all(int(h2d[h]) == ABSENT for h in locs), f"layer {layer}: released id mapped"
            assert int(c.free_count[layer]) == free_before[layer] + resident_before[layer]
            for s in slots_before[layer]:
                assert int(c.device_to_host[layer, s]) == FREE, f"layer {layer}: slot {s} not freed"
        self.alloc.free(locs)

    # --------------------------------------------------------------- invariants
    @_marks_broken
    def check_invariants(self) -> None:
        c = self.c
        live = self.live_ids()
        assert self.alloc.num_free + len(live) == self.n_h
        for layer in range(NUM_LAYERS):
            h2d = c.host_to_device[layer].tolist()
            d2h = c.device_to_host[layer].tolist()
            prio = c.priority[layer].tolist()
            fc = int(c.free_count[layer])
            clock = int(c.clock[layer])
            assert h2d[0] == 0 and d2h[0] == 0, f"layer {layer}: the sink moved"
            occupied = []
            free = []
            for s in range(1, self.n_g + 1):
                h = d2h[s]
                if h >= 1:
                    assert h <= self.n_h, f"layer {layer}: slot {s} maps to bad id {h}"
                    assert h2d[h] == s, f"layer {layer}: slot {s} -> {h} -> {h2d[h]}"
                    assert h in live, f"layer {layer}: slot {s} holds dead id {h}"
                    assert 0 <= prio[s] <= clock, f"layer {layer}: slot {s} priority {prio[s]}"
                    occupied.append(s)
                else:
                    assert h == FREE, f"layer {layer}: slot {s} maps to {h}"
                    assert prio[s] == FREE, f"layer {layer}: free slot {s} has priority {prio[s]}"
                    free.append(s)
            for h in range(1, self.n_h + 1):
                s = h2d[h]
                if s != ABSENT:
                    assert 1 <= s <= self.n_g, f"layer {layer}: id {h} maps to slot {s}"
                    assert d2h[s] == h, f"layer {layer}: id {h} -> {s} -> {d2h[s]}"
            assert 0 <= fc <= self.n_g
            assert fc + len(occupied) == self.n_g, (
                f"layer {layer}: free_count {fc} + used {len(occupied)} != {self.n_g}"
            )
            stack = c.free_stack[layer, :fc].tolist()
            assert len(stack) == len(set(stack)), f"layer {layer}: duplicate free slots {stack}"
            assert set(stack) == set(free), f"layer {layer}: stack {stack} vs free {free}"
            # Every resident row is its host row; live host rows are what was written.
            if occupied:
                s_t = torch.tensor(occupied)
                ids_t = torch.tensor([d2h[s] for s in occupied])
                assert torch.equal(c.rows[layer, s_t], self.kv.host.rows[layer, ids_t])
        if live:
            ids_t = torch.tensor(sorted(live))
            assert torch.equal(self.kv.host.rows[:, ids_t], self.expected_host[:, ids_t]), (
                "a live request's host row changed"
            )

    @_marks_broken
    def release_all_and_check(self) -> None:
        for rid in sorted(self.live):
            self.finish(rid)
            self.check_invariants()
        c = self.c
        assert c.free_count.tolist() == [self.n_g] * NUM_LAYERS
        assert bool((c.host_to_device[:, 1 : self.n_h + 1] == ABSENT).all())
        assert bool((c.device_to_host[:, 1 : self.n_g + 1] == FREE).all())
        assert self.alloc.num_free == self.n_h


def test_dev_cache_size_is_the_legal_minimum():
    kw = dict(host_tokens=N_H, max_running_requests=MAX_REQ, topk=TOPK, chunk_size=MAX_PREFILL)
    EchoConfig(offload=True, dev_cache_size=N_G).validate(**kw)
    with pytest.raises(ConfigError):
        EchoConfig(offload=True, dev_cache_size=N_G - 1).validate(**kw)
    model = EchoModel()
    assert model.kv.max_resolve_queries(TOPK) == N_G // TOPK
    model.check_invariants()


class EchoMachine(RuleBasedStateMachine):
    """The default configuration: the default eviction reserve, decode-mode writes."""

    n_g = N_G
    n_h = N_H
    reserve: int | None = None
    decode_writes = True
    decode_place = True

    def __init__(self) -> None:
        super().__init__()
        self.m = EchoModel(self.n_g, self.n_h, self.reserve, self.decode_writes, self.decode_place)

    @precondition(lambda self: self.m.alloc.num_free >= 1)
    @rule(data=st.data())
    def start_request(self, data):
        n = data.draw(st.integers(1, min(MAX_PREFILL, self.m.alloc.num_free)), label="n")
        self.m.start(n)

    @precondition(lambda self: self.m.live and self.m.alloc.num_free >= 1)
    @rule(data=st.data())
    def decode_step(self, data):
        m = self.m
        untailed = sorted(r for r in m.live if not m.tail.get(r))
        if not untailed:
            return
        most = min(MAX_REQ, len(untailed), m.alloc.num_free)
        rids = data.draw(
            st.lists(st.sampled_from(untailed), min_size=1, max_size=most, unique=True),
            label="requests",
        )

        def pick(ids: list[int], layer: int) -> list[int]:
            k = min(TOPK, len(ids))
            return data.draw(
                st.lists(st.sampled_from(ids), min_size=k, max_size=k, unique=True),
                label=f"topk layer {layer}",
            )

        m.decode(rids, pick)

    @precondition(lambda self: self.m.live)
    @rule(data=st.data())
    def sparse_decode_rows(self, data):
        """Decode-shaped resolve whose rows select fewer than TOPK (more padding),
        in any lane order, without appending."""
        m = self.m
        rids = data.draw(
            st.lists(
                st.sampled_from(sorted(m.live)),
                min_size=1,
                max_size=min(MAX_REQ, len(m.live)),
                unique=True,
            ),
            label="requests",
        )
        for layer in range(NUM_LAYERS):
            sel = []
            for rid in rids:
                ids = m.live[rid]
                chosen = data.draw(
                    st.lists(st.sampled_from(ids), max_size=min(TOPK, len(ids)), unique=True)
                )
                row = chosen + [-1] * (TOPK - len(chosen))
                sel.append(data.draw(st.permutations(row)))
            m.resolve(layer, sel)

    @precondition(lambda self: self.m.live)
    @rule(data=st.data())
    def prefill_resolve(self, data):
        m = self.m
        rid = data.draw(st.sampled_from(sorted(m.live)), label="request")
        ids = m.live[rid]
        q = data.draw(st.integers(1, m.kv.max_resolve_queries(TOPK)), label="Q")
        for layer in range(NUM_LAYERS):
            sel = []
            for _ in range(q):
                chosen = data.draw(
                    st.lists(
                        st.sampled_from(ids), min_size=1, max_size=min(TOPK, len(ids)), unique=True
                    )
                )
                row = chosen + [-1] * (TOPK - len(chosen))
                sel.append(data.draw(st.permutations(row)))
            m.resolve(layer, sel)

    @precondition(lambda self: self.m.live and self.m.alloc.num_free >= 2)
    @rule(data=st.data())
    def verify_round(self, data):
        """A speculative verify (Q lanes of one request on its row: Q x TOPK <= N_G), a
        rejected tail written again by the next one."""
        m = self.m
        rid = data.draw(st.sampled_from(sorted(m.live)), label="request")
        held = m.tail.get(rid, 0)
        q = data.draw(st.integers(max(2, held), min(MAX_REQ, held + m.alloc.num_free)), label="Q")

        def pick(ids: list[int], layer: int) -> list[int]:
            k = min(TOPK, len(ids))
            return data.draw(
                st.lists(st.sampled_from(ids), min_size=k, max_size=k, unique=True),
                label=f"lane top-k layer {layer}",
            )

        m.verify(rid, q, pick, data.draw(st.integers(0, q - 1), label="accepted drafts"))

    @precondition(lambda self: self.m.live)
    @rule(data=st.data())
    def finish_request(self, data):
        self.m.finish(data.draw(st.sampled_from(sorted(self.m.live)), label="request"))

    @invariant()
    def structure_holds(self):
        self.m.check_invariants()

    def teardown(self):
        if not self.m.broken:
            self.m.release_all_and_check()


class SmallHostMachine(EchoMachine):
    """Host pool barely bigger than the device cache: host ids are reused constantly and
    the allocator runs near empty."""

    n_h = 20


class NoReserveAppendMachine(EchoMachine):
    """Reserve 0 and decode tokens appended to device slots (the earlier configuration)."""

    reserve = 0
    decode_writes = False


class HostWritesMachine(EchoMachine):
    """Decode tokens written to the host only (SGLANG_ECHO_DECODE_PLACE=0)."""

    decode_place = False


class LargeReserveMachine(EchoMachine):
    """A quarter of the cache freed ahead by every evicting step."""

    reserve = N_G // 4


FAST = settings(
    max_examples=100,
    stateful_step_count=50,
    derandomize=True,
    database=None,
    deadline=None,
    report_multiple_bugs=False,
    suppress_health_check=[HealthCheck.too_slow],
)
SLOW = settings(
    max_examples=500,
    stateful_step_count=100,
    deadline=None,
    database=None,
    report_multiple_bugs=False,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_echo_invariants_stateful():
    run_state_machine_as_test(EchoMachine, settings=FAST)


def test_echo_invariants_small_host_stateful():
    run_state_machine_as_test(SmallHostMachine, settings=FAST)


def test_the_machines_run_the_default_configuration():
    m = EchoModel()
    assert m.reserve == EchoConfig(offload=True, dev_cache_size=N_G).eviction_reserve >= 1
    assert m.decode_writes and m.decode_place


@pytest.mark.parametrize(
    "machine",
    [NoReserveAppendMachine, LargeReserveMachine, HostWritesMachine],
    ids=["reserve0-append", "reserve3", "host-writes"],
)
def test_echo_invariants_variants_stateful(machine):
    run_state_machine_as_test(machine, settings=FAST)


@pytest.mark.slow
@pytest.mark.parametrize(
    "machine",
    [EchoMachine, SmallHostMachine, NoReserveAppendMachine, LargeReserveMachine],
    ids=["n_h64", "n_h20", "reserve0-append", "reserve3"],
)
def test_echo_invariants_stateful_heavy(machine):
    run_state_machine_as_test(machine, settings=SLOW)


@pytest.mark.parametrize(
    "seed", [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)]
)
def test_long_random_run_then_release_all_frees_everything(seed):
    """A long plain random run (no shrinking, many more steps than the stateful runs),
    checked after every step; releasing every live request then empties the cache."""
    rng = random.Random(seed)
    m = EchoModel()  # the default reserve and decode-mode writes

    def pick(ids: list[int], layer: int) -> list[int]:
        return rng.sample(ids, min(TOPK, len(ids)))

    for _ in range(1500):
        op = rng.random()
        if (not m.live or op < 0.15) and m.alloc.num_free >= 1:
            m.start(rng.randint(1, min(MAX_PREFILL, m.alloc.num_free)))
        elif m.live and op < 0.7 and m.alloc.num_free >= 1:
            most = min(MAX_REQ, len(m.live), m.alloc.num_free)
            m.decode(rng.sample(sorted(m.live), rng.randint(1, most)), pick)
        elif m.live and op < 0.85:
            ids = m.live[rng.choice(sorted(m.live))]
            q = rng.randint(1, m.kv.max_resolve_queries(TOPK))
            for layer in range(NUM_LAYERS):
                sel = []
                for _ in range(q):
                    row = rng.sample(ids, rng.randint(1, min(TOPK, len(ids))))
                    row += [-1] * (TOPK - len(row))
                    rng.shuffle(row)
                    sel.append(row)
                m.resolve(layer, sel)
        elif m.live:
            m.finish(rng.choice(sorted(m.live)))
        m.check_invariants()
    assert m.c.evictions.sum() > 0 and m.c.append_evictions.sum() > 0  # pressure was real
    m.release_all_and_check()
