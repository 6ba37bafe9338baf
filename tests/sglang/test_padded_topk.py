"""Top-k tables with more rows than requests, and with none, through sglang 0.5.23's own
padding (``DeepseekSparseAttnBackend._pad_topk_indices``, which the DSA decode path runs
before the coordinator): an eager batch whose q rows exceed its requests gets -1 rows
appended; an IDLE batch (a DP-attention rank with nothing to run) has zero rows. The
requests' rows must stay exact, the padding rows must select nothing, and bs = 1 must
not broadcast its request over the padding."""

from __future__ import annotations

import random

import plugin_testenv  # first: sets the process up before sglang loads
import pytest
import torch

plugin_testenv.require_sglang()

from sglang_world import (  # noqa: E402
    DecodeNode,
    cpu_machine,  # noqa: F401 (autouse: CPU shims, process group)
)
from test_coordinator import assert_back_to_start, check_tables, selections  # noqa: E402


def sglang_pad(topk: torch.Tensor, num_q_rows: int) -> torch.Tensor:
    from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnBackend

    # The method reads only its arguments; no backend (and no GPU) is needed for it.
    return DeepseekSparseAttnBackend._pad_topk_indices(None, topk, num_q_rows)


def eager_step(node: DecodeNode, rids: list[str], extra_rows: int, topk_for):
    """A decode step whose backend pads the top-k to ``len(rids) + extra_rows`` q rows."""
    padded = node.step(rids, padded_bs=len(rids), topk_for=topk_for)
    coord = node.coord
    reqs = [node.running[r].req for r in rids]
    idx = torch.tensor([r.kv.req_pool_idx for r in reqs], dtype=torch.int64)
    seq = torch.tensor([node.running[r].seq_len for r in rids], dtype=torch.int64)
    tables = []
    for layer, (topk, _) in enumerate(padded):
        q_rows = sglang_pad(topk, len(rids) + extra_rows)
        assert q_rows.shape[0] == len(rids) + extra_rows
        table = coord.swap_in_selected_pages(idx, seq, q_rows, layer)
        assert table.shape == q_rows.shape
        assert torch.all(table[len(rids) :] == -1), "padding rows must select nothing"
        tables.append((topk, table[: len(rids)].clone()))
    return tables


@pytest.mark.parametrize("num_reqs", [1, 3])
def test_padded_q_rows(num_reqs):
    node = DecodeNode(layers=2, top_k=16, dev_cache=64, max_running=4, host_tokens=1536,
                      max_context=256, seed=num_reqs)  # fmt: skip
    topk_for = selections(node, random.Random(num_reqs))
    rids = [node.arrive(30 + 40 * i) for i in range(num_reqs)]
    for step in range(4):
        tables = eager_step(node, rids, extra_rows=1 + step % 2, topk_for=topk_for)
        check_tables(node, rids, tables)
    for rid in rids:
        node.finish(rid)
    assert_back_to_start(node)


def test_padding_past_the_static_table():
    """An eager batch padded past the coordinator's static table still resolves."""
    node = DecodeNode(layers=1, top_k=16, dev_cache=64, max_running=2, host_tokens=1024,
                      max_context=128)  # fmt: skip
    rid = node.arrive(50)
    rows = node.coord.top_k_device_locs_buffer.shape[0] + 3
    tables = eager_step(
        node, [rid], extra_rows=rows - 1, topk_for=selections(node, random.Random(0))
    )
    check_tables(node, [rid], tables)
    node.finish(rid)
    assert_back_to_start(node)


def test_idle_batch_has_zero_rows():
    node = DecodeNode(layers=2, top_k=16, dev_cache=64, max_running=2, host_tokens=1024,
                      max_context=128)  # fmt: skip
    coord = node.coord
    before = coord.cache.priority.clone()
    coord.num_real_reqs.fill_(0)
    empty = torch.empty(0, dtype=torch.int64)
    topk = sglang_pad(torch.empty(0, 16, dtype=torch.int32), 0)
    for layer in range(2):
        table = coord.swap_in_selected_pages(empty, empty, topk, layer)
        assert table.shape == (0, 16)
    assert torch.equal(before, coord.cache.priority)
    assert node.counters() == node.after_init
