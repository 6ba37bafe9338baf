"""runtime.host_ints: the fast list -> int64 tensor path equals torch.tensor."""

import pytest
import torch

from sglang_echo.runtime.host_ints import int64_tensor


@pytest.mark.parametrize("values", [[], [0], [3, -1, 2**62, -(2**63)], list(range(100_000, 0, -7))])
def test_equals_torch_tensor(values):
    out = int64_tensor(values)
    assert out.dtype == torch.int64 and torch.equal(out, torch.tensor(values, dtype=torch.int64))


def test_outlives_its_buffer_and_moves_to_the_device():
    out = int64_tensor([5, 6, 7], "cpu")
    del_me = int64_tensor([1] * 1000)
    del del_me
    assert out.tolist() == [5, 6, 7] and out.device.type == "cpu"


@pytest.mark.parametrize(("values", "error"), [([2**63], OverflowError), ([1.5], TypeError)])
def test_bad_values_raise_as_torch_would_refuse(values, error):
    with pytest.raises(error):
        int64_tensor(values)


def test_location_runs_cover_the_locations_in_order():
    from sglang_echo.runtime.host_ints import location_runs

    locs = torch.tensor([7, 8, 9, 3, 4, 20, 21, 22, 23, 5], dtype=torch.int64)
    runs = location_runs(locs)
    assert runs == [(7, 0, 3), (3, 3, 2), (20, 5, 4), (5, 9, 1)]
    rebuilt = torch.cat([torch.arange(f, f + n) for f, _, n in runs])
    assert torch.equal(rebuilt, locs) and location_runs(locs[:0]) == []


def test_host_pool_runs_write_the_bytes_index_copy_writes():
    from sglang_echo.offload.host_pool import HostKVPool
    from sglang_echo.runtime.host_ints import location_runs

    g = torch.Generator().manual_seed(0)
    locs = torch.tensor([5, 6, 7, 1, 2, 30, 31], dtype=torch.int64)
    rows = torch.randn(7, 6, generator=g).to(torch.bfloat16)
    by_runs, by_index = (HostKVPool(2, 40, 6, torch.bfloat16, pin=False) for _ in range(2))
    by_runs.write_runs(1, location_runs(locs), rows)
    by_index.rows[1].index_copy_(0, locs, rows)
    assert torch.equal(by_runs.rows, by_index.rows)
