"""The plugin's GPU harness (benchmark/plugin_gpu_harness.py) at test size: sglang's
decode choreography over sglang 0.5.23's real pool, allocator and host-pool classes with
the EchoCoordinator, against the same loop over sglang's plain DSA pool.

On the CPU (CI): eager steps, ECHO's torch reference, sglang's Triton write kernels under
the interpreter. On a GPU (the device's test stage, with sglang's modules from the pack
that ECHO_SGLANG_PACK names): the Triton kernels, decode CUDA graphs at padded batch
sizes, the forward / schedule / backup streams. Either way greedy tokens and logits must
be bit-identical under eviction, and a corrupted table must be caught."""

from __future__ import annotations

import plugin_testenv  # first: sets the process up before sglang loads
import pytest
import torch

plugin_testenv.require_sglang()

from benchmark.harness.decode_loop import HarnessConfig  # noqa: E402
from benchmark.plugin_gpu_harness import run_config  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TINY = dict(layers=2, top_k=32, dev_cache=64, max_running=2, max_prompt=96, max_context=160,
            vocab=128, requests=4, min_new=4, max_new=14, graph_sizes=(1, 2))  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def machine(tmp_path_factory):
    import torch.distributed as dist
    from sglang.srt.runtime_context import get_parallel

    if DEVICE == "cpu":
        from benchmark.harness.kv_sides import cpu_shims

        cpu_shims()
    if not dist.is_initialized():
        pg = tmp_path_factory.mktemp("pg")
        dist.init_process_group("gloo", init_method=f"file://{pg}/pg", rank=0, world_size=1)
    get_parallel().override_permanently(attn_dcp_size=1, attn_dcp_rank=0)


@pytest.mark.parametrize(("fp8", "mode"), [(True, "pd"), (False, "local")],
                         ids=["fp8-pd", "bf16-local"])  # fmt: skip
def test_echo_loop_equals_the_plain_loop_under_eviction(fp8, mode):
    import torch.distributed as dist

    cfg = HarnessConfig(fp8=fp8, mode=mode, **TINY)
    result = run_config(f"{'fp8' if fp8 else 'bf16'}-{mode}", cfg, DEVICE, dist.group.WORLD)
    assert result["equal"], result["first_difference"]
    assert result["tokens_compared"] >= cfg.requests * cfg.min_new
    assert result["evictions_total"] > 0, "no cache pressure: the test would prove little"
    assert result["misses"] > 0
    assert result["release_errors"] == 0
    assert result["left_clean"], "a finished request left state in the coordinator or cache"
    assert result["steps"]["idle_steps"] > 0, "no IDLE step ran"
    assert result["requests_aborted"] > 0, "no request was aborted mid-decode"
    if DEVICE == "cuda":
        assert result["steps"]["graph_replays"] > 0
        launches = result["launches_per_layer_step"]
        assert launches and launches.get("_recall_flat_kernel") == 1, launches


def test_the_decode_prefetch_stages_through_the_indexer_hook_and_changes_nothing():
    """SGLANG_NSA_FUSE_LOGITS_RECALL_DECODE=1: the toy indexer's top-k goes through the
    plugin's hook (on the GPU: the side stream, the stage kernels and the recall's staged
    path inside the decode graphs); outputs stay bit-identical under eviction and staged
    rows serve misses."""
    import torch.distributed as dist

    from sglang_echo.sglang import decode_prefetch

    cfg = HarnessConfig(fp8=True, mode="pd", prefetch=True, **TINY)
    try:
        result = run_config("fp8-pd-prefetch", cfg, DEVICE, dist.group.WORLD)
    finally:
        decode_prefetch.uninstall_decode_prefetch()
    assert result["equal"], result["first_difference"]
    assert result["evictions_total"] > 0 and result["misses"] > 0
    assert result["decode_prefetch"] and result["prefetched_rows"] > 0
    assert 0 < result["prefetch_hits"] <= result["misses"]
    assert result["left_clean"] and result["release_errors"] == 0
    if DEVICE == "cuda":
        assert result["steps"]["graph_replays"] > 0


def test_a_wrong_row_in_the_table_is_caught(monkeypatch):
    """The comparison can fail: ECHO's table with two selections swapped in one layer
    (each row still a real row of the request) must change the logits."""
    import torch.distributed as dist

    from benchmark.harness.kv_sides import EchoSide

    original = EchoSide.table

    def swapped(self, layer, req_pool_indices, seq_lens, topk):
        table = original(self, layer, req_pool_indices, seq_lens, topk).clone()
        if layer == 1:  # slices, not an index list: the swap is captured in a graph
            table = torch.cat((table[:, 1:2], table[:, 0:1], table[:, 2:]), 1)
        return table

    monkeypatch.setattr(EchoSide, "table", swapped)
    cfg = HarnessConfig(**{**TINY, "requests": 1, "max_new": 6, "graph_sizes": (1,)})
    result = run_config("fp8-pd", cfg, DEVICE, dist.group.WORLD)
    assert not result["equal"]
