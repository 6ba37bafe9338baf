"""The plugin's decode prefetch (SGLANG_NSA_FUSE_LOGITS_RECALL_DECODE=1) on sglang's real
pools, allocator and host pool (CPU): staged from the indexer's logits around sglang's
own top-k, through the AROUND hook on ``Indexer._get_topk_paged``. With the switch on, a
PD-decode life under eviction returns the same top-k and the same row tables as with it
off, every row holds its token's bytes, and staged rows were really used."""

from __future__ import annotations

import random
from types import SimpleNamespace

import plugin_testenv  # first: sets the process up before sglang loads
import pytest
import torch

plugin_testenv.require_sglang()

from sglang_world import (  # noqa: E402
    DecodeNode,
    cpu_machine,  # noqa: F401 (autouse: CPU shims, process group)
)
from test_coordinator import check_tables  # noqa: E402

from sglang_echo.config import ENV_FUSE_DECODE, reset_settings  # noqa: E402
from sglang_echo.sglang import decode_prefetch  # noqa: E402

LAYERS, TOP_K, MAX_RUNNING = 2, 16, 3


@pytest.fixture
def switch(monkeypatch):
    def apply(value: str) -> None:
        monkeypatch.setenv(ENV_FUSE_DECODE, value)
        reset_settings()

    yield apply
    monkeypatch.undo()
    reset_settings()
    decode_prefetch.uninstall_decode_prefetch()


class _Mode:
    def __init__(self, decode: bool) -> None:
        self.decode = decode

    def is_decode(self) -> bool:
        return self.decode


class _SglangMetadata:
    """Stands in for sglang's indexer metadata: its top-k cleans positions past each
    sequence (DeepGEMM leaves them unwritten) and pads short rows with -1."""

    def __init__(self, seq_lens: torch.Tensor) -> None:
        self.seq_lens = seq_lens
        self.calls = 0

    def topk_transform(self, logits: torch.Tensor, topk: int) -> torch.Tensor:
        self.calls += 1
        pos = torch.arange(logits.shape[1])
        clean = logits.masked_fill(pos[None, :] >= self.seq_lens[:, None], float("-inf"))
        values, idx = clean.topk(topk, dim=1)
        return torch.where(values == float("-inf"), -1, idx).to(torch.int32)


def _indexer_logits(node: DecodeNode, step: int, base: dict[int, torch.Tensor]):
    """``select`` for the world's step: per layer, logits of a stable per-request base
    (so most of a top-k repeats and thresholds can be learned) plus noise, garbage past
    each sequence and in padding rows; the top-k through the plugin's hook."""

    def select(layer: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor):
        gen = torch.Generator().manual_seed(1000 * step + layer)
        rows, width = req_pool_indices.shape[0], node.max_context
        logits = 50 * torch.rand(rows, width, generator=gen)  # garbage unless overwritten
        for i, idx in enumerate(req_pool_indices.tolist()):
            if i < int(node.coord.num_real_reqs) and idx in base:
                noise = 0.4 * torch.randn(width, generator=gen)
                logits[i] = torch.where(
                    torch.arange(width) < seq_lens[i], base[idx][layer] + noise, logits[i]
                )
        meta = _SglangMetadata(seq_lens)
        batch = SimpleNamespace(
            forward_mode=_Mode(True), req_pool_indices=req_pool_indices, seq_lens=seq_lens
        )

        def get_topk_paged(indexer, forward_batch, layer_id, q_fp8, weights, metadata):
            return metadata.topk_transform(logits.clone(), TOP_K)

        out = decode_prefetch.topk_with_decode_prefetch(
            get_topk_paged, None, batch, layer, None, None, meta
        )
        assert meta.calls == 1, "sglang's own top-k runs once, prefetch or not"
        return out

    return select


def _life(switch, value: str, seed: int):
    switch(value)
    node = DecodeNode(
        layers=LAYERS, top_k=TOP_K, dev_cache=3 * TOP_K + 8, max_running=MAX_RUNNING,
        host_tokens=4096, max_context=256, seed=seed,
    )  # fmt: skip
    rng = random.Random(seed)
    base: dict[int, torch.Tensor] = {}
    tables_seen = []
    for step in range(40):
        while len(node.running) < node.max_running and rng.random() < 0.5:
            rid = node.arrive(rng.randint(40, 150))
            idx = node.running[rid].req.kv.req_pool_idx
            gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
            base[idx] = 4 * torch.randn(LAYERS, node.max_context, generator=gen)
        rids = list(node.running)
        tables = node.step(rids, MAX_RUNNING + 1, select=_indexer_logits(node, step, base))
        check_tables(node, rids, tables)
        tables_seen.append(tables)
        for rid in rids:
            if rng.random() < 0.08:
                node.finish(rid)
    for rid in list(node.running):
        node.finish(rid)
    return node, tables_seen


def test_the_switch_on_stages_from_sglangs_logits_and_changes_no_row(switch):
    off, tables_off = _life(switch, "0", seed=5)
    assert off.coord.decode_prefetch is None and decode_prefetch._ACTIVE is None
    on, tables_on = _life(switch, "1", seed=5)
    assert on.coord.decode_prefetch is not None and on.coord.decode_prefetch.hook_applied
    for step_off, step_on in zip(tables_off, tables_on, strict=True):
        for (topk_a, table_a), (topk_b, table_b) in zip(step_off, step_on, strict=True):
            assert torch.equal(topk_a, topk_b), "the exact top-k is sglang's, unchanged"
            assert torch.equal(table_a, table_b), "the same rows, prefetch or not"
    m_on, m_off = on.coord.manager, off.coord.manager
    assert int(m_on.cache.evictions.sum()) > 0, "under real cache pressure"
    assert int(m_on.prefetched_rows.sum()) > 0, "rows were staged"
    assert int(m_on.prefetch_hits.sum()) > 0, "staged rows served misses"
    assert int(m_off.prefetched_rows.sum()) == 0 and int(m_off.prefetch_hits.sum()) == 0
    # The same misses either way: staging allocates nothing and moves no cache state.
    assert torch.equal(m_on.cache.misses, m_off.cache.misses)
    assert torch.equal(m_on.cache.evictions, m_off.cache.evictions)


def test_a_steps_tables_are_built_once_and_follow_the_batch(switch):
    """The host-id rows are gathered at a forward's first layer and reused by its later
    layers; the next forward (its layer ids start again) gathers the new batch's rows."""
    switch("1")
    node = DecodeNode(layers=LAYERS, top_k=TOP_K, dev_cache=3 * TOP_K + 8,
                      max_running=MAX_RUNNING, host_tokens=4096, max_context=256)  # fmt: skip
    prefetch = node.coord.decode_prefetch
    a, b = (node.running[node.arrive(n)].req.kv.req_pool_idx for n in (40, 60))
    node.coord.num_real_reqs.fill_(2)
    logits = torch.zeros(2, node.max_context)

    def tables(layer, slots, lens):
        idx, seq = torch.tensor(slots), torch.tensor(lens)
        return prefetch._step_tables(layer, 2, logits, idx, seq)

    first = tables(0, [a, b], [41, 61])
    assert tables(1, [a, b], [41, 61]) is first, "a step's later layers reuse its tables"
    rows, locs, visible = tables(0, [b, a], [61, 41])  # the next forward
    assert rows.tolist() == [b, a] and visible.tolist() == [60, 40]
    assert torch.equal(locs[0, :60], node.coord.req_to_host_pool[b, :60])


def test_auto_runs_as_off_in_the_plugin(switch):
    node, _ = _life(switch, "auto", seed=6)
    assert node.coord.decode_prefetch is None
    assert int(node.coord.manager.prefetched_rows.sum()) == 0


def test_the_hook_targets_sglangs_paged_top_k():
    from sglang.srt.layers.attention.dsa.dsa_indexer import Indexer

    module, _, name = decode_prefetch.INDEXER_TARGET.rpartition(".")
    assert module.endswith("dsa_indexer.Indexer") and callable(getattr(Indexer, name))


def test_prefill_and_unprefetched_batches_pass_the_metadata_through():
    seen = []

    def original(indexer, forward_batch, layer_id, q_fp8, weights, metadata):
        seen.append(metadata)
        return "result"

    meta = object()
    batch = SimpleNamespace(forward_mode=_Mode(False))
    decode_prefetch._ACTIVE = object()  # a prefetching coordinator: prefill still passes
    try:
        assert (
            decode_prefetch.topk_with_decode_prefetch(original, None, batch, 0, None, None, meta)
            == "result"
        )
    finally:
        decode_prefetch.uninstall_decode_prefetch()
    decode = SimpleNamespace(forward_mode=_Mode(True))
    decode_prefetch.topk_with_decode_prefetch(original, None, decode, 0, None, None, meta)
    assert seen == [meta, meta]
