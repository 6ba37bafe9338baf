"""The logical pool filled to its last page on a PD decode node (real pool, allocator,
host pool and sglang's PD pre-allocation): every token sglang can give a logical id must
also get a host slot. sglang sizes the host pool one page above the logical pool and
ECHO keeps two host pages, so the coordinator holds the logical pool's excess page;
without that, the last arrival's host allocation would raise."""

from __future__ import annotations

import random

import plugin_testenv  # first: sets the process up before sglang loads

plugin_testenv.require_sglang()

from sglang_world import (  # noqa: E402
    DecodeNode,
    cpu_machine,  # noqa: F401 (autouse: CPU shims, process group)
)
from test_coordinator import assert_back_to_start, check_tables, selections  # noqa: E402

PAGE = 64


def test_fill_the_logical_pool_to_its_last_token():
    node = DecodeNode(layers=2, top_k=16, dev_cache=64, max_running=4, host_tokens=1536,
                      max_context=512)  # fmt: skip
    logical = node.allocator.logical_attn_allocator
    host = node.coord.mem_pool_host
    usable = logical.available_size()
    assert usable == host.available_size()  # one host slot per logical id, no more
    assert usable % PAGE == 0 and usable >= 4 * PAGE
    # Four requests whose pages cover the logical pool, each two tokens short of its
    # last page's end.
    pages = usable // PAGE
    sizes = [pages // 4] * 3 + [pages - 3 * (pages // 4)]
    rids = [node.arrive(p * PAGE - 2) for p in sizes]
    assert logical.available_size() == 0  # every page is taken
    topk_for = selections(node, random.Random(5))
    for _ in range(2):  # two decode steps fill every last page
        check_tables(node, rids, node.step(rids, padded_bs=4, topk_for=topk_for))
    assert [node.running[r].seq_len for r in rids] == [p * PAGE for p in sizes]
    # Every logical token has its host slot (the newest one is still on the device).
    coord = node.coord
    for rid in rids:
        token = node.running[rid]
        idx = token.req.kv.req_pool_idx
        assert int((coord.req_to_host_pool[idx, : token.seq_len - 1] >= 0).sum()) == (
            token.seq_len - 1
        )
    for rid in rids:
        node.finish(rid)
    assert_back_to_start(node)
