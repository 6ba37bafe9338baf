"""Emulated arrival rows as a window into a bank (model/periodic_rows.py), and ECHO's fill
from that window (offload/echo_cache.py ``fill_prompt``): the copy-engine path must write
exactly the bytes the materialized rows would, in every layer, with runs that wrap around
the bank, a scatter, reserved slots, and fp8 storage."""

from __future__ import annotations

import pytest
import torch

from sglang_echo.config import EchoConfig
from sglang_echo.kernels.fp8_kv import fp8_row_bytes
from sglang_echo.model.periodic_rows import PeriodicRows
from sglang_echo.offload.echo_cache import EchoKVCache
from sglang_echo.offload.host_extents import split_extents


def test_window_rows_follow_the_bank_and_wrap():
    bank = torch.arange(7 * 3, dtype=torch.float32).view(7, 3)
    w = PeriodicRows(bank, offset=5, length=20)
    rows = w.materialize()
    assert rows.shape == (20, 3)
    for p in range(20):
        assert torch.equal(rows[p], bank[(5 + p) % 7])
    # every stretch is contiguous in the bank, in position order, and covers exactly once
    segs = w.segments(3, 12)
    assert sum(k for _, _, k in segs) == 12
    assert [s for _, s, _ in segs] == [sum(k for _, _, k in segs[:i]) for i in range(len(segs))]
    for first, skip, take in segs:
        assert first + take <= 7
        assert torch.equal(bank[first : first + take], rows[3 + skip : 3 + skip + take])
    assert w.segments(0, 0) == []


def test_window_refuses_bad_shapes():
    bank = torch.zeros(4, 2)
    with pytest.raises(ValueError, match="offset"):
        PeriodicRows(bank, offset=4, length=3)
    with pytest.raises(ValueError, match="bank must be"):
        PeriodicRows(torch.zeros(0, 2), offset=0, length=1)
    with pytest.raises(ValueError, match="outside"):
        PeriodicRows(bank, 1, 5).segments(3, 3)
    with pytest.raises(ValueError, match="period"):
        PeriodicRows(bank, 1, 5).with_bank(torch.zeros(5, 2))


LAYERS, HOST, SLOTS = 2, 600, 40


def _cache(fp8: bool) -> EchoKVCache:
    config = EchoConfig(offload=True, dev_cache_size=SLOTS)
    if fp8:  # rows of a 128-wide latent + 64 rope, stored as fp8 tiles + scales + bf16 rope
        return EchoKVCache(
            config, LAYERS, HOST, fp8_row_bytes(128, 64), 8, torch.uint8, "cpu", kv_lora_rank=128
        )
    return EchoKVCache(config, LAYERS, HOST, 24, 8, torch.float32, "cpu")


@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
def test_fill_from_a_window_equals_fill_from_its_rows(fp8):
    width = 192 if fp8 else 24
    gen = torch.Generator().manual_seed(1)
    host_locs = [*range(10, 250), *range(400, 420, 2), *range(450, 560), 3]
    n = len(host_locs)
    locs = torch.tensor(host_locs)
    banks = [torch.randn(37, width, generator=gen) for _ in range(LAYERS)]  # runs wrap often
    windows = [PeriodicRows(banks[layer], 11 + layer, n) for layer in range(LAYERS)]
    keys = [torch.randn(n, 8, generator=gen) for _ in range(LAYERS)]
    for extents in (split_extents(host_locs, min_tokens=16), None):
        by_rows, by_window = _cache(fp8), _cache(fp8)
        for c, source in ((by_rows, "rows"), (by_window, "window")):
            slots = c.reserve_prompt(locs)
            for layer in range(LAYERS):
                w = windows[layer]
                rows = w.materialize() if source == "rows" else w
                c.fill_prompt(layer, locs, rows, keys[layer], slots[layer], extents)
            c.unpin_prompt(slots)
        assert torch.equal(by_rows.host.rows, by_window.host.rows)
        assert torch.equal(
            by_rows.cache.rows[:, 1 : SLOTS + 1], by_window.cache.rows[:, 1 : SLOTS + 1]
        )
        assert torch.equal(by_rows.index, by_window.index)
        assert by_rows.host.rows[:, locs].abs().sum() > 0  # the rows really landed
