"""The plugin's sglang-free parts: argument planning, the top-k -> rows translation over
borrowed buffers, the prefetch seam, and the entry point with ECHO off. Runs in both
environments (no sglang import)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from types import SimpleNamespace

import plugin_testenv  # noqa: F401  first: sets the process up before triton loads
import pytest
import torch

from sglang_echo.config import ENV_EVICTION_RESERVE, ConfigError, EchoConfig, reset_settings
from sglang_echo.kernels.topk_rows import RING
from sglang_echo.offload.device_cache import DeviceCache
from sglang_echo.offload.host_pool import HostKVPool
from sglang_echo.offload.manager import EchoManager
from sglang_echo.sglang.args import plan_echo
from sglang_echo.sglang.args_sizing import check_resolved
from sglang_echo.sglang.storage import (
    ExternalHostRows,
    ExternalRowsCache,
    LayerRows,
    device_layer_rows,
    eviction_reserve_for,
    host_layer_rows,
)
from sglang_echo.sglang.topk_resolve import TopkToRows


def view(**fields) -> SimpleNamespace:
    base = dict(
        max_total_tokens=1_000_000,
        max_running_requests=None,
        disaggregation_mode="decode",
        kv_cache_dtype="auto",
        dsa_decode_backend=None,
        page_size=None,
        hisparse_config=None,
        speculative_algorithm=None,
        pp_size=1,
        dp_size=1,
    )
    base.update(fields)
    return SimpleNamespace(**base)


def test_plan_sizes_pools_from_the_users_numbers():
    plan = plan_echo(view(), EchoConfig(dev_cache_size=10_000), top_k=2048, context_len=None)
    assert plan.max_running_requests == 4  # 10_000 // 2048
    assert plan.device_rows == 10_048 + 4 * 64  # ceil64(N_G + 1) + newest pages
    # sglang's host pool: S x R + 64 slots, two pages kept by ECHO -> T usable at least.
    assert plan.device_rows * plan.host_to_device_ratio - 64 >= 1_000_000
    assert plan.device_rows * (plan.host_to_device_ratio - 1) - 64 < 1_000_000
    tight = plan_echo(
        view(max_total_tokens=plan.device_rows * 4),
        EchoConfig(dev_cache_size=10_000),
        top_k=2048,
        context_len=None,
    )
    assert tight.host_to_device_ratio == 5  # S x 4 - 64 would be one page short
    config = json.loads(plan.hisparse_config())
    assert config["echo_dev_cache"] == 10_000 and config["top_k"] == 2048
    local = plan_echo(
        view(disaggregation_mode="null", max_running_requests=2),
        EchoConfig(dev_cache_size=10_000),
        top_k=2048,
        context_len=5000,
    )
    assert local.device_rows == 10_048 + 2 * 64 + 5056  # + one longest prompt
    # PD decode retraction keeps no KV copy (sglang's would crash on the DSA pool);
    # a local server's retraction re-prefills, so nothing is declared there.
    assert plan.declarations()["disaggregation_decode_retraction_backup"] == "none"
    assert "disaggregation_decode_retraction_backup" not in local.declarations()


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        (dict(speculative_algorithm="NEXTN"), "--speculative-algorithm NEXTN"),
        (dict(enable_mixed_chunk=True), "--enable-mixed-chunk"),
        (dict(disaggregation_mode="prefill"), "--disaggregation-mode prefill"),
        (dict(disaggregation_decode_enable_radix_cache=True), "radix-cache"),
        (dict(enable_hierarchical_cache=True), "--enable-hierarchical-cache"),
        (dict(enable_unified_memory=True), "--enable-unified-memory"),
        (dict(enable_kv_cache_sharding=True), "--enable-kv-cache-sharding"),
        (dict(dcp_size=2), "--dcp-size 2"),
        (dict(attn_cp_size=2), "--attention-context-parallel-size 2"),
        (
            dict(disaggregation_decode_retraction_backup="cpu_tensor"),
            "--disaggregation-decode-retraction-backup cpu_tensor",
        ),
        (dict(dp_size=2), "--dp-size 2 without --enable-dp-attention"),
        (dict(attn_dp_size=8, max_running_requests=40), "between 8 and 39"),
        (dict(attn_dp_size=8, max_running_requests=7), "7 // 8 ranks = 0 per rank"),
        (dict(page_size=1), "--page-size 1"),
        (dict(kv_cache_dtype="fp8_e4m3", dsa_decode_backend="flashmla_sparse"), "flashmla_kv"),
        (dict(dsa_decode_backend="trtllm"), "--dsa-decode-backend trtllm"),
        (dict(max_total_tokens=None), "--max-total-tokens is required"),
        (dict(disaggregation_mode="null"), "--context-length"),
        (dict(max_running_requests=5), "between 1 and 4"),
        (dict(max_running_requests=0), "between 1 and 4"),
    ],
)
def test_plan_rejects_with_the_flag_to_change(fields, needle):
    with pytest.raises(ConfigError) as info:
        plan_echo(view(**fields), EchoConfig(dev_cache_size=10_000), top_k=2048, context_len=None)
    assert needle in str(info.value)
    assert "NSA_KV_OFFLOAD=1" in str(info.value)


@pytest.mark.parametrize(
    "dp_fields",
    [dict(attn_dp_size=8), dict(dp_size=8, enable_dp_attention=True)],
    ids=["attn_dp_size", "deprecated_spelling"],
)
def test_plan_under_dp_attention_is_per_rank(dp_fields):
    """--tp 8 --dp 8 --enable-dp-attention: each rank runs max_running // 8 requests
    against its own N_G, and its own pools get the single-rank sizes."""
    config = EchoConfig(dev_cache_size=10_000)
    single = plan_echo(view(), config, top_k=2048, context_len=None)
    plan = plan_echo(view(**dp_fields), config, top_k=2048, context_len=None)
    assert plan.attn_dp_size == 8 and plan.per_rank_running == 4
    assert plan.max_running_requests == 32  # sglang divides it by attn_dp_size again
    assert plan.device_rows == single.device_rows == 10_048 + 4 * 64
    assert plan.host_to_device_ratio == single.host_to_device_ratio
    capped = plan_echo(
        view(**dp_fields, max_running_requests=19), config, top_k=2048, context_len=None
    )
    assert capped.per_rank_running == 2 and capped.max_running_requests == 16
    assert capped.device_rows == 10_048 + 2 * 64
    local = plan_echo(
        view(**dp_fields, disaggregation_mode="null"), config, top_k=2048, context_len=5000
    )
    assert local.device_rows == 10_048 + 4 * 64 + 5056  # one prompt per rank
    assert local.max_running_requests == 32


def test_plan_lists_every_problem_and_small_caches():
    with pytest.raises(ConfigError) as info:
        plan_echo(
            view(enable_mixed_chunk=True, pp_size=2),
            EchoConfig(dev_cache_size=10_000),
            top_k=2048,
            context_len=None,
        )
    assert "--enable-mixed-chunk" in str(info.value) and "--pp-size 2" in str(info.value)
    with pytest.raises(ConfigError, match="NSA_DEV_CACHE_SIZE >= 2048"):
        plan_echo(view(), EchoConfig(dev_cache_size=2000), top_k=2048, context_len=None)


def test_late_check_sees_changed_resolution():
    plan = plan_echo(view(), EchoConfig(dev_cache_size=10_000), top_k=2048, context_len=None)
    resolved = view(**plan.declarations())
    assert check_resolved(resolved, plan) == []
    changed = view(**{**plan.declarations(), "max_running_requests": 64})
    assert any("max_running_requests" in p for p in check_resolved(changed, plan))
    with_spec = view(**plan.declarations(), speculative_algorithm="EAGLE")
    assert any("--speculative-algorithm" in p for p in check_resolved(with_spec, plan))


# ---------------------------------------------------------------- storage + resolve
def borrowed_world(
    layers=2, slots=32, host_tokens=200, dim=8, row_base=63, pool_rows=256, use_kernels=False
):
    """A stand-in for SGLang's buffers: per-layer [rows, 1, D] device buffers and a
    [layers, N_H + 2, 1, D] host buffer."""
    gen = torch.Generator().manual_seed(0)
    device = [torch.zeros(pool_rows, 1, dim) for _ in range(layers)]
    host = torch.randn(layers, host_tokens + 2, 1, dim, generator=gen)
    cache = ExternalRowsCache(device_layer_rows(device, row_base, slots), host_tokens)
    manager = EchoManager(ExternalHostRows(host_layer_rows(host)), cache, use_kernels=use_kernels)
    return device, host, manager


def test_adapters_alias_the_borrowed_buffers():
    device, host, manager = borrowed_world()
    rows = manager.cache.rows
    assert isinstance(rows, LayerRows) and rows.shape == (2, 34, 8)
    assert rows[1].data_ptr() == device[1].view(256, 8)[63].data_ptr()
    owned = DeviceCache(2, 32, 200, 8, torch.float32, "cpu")
    assert manager.cache.nbytes == owned.nbytes - owned.rows.nbytes  # metadata only
    assert manager.host.view_for(torch.device("cpu")).data_ptr() == host.data_ptr()
    with pytest.raises(ValueError, match="do not fit"):
        device_layer_rows(device, 250, 32)
    with pytest.raises(ValueError, match="one MLA head"):
        host_layer_rows(torch.zeros(2, 10, 2, 8))
    with pytest.raises(ValueError, match="one dtype"):
        LayerRows([torch.zeros(4, 8), torch.zeros(4, 8, dtype=torch.float16)])


def test_topk_to_rows_over_borrowed_buffers():
    device, host, manager = borrowed_world()
    max_reqs, top_k = 5, 8
    req_to_host = torch.full((max_reqs, 64), -1, dtype=torch.int64)
    req_to_host[1, :20] = torch.arange(1, 21)  # request slot 1: host ids 1..20
    req_to_host[3, :30] = torch.arange(101, 131)
    ring = torch.zeros(max_reqs, RING, dtype=torch.int64)  # each request's ring page
    ring[1], ring[3] = 100 + torch.arange(RING), 164 + torch.arange(RING)
    ring_start = torch.tensor([0, 20, 0, 30, 0])  # both entered decode with this token
    out = torch.full((max_reqs, top_k), -7, dtype=torch.int32)
    resolve = TopkToRows(manager, 63, req_to_host, ring, ring_start, top_k, out)
    assert resolve.max_rows == 4

    idx = torch.tensor([1, 3, 0])  # the third row is padding (request 0)
    seq = torch.tensor([21, 31, 5])
    topk = torch.full((3, top_k), -1, dtype=torch.int32)
    topk[0, :4] = torch.tensor([0, 20, 7, 19])  # 20 is the current token of request 1
    topk[1, :3] = torch.tensor([29, 30, 0])
    topk[2] = torch.arange(top_k)
    for layer in range(2):
        table = resolve(layer, idx, seq, topk, torch.tensor([2], dtype=torch.int32))
        flat = device[layer].view(-1, 8)
        assert table[0, 1] == 120 and table[1, 1] == 194  # current tokens: ring rows
        for r, lanes in ((0, [0, 2, 3]), (1, [0, 2])):
            for j in lanes:
                host_id = req_to_host[idx[r], topk[r, j]]
                assert torch.equal(flat[table[r, j]], host[layer, host_id, 0])
        assert torch.all(table[0, 4:] == -1) and torch.all(table[2] == -1)
    # num_real_reqs masks a real request too.
    table = resolve(0, idx, seq, topk, torch.tensor([1], dtype=torch.int32))
    assert torch.all(table[1:] == -1)
    with pytest.raises(ValueError, match="NSA_DEV_CACHE_SIZE"):
        TopkToRows(manager, 63, req_to_host, ring, ring_start, 64, out)


def test_a_batch_past_the_cache_is_refused():
    """check_batch: the host-side count of a step's requests against N_G // top-k."""
    _, _, manager = borrowed_world()  # 32 slots
    out = torch.full((8, 8), -1, dtype=torch.int32)
    none = torch.full((8, 64), -1, dtype=torch.int64)
    ring, start = torch.zeros(8, RING, dtype=torch.int64), torch.zeros(8, dtype=torch.int64)
    resolve = TopkToRows(manager, 63, none, ring, start, 8, out)
    for n in range(5):
        resolve.check_batch(n)
    with pytest.raises(ConfigError) as err:
        resolve.check_batch(5)
    text = str(err.value)
    assert "5 requests" in text and "32 // top-k 8 = 4" in text
    assert "NSA_DEV_CACHE_SIZE >= 40" in text and "--max-running-requests to <= 4" in text


def test_eviction_reserve_is_the_runtimes():
    """The plugin's cache reserve: EchoConfig's for the plugin's N_G (the environment's
    NSA_DEV_CACHE_SIZE does not count), SGLANG_ECHO_EVICTION_RESERVE when set."""
    assert eviction_reserve_for(260_000, {}) == EchoConfig().eviction_reserve == 8125
    assert eviction_reserve_for(64, {"NSA_DEV_CACHE_SIZE": "1_000_000"}) == 2
    assert eviction_reserve_for(1 << 20, {}) == 8192  # capped
    assert eviction_reserve_for(64, {ENV_EVICTION_RESERVE: "0"}) == 0
    assert eviction_reserve_for(64, {ENV_EVICTION_RESERVE: "1_0"}) == 10
    with pytest.raises(ConfigError, match=ENV_EVICTION_RESERVE):
        eviction_reserve_for(64, {ENV_EVICTION_RESERVE: "-1"})
    with pytest.raises(ConfigError, match="at most 32"):
        eviction_reserve_for(64, {ENV_EVICTION_RESERVE: "33"})


@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "triton"])
def test_borrowed_cache_matches_an_owned_one(kernels, monkeypatch):
    """Same operations on borrowed rows and on ECHO's own pools: same slots, same bytes;
    also through the Triton allocation and recall kernels (interpreted on the CPU)."""
    monkeypatch.delenv(ENV_EVICTION_RESERVE, raising=False)
    reset_settings()  # the borrowed cache's reserve: config.settings(), parsed afresh
    _, host, borrowed = borrowed_world(layers=1, use_kernels=kernels)
    own_host = HostKVPool(1, 200, 8, torch.float32, pin=False)
    own_host.rows.copy_(host.view(1, 202, 8))
    reserve = borrowed.cache.eviction_reserve
    assert reserve == EchoConfig(dev_cache_size=32).eviction_reserve == 1  # the runtime's
    owned = EchoManager(
        own_host, DeviceCache(1, 32, 200, 8, torch.float32, "cpu", eviction_reserve=reserve)
    )
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):
        locs = torch.randint(1, 201, (3, 8), generator=gen)
        locs[0, :2] = -1
        a, b = borrowed.resolve(0, locs), owned.resolve(0, locs)
        assert torch.equal(a, b)
        live = a[a >= 0]
        assert torch.equal(borrowed.cache.rows[0][live], owned.cache.rows[0][live])
    borrowed.release(torch.arange(1, 201))
    assert int(borrowed.cache.free_count[0]) == 32


# ------------------------------------------------------------------------ prefetch
def test_prefetch_switches_are_logged(caplog):
    """Off: silence. ``1``: the decode prefetch says what it does; ``auto`` set in the
    environment says it runs as ``0`` in the plugin (as the default, unset: silence); the
    prefill switch says it does not apply."""
    from types import SimpleNamespace

    from sglang_echo.sglang.install import log_prefetch_switches

    with caplog.at_level(logging.INFO):
        log_prefetch_switches(SimpleNamespace(fuse_decode="0", fuse_extend=False))
    assert caplog.text == ""
    with caplog.at_level(logging.INFO):
        log_prefetch_switches(SimpleNamespace(fuse_decode="1", fuse_extend=True))
    assert "RECALL_DECODE=1: decode steps stage" in caplog.text
    assert "RECALL_EXTEND=1 accepted" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO):  # auto as the default (unset): off, quietly
        log_prefetch_switches(
            SimpleNamespace(fuse_decode="auto", fuse_extend=False, from_environment=frozenset())
        )
    assert caplog.text == ""
    set_here = frozenset({"SGLANG_NSA_FUSE_LOGITS_RECALL_DECODE"})
    with caplog.at_level(logging.WARNING):
        log_prefetch_switches(
            SimpleNamespace(fuse_decode="auto", fuse_extend=False, from_environment=set_here)
        )
    assert "RECALL_DECODE=auto accepted" in caplog.text and "runs it as 0" in caplog.text


# ---------------------------------------------------------------------- entry point
@pytest.mark.parametrize("value", [None, "0", ""])
def test_register_with_echo_off_does_nothing(value):
    """A fresh interpreter, as SGLang's processes are: nothing is imported or patched."""
    env_line = "" if value is None else f"os.environ['NSA_KV_OFFLOAD'] = {value!r}; "
    code = (
        "import os, sys; os.environ.pop('NSA_KV_OFFLOAD', None); "
        f"{env_line}from sglang_echo.plugin import register; register(); "
        "print(sorted(m for m in sys.modules if m.startswith(('sglang.', 'sglang_echo.sglang'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
