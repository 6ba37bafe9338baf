"""Retraction on a PD decode node with ECHO, on sglang's real pool, allocator and
retraction functions (``backup_kv_cache``, ``restore_kv_cache``,
``discard_kv_cache_backup``, hooked by the plugin: sglang_echo/sglang/retraction.py). The
plugin declares ``disaggregation_decode_retraction_backup="none"``; a retracted PD request
keeps its host ids instead (its KV is all in the host pool, the newest row's token backed
up first), is queued as retracted (no 503), and resumes with the same host ids, reading
byte-exact rows; an abort while retracted, a release without a backup and a locally
prefilled request release everything, as before. sglang's resume path itself
(``resume_retracted_reqs`` -> ``_pre_alloc``) runs in test_decode_prealloc.py."""

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

from sglang_echo.sglang.args import RETRACTION_BACKUP  # noqa: E402
from sglang_echo.sglang.retraction import kept_of  # noqa: E402


def node() -> DecodeNode:
    return DecodeNode(
        layers=2, top_k=16, dev_cache=64, max_running=4, host_tokens=1536, max_context=256
    )


def run(n: DecodeNode, rids: list[str], steps: int, topk_for) -> None:
    for _ in range(steps):
        check_tables(n, rids, n.step(rids, padded_bs=4, topk_for=topk_for))


@pytest.mark.parametrize("steps_before", [0, 4])
def test_a_retracted_pd_request_keeps_its_host_ids_and_resumes(steps_before):
    """0 steps: its whole KV arrived in the host pool; 4: its newest row is backed up."""
    n = node()
    topk_for = selections(n, random.Random(11))
    rids = [n.arrive(90), n.arrive(60), n.arrive(120)]
    run(n, rids, steps_before, topk_for)
    retracted = rids.pop(1)
    token = n.running[retracted]
    idx = token.req.kv.req_pool_idx
    before = n.counters()
    assert n.retract(retracted, RETRACTION_BACKUP) is True  # queued as retracted: no 503
    kept = kept_of(token.req)
    assert kept.tokens == token.seq_len, "every token with KV is kept"
    host_ids = kept.row[: kept.tokens]
    assert torch.all(host_ids >= 0) and host_ids.unique().numel() == kept.tokens
    for layer in range(n.layers):  # the newest row's token reached the host too
        assert torch.equal(n.host_rows(layer)[host_ids], token.rows[: kept.tokens, layer])
    after = n.counters()
    pages = -(-(token.seq_len) // 64) - -(-(token.seq_len - 1) // 64)
    assert after["host"] == before["host"] - (steps_before > 0) * 64 * pages  # kept, not freed
    assert after["device_rows"] == before["device_rows"] + 64  # its newest page is free
    assert int(n.coord.ring_rows[idx].abs().sum()) == 0
    run(n, rids, 3, topk_for)  # the others decode on
    host_free = n.coord.mem_pool_host.available_size()
    n.resume(retracted)
    new_idx = token.req.kv.req_pool_idx
    assert n.coord.mem_pool_host.available_size() == host_free, "no host slot taken anew"
    assert torch.equal(n.coord.req_to_host_pool[new_idx, : kept.tokens], host_ids)
    assert int(n.coord.ring_rows[new_idx, 0]) > 0
    rids.append(retracted)
    run(n, rids, 4, topk_for)  # byte-exact rows, its old tokens included
    for rid in rids:
        n.finish(rid)
    assert_back_to_start(n)


def test_an_abort_while_retracted_releases_everything():
    n = node()
    topk_for = selections(n, random.Random(3))
    rids = [n.arrive(70), n.arrive(130)]
    run(n, rids, 2, topk_for)
    assert n.retract(rids[0], RETRACTION_BACKUP) is True
    n.discard(rids[0])
    run(n, rids[1:], 2, topk_for)
    n.finish(rids[1])
    assert_back_to_start(n)


def test_a_release_without_backup_releases_the_host_ids():
    """release_req without a backup (sglang's offload_kv=False): the kept row no backup
    claimed is released when the scope closes."""
    n = node()
    topk_for = selections(n, random.Random(5))
    rids = [n.arrive(70), n.arrive(40)]
    run(n, rids, 2, topk_for)
    assert n.retract(rids[0], RETRACTION_BACKUP, backs_up=False) is False
    run(n, rids[1:], 2, topk_for)
    n.finish(rids[1])
    assert_back_to_start(n)


def test_a_locally_prefilled_request_is_not_kept():
    """Staged from a local prefill: not a PD arrival, sglang's path (no backup, abort)."""
    n = DecodeNode(
        layers=2, top_k=16, dev_cache=64, max_running=4, host_tokens=1536, max_context=256,
        prefill_rows=256,
    )  # fmt: skip
    rid = n.prefill(50)
    host = n.coord.mem_pool_host.available_size()
    assert n.retract(rid, RETRACTION_BACKUP) is False
    assert n.coord.mem_pool_host.available_size() > host
    assert_back_to_start(n)
