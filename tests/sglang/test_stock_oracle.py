"""ECHO against its oracle inside sglang, step by step: sglang's stock HiSparseCoordinator.

Two decode nodes built from sglang 0.5.23's real pools (sglang_world.DecodeNode) live the
same scripted PD-decode life: the same arrivals with the same prompt bytes, the same
decode steps (padded as a CUDA-graph replay pads), the same selections, finishes and a
reused request slot. One resolves with ECHO's coordinator (its shared device cache, under
eviction at the legal minimum N_G = running x top-k), the other with sglang's stock
coordinator and its own per-request reference swap-in (``naive_load_topk``; only the
sgl_kernel byte copies are stood in). At every step and layer, the top-k's inputs (each
request's sequence length and its page table of logical ids, what the indexer reads) and
the bytes behind every entry of the two row tables must be equal.
"""

from __future__ import annotations

import random

import plugin_testenv  # first: sets the process up before sglang loads
import pytest
import torch

plugin_testenv.require_sglang()

from sglang_world import (  # noqa: E402
    DecodeNode,
    assert_coordinator_clean,
    cpu_machine,  # noqa: F401 (autouse)
)

TOP_K, LAYERS, RUNNING = 64, 2, 3
# Prompt lengths: under the stock per-request buffer (its short path), crossing it during
# decode, and long (every selection a host load on the stock side).
PROMPTS = {"short": 30, "crossing": 52, "long": 420}
LATER = 260  # arrives into the request slot the short request frees


def same_selections(seed: int):
    """Selections that depend only on (step, layer, request, length): both nodes see the
    same. Exactly min(length, top-k) distinct positions, the newest often among them."""

    def topk_for(step: int):
        def pick(layer: int, rid: str, seq_len: int) -> torch.Tensor:
            rng = random.Random(f"{seed}/{step}/{layer}/{rid}/{seq_len}")
            k = min(seq_len, TOP_K)
            picked = {seq_len - 1} if rng.random() < 0.7 else set()
            picked |= set(rng.sample(range(max(0, seq_len - 8), seq_len), min(seq_len, 3)))
            while len(picked) < k:
                picked.add(rng.randrange(seq_len))
            return torch.tensor(sorted(picked)[:k], dtype=torch.int32)

        return pick

    return topk_for


def indexer_inputs(node: DecodeNode, rids: list[str]) -> list[int]:
    """Each request's length; its page table must name that many distinct logical ids,
    which is all the indexer reads besides the keys written at them."""
    lengths = []
    for rid in rids:
        token = node.running[rid]
        row = node.req_to_token.req_to_token[token.req.kv.req_pool_idx, : token.seq_len]
        assert torch.all(row > 0) and row.unique().numel() == token.seq_len, rid
        lengths.append(token.seq_len)
    return lengths


def assert_same_rows(echo: DecodeNode, stock: DecodeNode, rids, echo_tables, stock_tables):
    for layer in range(LAYERS):
        topk_e, table_e = echo_tables[layer]
        topk_s, table_s = stock_tables[layer]
        bs = len(rids)
        assert torch.equal(topk_e[:bs], topk_s[:bs])
        rows_e, rows_s = echo.layer_rows(layer), stock.layer_rows(layer)
        for i, rid in enumerate(rids):
            lanes = topk_e[i] >= 0
            assert torch.all(table_e[i][~lanes] == -1) and torch.all(table_s[i][~lanes] == -1)
            got_e = rows_e[table_e[i][lanes].long()].view(torch.uint8)
            got_s = rows_s[table_s[i][lanes].long()].view(torch.uint8)
            assert torch.equal(got_e, got_s), f"{rid} layer {layer}: ECHO's rows differ"
            want = echo.running[rid].rows[topk_e[i][lanes].long(), layer].view(torch.uint8)
            assert torch.equal(got_s, want), f"{rid} layer {layer}: the oracle's rows differ"


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_echo_rows_equal_stock_hisparse_rows(fp8):
    shape = dict(
        layers=LAYERS, top_k=TOP_K, dev_cache=RUNNING * TOP_K, max_running=RUNNING,
        host_tokens=4096, max_context=1024, fp8=fp8, seed=11,
    )  # fmt: skip
    echo, stock = DecodeNode(**shape), DecodeNode(**shape, stock=True)
    select = same_selections(seed=3)
    step = 0

    def run(rids: list[str], steps: int) -> None:
        nonlocal step
        for _ in range(steps):
            tables = [node.step(rids, RUNNING + 1, topk_for=select(step)) for node in (echo, stock)]
            assert indexer_inputs(echo, rids) == indexer_inputs(stock, rids)
            assert_same_rows(echo, stock, rids, *tables)
            step += 1

    names = {}
    for name, length in PROMPTS.items():
        names[name] = echo.arrive(length)
        assert stock.arrive(length) == names[name]
    run(list(names.values()), 16)
    assert int(echo.coord.cache.evictions.sum()) > 0, "the life must evict in ECHO's cache"
    for node in (echo, stock):
        node.finish(names["short"])
    names["later"] = echo.arrive(LATER)
    assert stock.arrive(LATER) == names["later"]
    run([names[n] for n in ("crossing", "long", "later")], 16)
    for rid in [names[n] for n in ("crossing", "long", "later")]:
        echo.finish(rid)
        stock.finish(rid)
    assert echo.counters() == echo.after_init and stock.counters() == stock.after_init
    assert_coordinator_clean(echo.coord, echo.allocator)
