"""Cache-management kernels against their torch reference (kernels/alloc.py): the whole
layer state must be bit-identical after every append and resolve, including duplicated
ids, padding lanes, evictions from old log2 buckets and the sink. Runs under
TRITON_INTERPRET=1 on CPU (tests/conftest.py), natively on CUDA."""

from __future__ import annotations

import random

import pytest
import torch

from sglang_echo.kernels import alloc, alloc_common
from sglang_echo.kernels.alloc import (
    EXACT_AGES,
    AllocWorkspace,
    age_bucket,
    allocate_kernel,
    allocate_reference,
    victim_mask,
)
from sglang_echo.offload.device_cache import ABSENT, DeviceCache

DEV = "cuda" if torch.cuda.is_available() else "cpu"
STATE = (
    "host_to_device",
    "device_to_host",
    "priority",
    "free_stack",
    "free_count",
    "clock",
    "hits",
    "misses",
    "evictions",
    "append_evictions",
    "recalled_rows",
)


def _pair(num_slots: int, host_tokens: int, reserve: int = 0) -> tuple[DeviceCache, DeviceCache]:
    def make() -> DeviceCache:
        return DeviceCache(2, num_slots, host_tokens, 4, torch.float32, DEV, reserve)

    return make(), make()


def _assert_same(ref: DeviceCache, ker: DeviceCache, what: str) -> None:
    for name in STATE:
        a, b = getattr(ref, name), getattr(ker, name)
        assert torch.equal(a, b), f"{what}: {name} differs\nref {a}\nker {b}"


def _served(alloc, count_only: bool = False):
    n = int(alloc.miss_count.item())
    return alloc.miss_ids[:n].tolist(), alloc.miss_slots[:n].tolist()


@pytest.fixture(params=["forward", "reversed"])
def program_order(request, monkeypatch):
    """The interpreter runs a grid's programs one after another, in order; a GPU runs them
    at once. Running them in reverse too exposes programs that read what another program
    of the same launch writes (a torn read of a slot being filled once broke the state)."""
    if request.param == "reversed":
        if DEV != "cpu":
            pytest.skip("program order is the hardware's on a GPU")
        from triton.runtime import interpreter

        builder = interpreter.interpreter_builder
        original = type(builder).set_grid_idx

        def reversed_idx(self, x, y, z):
            original(self, self.grid_dim[0] - 1 - x, y, z)

        monkeypatch.setattr(type(builder), "set_grid_idx", reversed_idx)
    return request.param


# A workspace's launch shape is kernels/alloc_common.py's module constants, read when it is made:
# small blocks (many programs per launch on small caches) set them first.
SMALL_BLOCKS = {
    "LANE_BLOCK": 16,
    "SLOT_BLOCK": 16,
    "NUM_WARPS": 1,
    "ONE_PROGRAM_BLOCK": 32,
    "LOOKBACK_LANE_BLOCK": 16,
    "LOOKBACK_WARPS": 1,
}


def _shape(monkeypatch, **constants) -> None:
    """kernels/alloc_common.py's launch constants for the workspaces made after this call."""
    for name, value in constants.items():
        assert hasattr(alloc_common, name), name
        monkeypatch.setattr(alloc_common, name, value)


# The launch paths of allocate_kernel: past the one program (a resolve's look-back launches,
# an append's five-launch pipeline) and the one-program kernel (small batches); each must
# leave the reference's state.
PATHS = {"lookback": 0, "one-program": 1 << 20}  # ONE_PROGRAM_LANES


@pytest.fixture(params=sorted(PATHS))
def path(request, monkeypatch) -> str:
    _shape(monkeypatch, ONE_PROGRAM_LANES=PATHS[request.param])
    return request.param


@pytest.mark.parametrize(
    ("seed", "shape"),
    [
        (0, {}),
        # More seeds of the default launch shape (the same compiled variants): -m slow.
        pytest.param(1, {}, marks=pytest.mark.slow),
        pytest.param(2, {}, marks=pytest.mark.slow),
        (3, SMALL_BLOCKS),
    ],
    ids=["seed0", "seed1", "seed2", "seed3-16-lane-16-slot-blocks"],
)
@pytest.mark.parametrize("reserve", [0, 5], ids=["no-reserve", "reserve-5"])
def test_kernels_match_reference_over_a_random_life(
    seed: int, program_order: str, shape: dict, reserve: int, path: str, monkeypatch
) -> None:
    """Any launch shape (many programs per launch with small blocks) leaves the state the
    reference leaves, with and without an eviction reserve."""
    rng = random.Random(seed)
    num_slots, host_tokens = 40, 200
    ref, ker = _pair(num_slots, host_tokens, reserve)
    _shape(monkeypatch, **shape)
    ws = AllocWorkspace(ker, max_lanes=num_slots)
    live: list[int] = []
    next_id = 1
    for step in range(60):
        layer = rng.randrange(2)
        if rng.random() < 0.4 or len(live) < 8:
            # Append new tokens (host ids never seen resident).
            n = rng.randint(1, 6)
            ids = list(range(next_id, next_id + n))
            next_id = next_id + n if next_id + n < host_tokens - 8 else 1
            if any(i in live for i in ids):
                continue
            live += ids
            append = True
        else:
            n = rng.randint(1, num_slots)
            ids = [rng.choice(live) for _ in range(n)]  # duplicates on purpose
            ids = [i if rng.random() > 0.15 else -1 for i in ids]  # padding lanes
            if rng.random() < 0.1:
                ids[0] = 0  # the sink
            append = False
        t = torch.tensor(ids, dtype=torch.int64, device=DEV)
        a = allocate_reference(ref, layer, t, append)
        b = allocate_kernel(ker, layer, t, append, ws)
        what = f"seed {seed} step {step} {'append' if append else 'resolve'} {ids}"
        assert torch.equal(a.slots, b.slots), what
        assert _served(a) == _served(b), what
        _assert_same(ref, ker, what)
        # Every selected token is resident at the slot returned.
        h2d = ker.host_to_device[layer]
        for i, s in zip(ids, b.slots.tolist(), strict=True):
            assert (s == -1) if i < 0 else int(h2d[i]) == s != ABSENT
    assert int(ker.evictions.sum()) > 0, "no resolve evicted: the test lost its pressure"


def test_old_slots_share_log2_buckets_and_lowest_slot_goes_first() -> None:
    ages = torch.tensor([0, 1, EXACT_AGES - 1, EXACT_AGES, EXACT_AGES + 1, EXACT_AGES + 2, 10**9])
    buckets = age_bucket(ages).tolist()
    assert buckets[:4] == [0, 1, EXACT_AGES - 1, EXACT_AGES]
    assert buckets[4] == buckets[5] == EXACT_AGES + 1  # log2 buckets from here on
    assert EXACT_AGES + 1 < buckets[6] <= 255
    # Two victims needed: the oldest bucket (3) has one slot, the next (2) gives its lowest.
    bucket = torch.tensor([-1, 2, 3, 2, -1, 1])
    assert victim_mask(bucket, torch.tensor(2)).tolist() == [0, 1, 1, 0, 0, 0]
    assert victim_mask(bucket, torch.tensor(0)).tolist() == [0] * 6


def test_resolve_after_long_idle_uses_the_log_buckets(path: str) -> None:
    """Ages beyond the exact range: state still bit-identical (clock jumps are legal)."""
    ref, ker = _pair(8, 40)
    ws = AllocWorkspace(ker, max_lanes=8)
    for cache in (ref, ker):
        cache.clock[:] = 5000
    ids = torch.arange(1, 9, device=DEV)
    for cache, fn in ((ref, allocate_reference), (ker, None)):
        if fn:
            fn(cache, 0, ids, True)
        else:
            allocate_kernel(cache, 0, ids, True, ws)
    for cache in (ref, ker):
        # Spread the last-use stamps far apart, then ask for new tokens.
        cache.priority[0, 1:9] = torch.tensor([10, 4000, 4990, 300, 4999, 1, 2000, 4500])
    t = torch.tensor([20, 21, 22, 3], device=DEV)
    a = allocate_reference(ref, 0, t, False)
    b = allocate_kernel(ker, 0, t, False, ws)
    assert torch.equal(a.slots, b.slots)
    _assert_same(ref, ker, "log buckets")
    assert int(ker.evictions[0]) == 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="counts compiled GPU variants")
def test_lane_counts_of_any_size_reuse_one_compiled_variant(monkeypatch) -> None:
    """Prefill appends and resolves come in every size: a new lane count must not compile
    a new kernel variant mid-serving (once seconds per call, seen as 1.4 s decode stalls)."""
    from sglang_echo.kernels import alloc_lookback, alloc_one_program

    kernels = (alloc._lookup_kernel, alloc._count_kernel, alloc._rank_kernel)
    kernels += (alloc._assign_kernel, alloc._finish_kernel, alloc_one_program._one_program_kernel)
    kernels += (alloc_lookback._lookup_rank_kernel, alloc_lookback._map_misses_kernel)
    cache = DeviceCache(1, 4096, 1 << 16, 4, torch.float32, DEV)
    # Both paths: up to 1024 lanes one program, past it the pipeline and the look-back.
    _shape(monkeypatch, ONE_PROGRAM_LANES=1024)
    ws = AllocWorkspace(cache, max_lanes=cache.num_slots)
    device = torch.cuda.current_device()
    before = None
    for step, lanes in enumerate((1, 17, 1024, 1025, 3000, 4096, 2, 33)):
        ids = torch.randperm(1 << 16, device=DEV)[:lanes] + 1
        allocate_kernel(cache, 0, ids, append=step % 2 == 0, ws=ws)
        torch.cuda.synchronize()
        counts = [len(k.device_caches[device][0]) for k in kernels]
        if step == 4:  # both modes (append, resolve) of both paths compiled once
            before = counts
    assert counts == before, f"variants per kernel grew from {before} to {counts}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="chained launches need a GPU")
@pytest.mark.parametrize("pdl", [True, False], ids=["chained", "unchained"])
def test_graph_replayed_steps_match_the_reference(pdl: bool, path: str) -> None:
    """A decode step's append + resolve captured in a CUDA graph (chained launches, the
    default on sm_90, or not) and replayed on new ids each step leaves the reference's
    state after every replay, evictions and reserve included."""
    from sglang_echo.kernels.pdl import use_pdl

    if pdl and not use_pdl(torch.device(DEV)):
        pytest.skip("this GPU does not chain launches (below sm_90, or SGLANG_ECHO_PDL=0)")
    num_slots, batch, topk = 64, 3, 8
    ref, ker = _pair(num_slots, 4096, reserve=6)
    ws = AllocWorkspace(ker, max_lanes=num_slots, pdl=pdl)
    assert ws.pdl == pdl
    new_ids = torch.zeros(batch, dtype=torch.int64, device=DEV)
    selected = torch.zeros(batch * topk, dtype=torch.int64, device=DEV)
    rng = random.Random(7)
    live = list(range(1, 41))
    first = torch.tensor(live, dtype=torch.int64, device=DEV)
    allocate_reference(ref, 0, first, True)
    allocate_kernel(ker, 0, first, True, ws)

    def step() -> None:
        allocate_kernel(ker, 0, new_ids, True, ws)
        allocate_kernel(ker, 0, selected, False, ws)

    step_ids = iter(range(41, 4000))

    def load() -> tuple[torch.Tensor, torch.Tensor]:
        fresh = [next(step_ids) for _ in range(batch)]
        live.extend(fresh)
        pick = [rng.choice(live) if rng.random() > 0.1 else -1 for _ in range(batch * topk)]
        a = torch.tensor(fresh, dtype=torch.int64, device=DEV)
        b = torch.tensor(pick, dtype=torch.int64, device=DEV)
        new_ids.copy_(a)
        selected.copy_(b)
        return a, b

    # Warm-up (compiles) on a copy of the state, then capture from the same state.
    saved = {name: getattr(ker, name).clone() for name in STATE}
    load()
    step()
    torch.cuda.synchronize()
    for name, value in saved.items():
        getattr(ker, name).copy_(value)
    live[:] = live[:-batch]
    step_ids = iter(range(41, 4000))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for name, value in saved.items():  # capture ran nothing, but be exact about the start
        getattr(ker, name).copy_(value)
    for t in range(30):
        a, b = load()
        graph.replay()
        allocate_reference(ref, 0, a, True)
        allocate_reference(ref, 0, b, False)
        torch.cuda.synchronize()
        _assert_same(ref, ker, f"replay {t}")
    assert int(ker.evictions.sum()) > 0, "no replay evicted: the test lost its pressure"


def test_slots_are_scanned_only_when_misses_could_outnumber_free_slots(path: str) -> None:
    """Before the cache fills a step's misses fit the free slots: the count kernel leaves
    the age histogram empty (no slot scanned) and the state is still the reference's; once
    the misses exceed the free slots the histogram is built and victims are taken."""
    ref, ker = _pair(16, 100)
    ws = AllocWorkspace(ker, max_lanes=16)
    first = torch.arange(1, 11, dtype=torch.int64, device=DEV)  # 10 of 16 slots
    allocate_reference(ref, 0, first, True)
    allocate_kernel(ker, 0, first, True, ws)
    fits = torch.tensor([1, 2, 11, 12, 3], dtype=torch.int64, device=DEV)  # 2 misses, 6 free
    allocate_reference(ref, 0, fits, False)
    allocate_kernel(ker, 0, fits, False, ws)
    _assert_same(ref, ker, "misses fit the free slots")
    assert int(ws.hist.sum()) == 0 and int(ker.evictions[0]) == 0
    evicts = torch.arange(20, 30, dtype=torch.int64, device=DEV)  # 10 misses, 4 free
    allocate_reference(ref, 0, evicts, False)
    allocate_kernel(ker, 0, evicts, False, ws)
    _assert_same(ref, ker, "misses outnumber the free slots")
    assert int(ws.hist.sum()) > 0 and int(ker.evictions[0]) > 0
    assert int(ws.miss_bound) == 0  # zeroed for the next call


def test_an_eviction_takes_the_reserve_and_the_next_steps_scan_nothing(path: str) -> None:
    """With a reserve, a step that must evict also frees the reserve's oldest slots onto the
    free stack (unmapped), so the following steps' misses fit the free slots and no slot
    is scanned; the state stays the reference's throughout."""
    ref, ker = _pair(16, 100, reserve=4)
    ws = AllocWorkspace(ker, max_lanes=16)

    def both(ids: list[int], append: bool) -> None:
        t = torch.tensor(ids, dtype=torch.int64, device=DEV)
        allocate_reference(ref, 0, t, append)
        allocate_kernel(ker, 0, t, append, ws)
        _assert_same(ref, ker, f"{ids} {append}")

    both(list(range(1, 17)), True)  # the cache is full
    both([1, 2, 3, 20, 21], False)  # 2 misses: 2 victims + the reserve's 4
    assert int(ker.evictions[0]) == 6 and int(ker.free_count[0]) == 4
    h2d = ker.host_to_device[0]
    assert sum(int(h2d[i]) == ABSENT for i in range(4, 17)) == 6  # unmapped, not recalled
    both([1, 2, 30, 31], False)  # 2 misses fit the 4 free slots: no scan, no eviction
    assert int(ws.hist.sum()) == 0 and int(ker.evictions[0]) == 6
    assert int(ker.free_count[0]) == 2


def test_workspace_must_match_the_cache_reserve() -> None:
    _, ker = _pair(16, 100, reserve=4)
    ws = AllocWorkspace(_pair(16, 100)[1], max_lanes=16)
    with pytest.raises(ValueError, match="eviction reserve"):
        allocate_kernel(ker, 0, torch.tensor([1], device=DEV), True, ws)


def test_a_call_where_every_lane_hits_ends_after_the_look_up(path: str) -> None:
    """Every selection resident (the low-load case): the hits are stamped and answered, no
    miss is counted, nothing is scanned or allocated, and the state is the reference's."""
    ref, ker = _pair(16, 100, reserve=2)
    ws = AllocWorkspace(ker, max_lanes=16)
    first = torch.arange(1, 13, dtype=torch.int64, device=DEV)
    allocate_reference(ref, 0, first, True)
    allocate_kernel(ker, 0, first, True, ws)
    resident = torch.tensor([3, 1, 3, -1, 12, 7], dtype=torch.int64, device=DEV)  # a repeat
    a = allocate_reference(ref, 0, resident, False)
    b = allocate_kernel(ker, 0, resident, False, ws)
    assert torch.equal(a.slots, b.slots) and int(b.miss_count) == 0
    _assert_same(ref, ker, "all hits")
    assert int(ker.hits[0]) == 4 and int(ker.misses[0]) == 0  # distinct slots hit
    assert int(ws.hist.sum()) == 0 and int(ker.free_count[0]) == 16 - 12


@pytest.mark.parametrize("reserve", [0, 5], ids=["no-reserve", "reserve-5"])
@pytest.mark.parametrize("distinct", [False, True], ids=["exchange", "distinct"])
def test_one_block_resolves_match_the_reference(distinct: bool, reserve: int, monkeypatch) -> None:
    """Resolves that fit one block of the one-program kernel (a decode request): every
    lane resident, misses straight from the free stack, repeated misses and steps that
    evict (the general path from the claims made) all leave the reference's state, hit
    counter included, whether the caller promises distinct ids (plain stamps) or not.
    Calls of 17-40 lanes take the loop past the block (16-lane blocks: 32 lanes a step)."""
    rng = random.Random(11)
    num_slots, host_tokens = 40, 200
    ref, ker = _pair(num_slots, host_tokens, reserve)
    _shape(monkeypatch, LANE_BLOCK=16, ONE_PROGRAM_BLOCK=32, ONE_PROGRAM_LANES=1 << 20)
    ws = AllocWorkspace(ker, max_lanes=num_slots)
    live = list(range(1, 31))
    first = torch.tensor(live, dtype=torch.int64, device=DEV)
    allocate_reference(ref, 0, first, True)
    allocate_kernel(ker, 0, first, True, ws)
    cases = {"resident": 0, "from free slots": 0, "evicting": 0, "repeated misses": 0}
    next_id = 31
    for step in range(40):
        n = rng.randint(1, 40)
        fresh = rng.randint(0, min(n, 12)) if step % 4 else 0
        ids = rng.sample(live, n - fresh) + list(range(next_id, next_id + fresh))
        live += list(range(next_id, next_id + fresh))
        next_id += fresh
        if not distinct and fresh and rng.random() < 0.5:
            ids.append(next_id - 1)  # a repeated miss (a promise of distinct ids breaks)
            cases["repeated misses"] += 1
        rng.shuffle(ids)
        ids = [i if rng.random() > 0.1 else -1 for i in ids]  # padding lanes repeat -1
        t = torch.tensor(ids, dtype=torch.int64, device=DEV)
        free, evicted = int(ker.free_count[0]), int(ker.evictions[0])
        a = allocate_reference(ref, 0, t, False)
        b = allocate_kernel(ker, 0, t, False, ws, distinct=distinct)
        what = f"step {step} {ids}"
        assert torch.equal(a.slots, b.slots), what
        assert _served(a) == _served(b), what
        _assert_same(ref, ker, what)
        misses = int(b.miss_count)
        if int(ker.evictions[0]) > evicted:
            cases["evicting"] += 1
        elif misses:
            cases["from free slots"] += misses <= free
        else:
            cases["resident"] += 1
    assert all(cases[k] for k in ("resident", "from free slots", "evicting")), cases


@pytest.mark.parametrize("copies", [1, 3], ids=["one-block", "loop"])
def test_a_wrong_promise_of_distinct_ids_only_over_counts_hits(copies: int, monkeypatch) -> None:
    """A caller that promises distinct ids and repeats some (hits and misses) gets the
    reference's maps, stamps and miss counts: only the hit counter counts the repeats.
    Three copies of the lanes (24) pass a 16-lane block: the loop."""
    ref, ker = _pair(16, 100)
    _shape(monkeypatch, ONE_PROGRAM_BLOCK=16, ONE_PROGRAM_LANES=1 << 20)
    ws = AllocWorkspace(ker, max_lanes=32)
    first = torch.arange(1, 9, dtype=torch.int64, device=DEV)
    allocate_reference(ref, 0, first, True)
    allocate_kernel(ker, 0, first, True, ws)
    lanes = [3, 3, 20, 5, 20, 21, -1, 3] * copies
    repeats = torch.tensor(lanes, dtype=torch.int64, device=DEV)
    a = allocate_reference(ref, 0, repeats, False)
    b = allocate_kernel(ker, 0, repeats, False, ws, distinct=True)
    assert torch.equal(a.slots, b.slots) and _served(a) == _served(b)
    hit_lanes = sum(i in (3, 5) for i in lanes)
    assert int(ref.hits[0]) == 2 and int(ker.hits[0]) == hit_lanes  # slots 3 and 5
    ker.hits.copy_(ref.hits)
    _assert_same(ref, ker, "wrong promise")


def test_lookback_resolve_waits_on_many_tiles(monkeypatch) -> None:
    """The look-back resolve with hundreds of lane tiles (16-lane blocks, a workspace of
    4,096 lanes: 256-wide waits, the width a batch of 48 waits at), duplicates across
    tiles and evictions: the reference's state after every call. The launches recorded
    here are also the sm_90 compile check's, at that width."""
    ref, ker = _pair(64, 600, reserve=3)
    _shape(monkeypatch, LANE_BLOCK=16, LOOKBACK_LANE_BLOCK=16, LOOKBACK_WARPS=8)
    _shape(monkeypatch, ONE_PROGRAM_BLOCK=32, ONE_PROGRAM_LANES=0)
    ws = AllocWorkspace(ker, max_lanes=4096)
    assert ws.max_lane_programs_pow2 == ws.lookback_programs_pow2 == 256
    rng = random.Random(11)
    first = torch.arange(1, 65, dtype=torch.int64, device=DEV)
    allocate_reference(ref, 0, first, True)
    allocate_kernel(ker, 0, first, True, ws)
    for step in range(6):
        ids = [rng.randrange(1, 400) if rng.random() > 0.1 else -1 for _ in range(60)]
        t = torch.tensor(ids, dtype=torch.int64, device=DEV)
        a = allocate_reference(ref, 0, t, False)
        b = allocate_kernel(ker, 0, t, False, ws)
        assert torch.equal(a.slots, b.slots), step
        assert _served(a) == _served(b), step
        _assert_same(ref, ker, f"step {step}")
    assert int(ker.evictions[0]) > 0
    assert int(ws.tickets.abs().sum()) == 0 and int(ws.tile_words.abs().sum()) == 0


def test_lookback_resolve_serves_from_free_slots_across_tiles(monkeypatch) -> None:
    """A resolve past the one program on a cache with free slots (nothing evicted), its
    misses in several tiles: the launches after the first must see the free count of the
    call's start, not the one the last launch's program 0 writes while the others still
    read it (the interpreter runs program 0 first, so a read of the live count fails)."""
    ref, ker = _pair(40, 200)
    _shape(monkeypatch, LANE_BLOCK=16, LOOKBACK_LANE_BLOCK=16, LOOKBACK_WARPS=8)
    _shape(monkeypatch, ONE_PROGRAM_LANES=0)
    ws = AllocWorkspace(ker, max_lanes=64)
    ids = torch.arange(1, 33, dtype=torch.int64, device=DEV)  # 32 misses, 40 free slots
    a = allocate_reference(ref, 0, ids, False)
    b = allocate_kernel(ker, 0, ids, False, ws)
    assert torch.equal(a.slots, b.slots)
    _assert_same(ref, ker, "32 misses into 40 free slots")


@pytest.mark.parametrize("evict", [False, True], ids=["free-slots", "evicting"])
def test_lookback_resolve_ranks_tiles_before_and_after_the_first_repeat(
    program_order: str, evict: bool, monkeypatch
) -> None:
    """Tiles before the first repeated id rank their misses from the misses counts alone;
    from the first tile that saw a repeat on they count first misses. Here tiles 0-2
    repeat nothing, tile 3 repeats an id of tile 1 and tile 4 one of its own, in either
    program order (which of two lanes claims later, and so flags, flips with it)."""
    ref, ker = _pair(64 if evict else 120, 400, reserve=2)
    _shape(monkeypatch, LANE_BLOCK=16, LOOKBACK_LANE_BLOCK=16, LOOKBACK_WARPS=8)
    _shape(monkeypatch, ONE_PROGRAM_LANES=0)
    ws = AllocWorkspace(ker, max_lanes=80)
    if evict:  # a full cache: the 70-odd misses evict
        resident = torch.arange(300, 364, dtype=torch.int64, device=DEV)
        allocate_reference(ref, 0, resident, True)
        allocate_kernel(ker, 0, resident, True, ws)
    ids = list(range(1, 81))
    ids[50] = ids[20]  # tile 3 repeats a lane of tile 1
    ids[70] = ids[66]  # tile 4 repeats one of its own lanes
    ids[75] = -1  # padding
    t = torch.tensor(ids, dtype=torch.int64, device=DEV)
    a = allocate_reference(ref, 0, t, False)
    b = allocate_kernel(ker, 0, t, False, ws)
    assert torch.equal(a.slots, b.slots)
    assert _served(a) == _served(b)
    _assert_same(ref, ker, f"repeats in tiles 3 and 4 ({program_order})")
    assert (int(ker.evictions[0]) > 0) == evict
    assert int(ws.tickets.abs().sum()) == 0 and int(ws.tile_words.abs().sum()) == 0


def test_lookback_resolve_refuses_slot_tiles_its_words_cannot_count(monkeypatch) -> None:
    _, ker = _pair(16, 100)
    _shape(monkeypatch, SLOT_BLOCK=1 << 20, ONE_PROGRAM_LANES=0)
    ws = AllocWorkspace(ker, max_lanes=16)
    with pytest.raises(ValueError, match="slot_block must be below"):
        allocate_kernel(ker, 0, torch.tensor([1, 2], device=DEV), False, ws)
