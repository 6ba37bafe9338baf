"""sglang's own Triton write path (HiSparseDSATokenToKVPool.set_mla_kv_buffer, run by the
Triton interpreter) feeds the rows that ECHO later recalls: a staged prefill on a
non-disaggregated server and decode steps, bf16 and fp8 rows."""

from __future__ import annotations

import os
import random

import plugin_testenv  # first: sets the process up before sglang loads
import pytest

plugin_testenv.require_sglang()

from sglang_world import DecodeNode, apply_cpu_shims, init_process_group  # noqa: E402
from test_coordinator import assert_back_to_start, check_tables, selections  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def cpu_machine(tmp_path_factory):
    assert os.environ.get("TRITON_INTERPRET") == "1"
    apply_cpu_shims()
    init_process_group(str(tmp_path_factory.mktemp("pg")))
    from sglang.srt.runtime_context import get_parallel

    # The DSA pool reads the decode-context-parallel layout when writing.
    get_parallel().override_permanently(attn_dcp_size=1, attn_dcp_rank=0)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_sglang_writes_what_echo_recalls(fp8):
    node = DecodeNode(
        layers=2, top_k=16, dev_cache=64, max_running=2, host_tokens=1024,
        max_context=160, write="sglang", fp8=fp8, seed=5, prefill_rows=160,
    )  # fmt: skip
    assert node.pool.kv_buffer[0].shape[-1] == (656 if fp8 else 576)  # DSA row layouts
    rng = random.Random(5)
    topk_for = selections(node, rng)
    rids = [node.prefill(70), node.arrive(40)]  # staged (local prefill) and PD direct
    for _ in range(6):
        tables = node.step(rids, padded_bs=3, topk_for=topk_for)
        check_tables(node, rids, tables)
    assert min(node.coord.echo_telemetry()["misses"]) > 0
    for rid in rids:
        node.finish(rid)
    assert_back_to_start(node)
