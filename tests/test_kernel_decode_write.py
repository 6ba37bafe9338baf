"""The decode write (kernels/decode_write.py): a decode step's new rows go to the host pool
and, while the free stack lasts, into device slots, in one launch; the kernel is
bit-identical to its torch reference (maps, stack, rows) whether the stack has room for
all, some or none of the rows, for resident ids (rewritten in place) and for the padding
sink. Runs under TRITON_INTERPRET=1 on CPU (tests/conftest.py), natively on CUDA."""

from __future__ import annotations

import random

import pytest
import torch

from sglang_echo.kernels.alloc import allocate_reference
from sglang_echo.kernels.decode_write import (
    WRITE_LANES,
    decode_write_kernel,
    decode_write_reference,
)
from sglang_echo.offload.device_cache import ABSENT, FREE, DeviceCache

DEV = "cuda" if torch.cuda.is_available() else "cpu"
STATE = ("host_to_device", "device_to_host", "priority", "free_stack", "free_count", "rows")
SLOTS, HOST = 40, 200


def _cache(seed: int, dtype: torch.dtype, width: int, drain_to: int) -> DeviceCache:
    """A cache after random resolves (scattered stack), then appends until ``drain_to``
    free slots are left."""
    rng = random.Random(seed)
    c = DeviceCache(1, SLOTS, HOST, width, dtype, DEV)
    for _ in range(3):
        ids = torch.tensor(rng.sample(range(1, HOST - 40), 12), device=DEV)
        allocate_reference(c, 0, ids, append=False)
    left = int(c.free_count[0])
    if left > drain_to:
        fill = torch.tensor(rng.sample(range(HOST - 40, HOST + 1), left - drain_to), device=DEV)
        allocate_reference(c, 0, fill, append=True)
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        c.rows.copy_(torch.randn(c.rows.shape, generator=g).to(DEV, dtype))
    else:
        c.rows.copy_(torch.randint(0, 256, c.rows.shape, generator=g).to(DEV, dtype))
    return c


def _args(c: DeviceCache, host: torch.Tensor, rows: torch.Tensor, locs: torch.Tensor):
    return c, 0, locs, rows, host, c.rows[0]


def _rows(n: int, dtype: torch.dtype, width: int) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(n, width, device=DEV).to(dtype)
    return torch.randint(0, 256, (n, width), device=DEV).to(dtype)


@pytest.mark.parametrize(
    "dtype,width", [(torch.uint8, 656), (torch.bfloat16, 576), (torch.float32, 6), (torch.uint8, 7)]
)
@pytest.mark.parametrize("free", [0, 3, 40])
def test_kernel_equals_reference(dtype: torch.dtype, width: int, free: int) -> None:
    n = WRITE_LANES + 5  # two trips of the kernel's loop
    a = _cache(1, dtype, width, free)
    b = _cache(1, dtype, width, free)
    free_before = int(a.free_count[0])
    g = torch.Generator().manual_seed(free)
    resident = a.device_to_host[0, 1 : SLOTS + 1]
    resident = resident[resident > 0][:2].to(torch.int64)
    fresh = torch.randperm(HOST - 60, generator=g)[: n - 3].to(DEV) + 1
    fresh = fresh[(a.host_to_device[0, fresh] == ABSENT)][: n - 3 - resident.numel()]
    locs = torch.cat(
        (fresh[:4], torch.zeros(1, dtype=torch.int64, device=DEV), resident, fresh[4:])
    )
    rows = _rows(locs.numel(), dtype, width)
    hosts = [torch.zeros(HOST + 2, width, dtype=dtype, device=DEV) for _ in range(2)]
    decode_write_kernel(*_args(a, hosts[0], rows, locs))
    decode_write_reference(*_args(b, hosts[1], rows, locs))
    for name in STATE:
        got, want = getattr(a, name), getattr(b, name)
        if name == "rows":  # the scratch slot takes the reference's unplaced lanes
            got, want = got[:, : SLOTS + 1], want[:, : SLOTS + 1]
        assert torch.equal(got, want), f"{name} differs (free {free})"
    assert torch.equal(hosts[0], hosts[1])
    assert torch.equal(hosts[0][locs], rows), "every row reaches the host, the sink's too"
    # What was placed: the first min(new, free) fresh ids in lane order, stamped now.
    new = [int(x) for x in locs if int(x) > 0 and int(x) not in resident.tolist()]
    placed = new[:free_before]
    for i, h in enumerate(int(x) for x in locs):
        slot = int(a.host_to_device[0, h]) if h > 0 else None
        if h in placed:
            assert slot != ABSENT and int(a.device_to_host[0, slot]) == h
            assert int(a.priority[0, slot]) == int(a.clock[0])
        elif h in new:
            assert slot == ABSENT, "no free slot left: host only"
        if slot is not None and slot != ABSENT:
            assert torch.equal(a.rows[0, slot], rows[i]), "a resident id's row is rewritten"
    assert int(a.free_count[0]) == free_before - len(placed)
    assert int(a.device_to_host[0, 0]) == 0 and int(a.host_to_device[0, 0]) == 0


def test_maps_stay_inverse_and_the_stack_counts_every_slot() -> None:
    c = _cache(2, torch.float32, 6, 10)
    host = torch.zeros(HOST + 2, 6, device=DEV)
    locs = torch.arange(150, 150 + 14, device=DEV)
    decode_write_kernel(*_args(c, host, _rows(14, torch.float32, 6), locs))
    d2h = c.device_to_host[0, 1 : SLOTS + 1]
    used = int((d2h >= 1).sum())
    assert used + int(c.free_count[0]) == SLOTS
    slots = torch.nonzero(d2h >= 1).squeeze(1) + 1
    assert torch.equal(c.host_to_device[0, d2h[slots - 1].long()].long(), slots)
    free = c.free_stack[0, : int(c.free_count[0])].long()
    assert bool((c.device_to_host[0, free] == FREE).all())
