"""Retraction on a PD decode node with ECHO, on sglang's real pool, allocator and
retraction backup (``backup_kv_cache``). The plugin declares
``disaggregation_decode_retraction_backup="none"``: a retracted request keeps no KV copy
(sglang aborts it with 503 for the client to resubmit), its host and device rows are
freed, and the requests still running keep byte-exact rows. sglang's inferred default for
this pool ("cpu_tensor") would crash the scheduler instead, which the test also shows."""

from __future__ import annotations

import random

import plugin_testenv  # first: sets the process up before sglang loads
import pytest

plugin_testenv.require_sglang()

from sglang_world import DecodeNode, apply_cpu_shims, init_process_group  # noqa: E402
from test_coordinator import assert_back_to_start, check_tables, selections  # noqa: E402

from sglang_echo.sglang.args import RETRACTION_BACKUP  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def cpu_machine(tmp_path_factory):
    apply_cpu_shims()
    init_process_group(str(tmp_path_factory.mktemp("pg")))


def node() -> DecodeNode:
    return DecodeNode(
        layers=2, top_k=16, dev_cache=64, max_running=4, host_tokens=1536, max_context=256
    )


def test_retraction_with_the_declared_backup_frees_and_continues():
    n = node()
    rng = random.Random(11)
    topk_for = selections(n, rng)
    rids = [n.arrive(90), n.arrive(60), n.arrive(120)]
    for _ in range(4):
        check_tables(n, rids, n.step(rids, padded_bs=4, topk_for=topk_for))
    retracted = rids.pop(1)
    idx = n.running[retracted].req.kv.req_pool_idx
    host_before = n.coord.mem_pool_host.available_size()
    assert n.retract(retracted, RETRACTION_BACKUP) is False  # sglang aborts it: 503, retry
    assert n.coord.mem_pool_host.available_size() > host_before  # its host KV is freed
    assert int(n.coord.newest_row[idx]) == 0
    assert int(n.coord.req_to_host_pool_allocated_len[idx]) == 0
    # The resubmitted request arrives again (new host ids, some the freed ones).
    rids.append(n.arrive(62))
    for _ in range(4):
        check_tables(n, rids, n.step(rids, padded_bs=4, topk_for=topk_for))
    for rid in rids:
        n.finish(rid)
    assert_back_to_start(n)


def test_sglangs_default_backup_would_crash():
    """Without the declaration sglang infers "cpu_tensor" for this pool: the copy is not
    implemented by the DSA pool, and the scheduler would die on the first retraction."""
    n = node()
    rid = n.arrive(70)
    with pytest.raises(NotImplementedError):
        n.retract(rid, "cpu_tensor")
    assert_back_to_start(n)
