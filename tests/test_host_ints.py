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
