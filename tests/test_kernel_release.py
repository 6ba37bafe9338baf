"""The batched release (kernels/release.py): one launch frees every layer of any number of
finished requests, bit-identical to its torch reference and to the per-layer release it
replaced; the sink and duplicated ids are refused, never pushed. Runs under
TRITON_INTERPRET=1 on CPU (tests/conftest.py), natively on CUDA."""

from __future__ import annotations

import random

import pytest
import torch

from benchmark.kernels.release_bench import per_layer_release  # the release it replaced
from sglang_echo.kernels.alloc import allocate_reference
from sglang_echo.kernels.release import RELEASE_BLOCK, release_kernel, release_reference
from sglang_echo.offload.device_cache import ABSENT, DeviceCache
from sglang_echo.offload.host_pool import HostKVPool
from sglang_echo.offload.manager import EchoManager

DEV = "cuda" if torch.cuda.is_available() else "cpu"
STATE = ("host_to_device", "device_to_host", "priority", "free_stack", "free_count")


def _filled_pair(seed: int, layers: int = 3, slots: int = 48, host: int = 300):
    """Two equal caches after random resolves (so slots are scattered over the stack)."""
    rng = random.Random(seed)
    caches = [DeviceCache(layers, slots, host, 4, torch.float32, DEV) for _ in range(2)]
    for _ in range(6):
        for layer in range(layers):
            ids = torch.tensor(rng.sample(range(1, host + 1), slots // 2), device=DEV)
            for c in caches:
                allocate_reference(c, layer, ids, append=False)
    return caches


def _assert_same(a: DeviceCache, b: DeviceCache, what: str) -> None:
    for name in STATE:
        assert torch.equal(getattr(a, name), getattr(b, name)), f"{what}: {name} differs"


@pytest.mark.parametrize("seed", range(4))
def test_kernel_and_reference_match_the_per_layer_release(seed: int) -> None:
    rng = random.Random(100 + seed)
    ref, ker = _filled_pair(seed)
    oracle, _ = _filled_pair(seed)
    # Resident and absent ids mixed, longer than a block so the carry across blocks counts.
    ids = torch.tensor(rng.sample(range(1, 301), 300), device=DEV)
    errors_ref = torch.zeros(1, dtype=torch.int64, device=DEV)
    errors_ker = torch.zeros_like(errors_ref)
    release_reference(ref, ids, errors_ref)
    release_kernel(ker, ids, errors_ker)
    per_layer_release(oracle, ids)
    _assert_same(ref, oracle, "reference vs per-layer")
    _assert_same(ker, oracle, "kernel vs per-layer")
    assert errors_ref.item() == errors_ker.item() == 0
    assert ref.free_count.tolist() == [48] * 3


def test_kernel_carries_the_stack_top_across_blocks() -> None:
    slots = RELEASE_BLOCK + 40
    ref, ker = (DeviceCache(2, slots, 3 * slots, 4, torch.float32, DEV) for _ in range(2))
    ids = torch.arange(1, slots + 1, device=DEV)
    for c in (ref, ker):
        for layer in range(2):
            allocate_reference(c, layer, ids.flip(0), append=True)
    errors = torch.zeros(1, dtype=torch.int64, device=DEV)
    release_reference(ref, ids, errors)
    release_kernel(ker, ids, errors)
    _assert_same(ref, ker, "two blocks")
    assert ker.free_count.tolist() == [slots, slots]


@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_sink_and_duplicates_are_refused_on_the_device(impl: str) -> None:
    """Ids that reach the device unchecked: the sink keeps slot 0, a duplicated resident id
    pushes its slot once, and each refused lane is counted in every layer."""
    (c,) = _filled_pair(7)[:1]
    resident = [h for h in range(1, 301) if int(c.host_to_device[0, h]) != ABSENT]
    dup = resident[0]
    ids = torch.tensor([dup, 0, dup, resident[1]], device=DEV)
    errors = torch.zeros(1, dtype=torch.int64, device=DEV)
    free_before = c.free_count.clone()
    (release_kernel if impl == "kernel" else release_reference)(c, ids, errors)
    layers = c.num_layers
    assert int(c.host_to_device[0, 0]) == 0 and int(c.device_to_host[0, 0]) == 0
    for layer in range(layers):
        n = int(c.free_count[layer])
        stack = c.free_stack[layer, :n].tolist()
        assert len(stack) == len(set(stack)), f"layer {layer}: a slot was pushed twice"
        assert n - int(free_before[layer]) <= 2  # at most the two distinct ids' slots
    # Layer 0: both ids resident -> 2 pushes, and 1 refused duplicate; the sink in 3 layers.
    assert int(c.free_count[0]) - int(free_before[0]) == 2
    assert errors.item() >= layers + 1


def _manager(slots: int = 16, host: int = 64) -> EchoManager:
    pool = HostKVPool(2, host, 4, torch.float32, pin=False)
    return EchoManager(pool, DeviceCache(2, slots, host, 4, torch.float32, "cpu"))


@pytest.mark.parametrize(
    ("ids", "needle"),
    [([3, 0, 4], "padding sink"), ([5, 6, 5], "more than once"), ([1, 65], "host id 65")],
)
def test_manager_refuses_bad_ids_before_touching_the_cache(ids, needle) -> None:
    m = _manager()
    allocate_reference(m.cache, 0, torch.tensor([3, 4, 5, 6]), append=True)
    before = {name: getattr(m.cache, name).clone() for name in STATE}
    with pytest.raises(ValueError, match=needle):
        m.release(torch.tensor(ids))
    for name in STATE:
        assert torch.equal(before[name], getattr(m.cache, name)), f"{name} changed"
    m.release(torch.tensor([3, 4, 5, 6]))  # the check's scratch is clean afterwards
    assert m.cache.free_count.tolist() == [16, 16]


def test_manager_releases_many_requests_at_once() -> None:
    m = _manager()
    for layer in range(2):
        allocate_reference(m.cache, layer, torch.arange(1, 13), append=True)
    m.release(torch.cat((torch.arange(1, 7), torch.arange(7, 13))))
    assert m.cache.free_count.tolist() == [16, 16]
    assert bool((m.cache.host_to_device[:, 1:65] == ABSENT).all())
    assert m.release_errors.item() == 0
