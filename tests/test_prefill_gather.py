"""Prefill gathers under ECHO: the whole-chunk resolve, the per-block distinct resolve and
the per-piece fallback all copy out exactly the rows that the no-offload pool holds, at
every cache size from the legal minimum (pieces) to one that takes the whole chunk."""

from __future__ import annotations

import pytest
import torch

from sglang_echo.config import EchoConfig
from sglang_echo.model.attention import gather_selected, resolve_chunk
from sglang_echo.model.kv_cache import PlainKVCache
from sglang_echo.offload.echo_cache import EchoKVCache

TOKENS, ROW, TOPK, QUERIES = 96, 8, 16, 20


def _filled_pair(slots: int) -> tuple[PlainKVCache, EchoKVCache]:
    gen = torch.Generator().manual_seed(slots)
    plain = PlainKVCache(1, TOKENS, ROW, 4, torch.float32, "cpu")
    echo = EchoKVCache(
        EchoConfig(offload=True, dev_cache_size=slots), 1, TOKENS, ROW, 4, torch.float32, "cpu"
    )
    locs = torch.arange(1, TOKENS + 1)
    rows = torch.randn(TOKENS, ROW, generator=gen)
    keys = torch.randn(TOKENS, 4, generator=gen)
    for s in range(0, TOKENS, slots):  # appends, like prefill chunks, fit the cache
        for cache in (plain, echo):
            cache.write(0, locs[s : s + slots], rows[s : s + slots], keys[s : s + slots])
    return plain, echo


def _selection(distinct: int, seed: int) -> torch.Tensor:
    """[QUERIES, TOPK] locations drawn from ``distinct`` of them, with -1 padding rows."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randperm(TOKENS, generator=gen)[:distinct] + 1
    pick = torch.randint(0, distinct, (QUERIES, TOPK), generator=gen)
    selected = pool[pick]
    selected[3, 5:] = -1  # a short query: padding
    return selected


def _expected(plain: PlainKVCache, selected: torch.Tensor) -> torch.Tensor:
    buffer, rows = plain.resolve(0, selected)
    return torch.where((selected >= 0).unsqueeze(-1), buffer[rows.clamp(min=0)], 0.0)


@pytest.mark.parametrize("slots", [TOPK, 2 * TOPK, 64, TOKENS + 1, QUERIES * TOPK])
@pytest.mark.parametrize("distinct", [10, 40, 96])
def test_prefill_gathers_match_no_offload(slots: int, distinct: int) -> None:
    plain, echo = _filled_pair(slots)
    selected = _selection(distinct, seed=slots * 1000 + distinct)
    expected = _expected(plain, selected)
    valid = (selected >= 0).unsqueeze(-1)

    whole = resolve_chunk(echo, 0, selected)
    fits = slots >= QUERIES * TOPK or distinct <= (slots // TOPK) * TOPK
    assert (whole is not None) == fits
    if whole is not None:
        buffer, rows = whole
        assert torch.equal(torch.where(valid, buffer[rows], 0.0), expected)

    out = torch.empty(QUERIES, TOPK, ROW)
    got_valid = gather_selected(echo, 0, selected, out)
    assert torch.equal(got_valid, selected >= 0)
    assert torch.equal(torch.where(valid, out, 0.0), expected)
    if slots < TOKENS:  # appends evicted rows: some really came back from the host pool
        assert echo.telemetry()["misses"][0] > 0
