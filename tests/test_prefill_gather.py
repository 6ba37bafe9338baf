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


@pytest.mark.parametrize("cache_factor", [1, 3, 8])
def test_prefill_splits_chunks_into_ranges_that_fit_and_stays_lossless(
    small_checkpoint, monkeypatch, cache_factor: int
) -> None:
    """With blocks of 2 queries, a 24-token chunk is resolved whole, by halves, quarters...
    or block by block in pieces, depending on the cache size; output ids and every step's
    logits stay identical to no-offload, and the smaller caches really split."""
    from sglang_echo.model import attention
    from sglang_echo.model.loader import load_model
    from sglang_echo.runtime.engine import Engine
    from sglang_echo.runtime.kv_factory import echo_cache_for_model

    model = load_model(small_checkpoint, dtype=torch.float32)
    cfg = model.config
    monkeypatch.setattr(attention, "GATHER_BLOCK_ELEMENTS", 2 * cfg.index_topk * cfg.kv_row_dim)
    outcomes: list[tuple[int, bool]] = []
    original = attention.resolve_chunk

    def recording(kv_cache, layer_id, selected):
        result = original(kv_cache, layer_id, selected)
        if isinstance(kv_cache, EchoKVCache):
            outcomes.append((selected.shape[0], result is not None))
        return result

    monkeypatch.setattr(attention, "resolve_chunk", recording)
    gen = torch.Generator().manual_seed(cache_factor)
    prompts = [torch.randint(3, 259, (n,), generator=gen).tolist() for n in (70, 45)]
    capacity, chunk, new_tokens = sum(len(p) for p in prompts) + 16, 24, 6
    slots = max(2 * cfg.index_topk, chunk) * cache_factor
    runs = {}
    for name, cache in {
        "plain": PlainKVCache.for_model(cfg, capacity, torch.float32, "cpu"),
        "echo": echo_cache_for_model(
            EchoConfig(offload=True, dev_cache_size=slots), cfg, capacity, torch.float32, "cpu"
        ),
    }.items():
        engine = Engine(model, cache, capacity, 2, 90, chunk, ignore_eos=True)
        runs[name] = engine.generate(prompts, new_tokens, record_logits=True)
    for a, b in zip(runs["plain"], runs["echo"], strict=True):
        assert a.output == b.output
        for x, y in zip(a.step_logits, b.step_logits, strict=True):
            assert torch.equal(x, y)
    assert any(n == chunk for n, _ in outcomes)  # whole chunks were tried
    if cache_factor == 1:  # the legal minimum: whole chunks do not fit, smaller ranges do
        assert any(n == chunk and not ok for n, ok in outcomes)
        assert any(n < chunk and ok for n, ok in outcomes)
