"""An arriving prompt's device rows (kernels/placed_rows.py): only the lanes its
reservation placed are written, from plain rows or a window into a bank; unplaced lanes
(the scratch slot) write nothing, so the scratch row and every other row keep their bytes;
the kernel equals its torch reference and a per-lane loop. Runs under TRITON_INTERPRET=1 on
CPU (tests/conftest.py), natively on CUDA."""

from __future__ import annotations

import pytest
import torch

from sglang_echo.kernels.placed_rows import (
    PLACED_LANES,
    write_placed_rows_kernel,
    write_placed_rows_reference,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SLOTS = 50
SCRATCH = SLOTS - 1


def _rows(n: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(n, width, generator=g).to(DEV, dtype)
    return torch.randint(0, 256, (n, width), generator=g).to(DEV, dtype)


def _slots(n: int, placed: int, seed: int) -> torch.Tensor:
    """``placed`` lanes get distinct slots (not the scratch), scattered over the lanes;
    the rest the scratch slot, as a reservation under pressure leaves them."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.full((n,), SCRATCH, dtype=torch.int64)
    lanes = torch.randperm(n, generator=g)[:placed]
    slots[lanes] = torch.randperm(SCRATCH, generator=g)[:placed]
    return slots.to(DEV)


def _expected(dst, slots, src, period, offset) -> torch.Tensor:
    out = dst.clone()
    for p, slot in enumerate(slots.tolist()):
        if slot != SCRATCH:
            out[slot] = src[(p + offset) % period]
    return out


@pytest.mark.parametrize(
    "dtype,width", [(torch.uint8, 656), (torch.bfloat16, 576), (torch.float32, 6), (torch.uint8, 7)]
)
@pytest.mark.parametrize("placed", [0, 5, 40])
@pytest.mark.parametrize("window", [False, True])
def test_only_placed_lanes_are_written(dtype, width, placed, window):
    n = 2 * PLACED_LANES + 7  # programs past the first, and a ragged last one
    if window:  # a bank of 11 rows, lane p reading row (p + 4) % 11
        src, period, offset = _rows(11, width, dtype, 1), 11, 4
    else:
        src, period, offset = _rows(n, width, dtype, 1), n, 0
    dst = _rows(SLOTS, width, dtype, 2)
    slots = _slots(n, placed, 3)
    want = _expected(dst, slots, src, period, offset)
    got_kernel, got_ref = dst.clone(), dst.clone()
    write_placed_rows_kernel(got_kernel, slots, src, SCRATCH, period, offset)
    write_placed_rows_reference(got_ref, slots, src, SCRATCH, period, offset)
    assert torch.equal(got_ref, want)
    assert torch.equal(got_kernel, want)
    assert torch.equal(got_kernel[SCRATCH], dst[SCRATCH])  # the scratch row is never written


def test_default_period_reads_plain_rows_in_lane_order():
    src, dst = _rows(9, 8, torch.float32, 4), _rows(SLOTS, 8, torch.float32, 5)
    slots = _slots(9, 9, 6)
    got = dst.clone()
    write_placed_rows_kernel(got, slots, src, SCRATCH)
    assert torch.equal(got[slots], src)


def test_empty_and_misshapen_inputs():
    dst = _rows(SLOTS, 8, torch.float32, 7)
    before = dst.clone()
    empty = torch.zeros(0, dtype=torch.int64, device=DEV)
    for write in (write_placed_rows_kernel, write_placed_rows_reference):
        write(dst, empty, _rows(0, 8, torch.float32, 8), SCRATCH)  # no lanes: nothing
        assert torch.equal(dst, before)
        with pytest.raises(ValueError, match="do not fit"):
            write(dst, _slots(3, 3, 9), _rows(3, 9, torch.float32, 10), SCRATCH)
        with pytest.raises(ValueError, match="do not fit"):
            write(dst, _slots(3, 3, 9), _rows(3, 8, torch.float64, 10), SCRATCH)
        with pytest.raises(ValueError, match="period of 5"):
            write(dst, _slots(3, 3, 9), _rows(3, 8, torch.float32, 10), SCRATCH, 5)
        with pytest.raises(ValueError, match=r"slots \[n\]"):
            write(dst, _slots(4, 4, 9).reshape(2, 2), _rows(4, 8, torch.float32, 10), SCRATCH)


@pytest.mark.parametrize("n", [10, 70])  # all placed; more lanes than free slots
def test_fill_prompt_kernel_equals_reference_under_pressure(n):
    """offload/echo_cache.py ``fill_prompt`` with its kernels on and off, from a window into
    a bank: the same maps and rows after reserve + fill + unpin, the scratch slot's
    included (neither writes it)."""
    from sglang_echo.config import EchoConfig
    from sglang_echo.model.periodic_rows import PeriodicRows
    from sglang_echo.offload.echo_cache import EchoKVCache

    layers, host, slots_n, width, index = 2, 200, 40, 8, 4
    config = EchoConfig(offload=True, dev_cache_size=slots_n, eviction_reserve=0)
    gen = torch.Generator().manual_seed(n)
    locs = (torch.randperm(host, generator=gen)[:n] + 1).to(DEV)
    banks = [torch.randn(13, width, generator=gen).to(DEV) for _ in range(layers)]
    keys = [torch.randn(n, index, generator=gen).to(DEV) for _ in range(layers)]
    states = []
    for use_kernels in (False, True):
        c = EchoKVCache(config, layers, host, width, index, torch.float32, DEV, use_kernels=use_kernels)  # fmt: skip
        reserved = c.reserve_prompt(locs)
        for layer in range(layers):
            rows = PeriodicRows(banks[layer], 5, n)
            c.fill_prompt(layer, locs, rows, keys[layer], reserved[layer])
        c.unpin_prompt(reserved)
        d = c.cache
        states.append(
            (d.host_to_device, d.device_to_host, d.priority, d.rows, c.host.rows, c.index)
        )
    for a, b in zip(*states, strict=True):
        assert torch.equal(a, b)
    rows, scratch = states[1][3], c.cache.scratch_slot
    assert rows.abs().sum() > 0 and not rows[:, scratch].any()  # written, scratch untouched
