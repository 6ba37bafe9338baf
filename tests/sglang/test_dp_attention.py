"""DP attention (``--tp-size 8 --dp-size 8 --enable-dp-attention``): every attention-DP
rank is its own scheduler with its own pools and its own EchoCoordinator, sized by the
plugin's per-rank plan. A scripted PD-decode life on two ranks' worth of coordinators
built from sglang's real classes: one rank serves requests, the other is idle and, as
sglang's DP attention makes it, replays the decode step with zero real requests (CUDA
graph: padded rows, ``num_real_reqs`` 0) or runs an IDLE batch (zero rows). The idle rank
must not touch its ECHO state; the busy rank's rows stay byte-exact."""

from __future__ import annotations

import random
from types import SimpleNamespace

import plugin_testenv  # first: sets the process up before sglang loads
import torch

plugin_testenv.require_sglang()

from sglang_world import (  # noqa: E402
    DecodeNode,
    cpu_machine,  # noqa: F401 (autouse: CPU shims, process group)
)
from test_coordinator import assert_back_to_start, check_tables, run_life  # noqa: E402

from sglang_echo.config import EchoConfig  # noqa: E402
from sglang_echo.sglang.args import plan_echo  # noqa: E402

TOP_K, DEV_CACHE, RANKS = 16, 64, 2


def per_rank_plan():
    """The plan for --attn-dp-size 2 --max-running-requests 8 on a PD decode node."""
    view = SimpleNamespace(
        max_total_tokens=1536,
        max_running_requests=4 * RANKS,
        disaggregation_mode="decode",
        attn_dp_size=RANKS,
    )
    return plan_echo(view, EchoConfig(dev_cache_size=DEV_CACHE), top_k=TOP_K, context_len=None)


def rank_node(plan, seed: int) -> DecodeNode:
    node = DecodeNode(
        layers=2, top_k=TOP_K, dev_cache=plan.dev_cache_size,
        max_running=plan.per_rank_running, host_tokens=plan.host_tokens, max_context=256,
        seed=seed,
    )  # fmt: skip
    assert node.pool.size == plan.device_rows  # the rank's pool is the per-rank plan
    assert node.coord.resolver.max_rows == plan.per_rank_running
    return node


def echo_state(node: DecodeNode) -> list[torch.Tensor]:
    cache = node.coord.cache
    return [
        t.clone()
        for t in (
            cache.host_to_device,
            cache.device_to_host,
            cache.priority,
            cache.free_count,
            cache.hits,
            cache.misses,
            node.coord.ring_rows,
            node.coord.ring_start,
        )
    ]


def idle_replay(node: DecodeNode, padded_bs: int, gen: torch.Generator) -> list[torch.Tensor]:
    """What an idle DP rank's decode graph replay feeds the coordinator: padding request
    0, padded sequence lengths, garbage selections, and zero real requests."""
    coord = node.coord
    coord.wait_for_pending_backup()
    coord.num_real_reqs.fill_(0)
    tables = []
    for layer in range(node.layers):
        topk = torch.randint(0, 8, (padded_bs, TOP_K), dtype=torch.int32, generator=gen)
        table = coord.swap_in_selected_pages(
            torch.zeros(padded_bs, dtype=torch.int64),
            torch.ones(padded_bs, dtype=torch.int64),
            topk,
            layer,
        )
        tables.append(table.clone())
    return tables


def idle_batch(node: DecodeNode) -> list[torch.Tensor]:
    """An eager IDLE batch: no rows at all."""
    coord = node.coord
    coord.num_real_reqs.fill_(0)
    empty = torch.empty(0, dtype=torch.int64)
    return [
        coord.swap_in_selected_pages(empty, empty, torch.empty(0, TOP_K, dtype=torch.int32), layer)
        for layer in range(node.layers)
    ]


def test_per_rank_plan_sizes():
    plan = per_rank_plan()
    assert plan.attn_dp_size == RANKS and plan.per_rank_running == DEV_CACHE // TOP_K
    assert plan.max_running_requests == plan.per_rank_running * RANKS
    assert plan.device_rows == 128 + 4 * 64  # ceil64(N_G + 1) + one page per request
    assert plan.device_rows * plan.host_to_device_ratio >= plan.host_tokens


def test_two_ranks_one_idle():
    plan = per_rank_plan()
    busy, idle = rank_node(plan, seed=0), rank_node(plan, seed=1)
    assert busy.coord.row_base == idle.coord.row_base  # same layout on every rank
    assert (
        busy.coord.mem_pool_host.kv_buffer.data_ptr()
        != idle.coord.mem_pool_host.kv_buffer.data_ptr()
    )
    before = echo_state(idle)
    gen = torch.Generator().manual_seed(7)

    rng = random.Random(0)
    life_steps = 0

    def idle_step() -> None:
        for table in idle_replay(idle, padded_bs=plan.per_rank_running, gen=gen):
            assert torch.all(table == -1), "an idle rank's replay must select nothing"
        for table in idle_batch(idle):
            assert table.shape == (0, TOP_K)

    # Interleave: each busy-rank step is mirrored by an idle-rank replay, as the
    # DP ranks step together (the MoE layers are collective).
    original_step = busy.step

    def step(rids, padded_bs, topk_for):
        nonlocal life_steps
        tables = original_step(rids, padded_bs, topk_for)
        idle_step()
        life_steps += 1
        return tables

    busy.step = step
    stats = run_life(busy, steps=40, seed=rng.randrange(1000))
    assert life_steps == stats["steps"] > 10
    assert stats["finished"] + stats["aborted"] >= 3
    assert min(busy.coord.echo_telemetry()["misses"]) > 0
    assert_back_to_start(busy)

    after = echo_state(idle)
    for a, b in zip(before, after, strict=True):
        assert torch.equal(a, b), "the idle rank's ECHO state changed"
    assert idle.counters() == idle.after_init


def test_busy_rank_rows_exact_with_padding_to_the_other_ranks_batch():
    """DP attention pads each rank's graph batch to a size shared by the ranks: the busy
    rank's rows past its real requests resolve to nothing, its real rows stay exact."""
    plan = per_rank_plan()
    node = rank_node(plan, seed=3)
    rids = [node.arrive(40), node.arrive(70)]
    rng = random.Random(3)

    def topk_for(layer, rid, seq_len):
        k = min(seq_len, TOP_K)
        return torch.tensor(sorted(rng.sample(range(seq_len), k)), dtype=torch.int32)

    for _ in range(3):
        tables = node.step(rids, padded_bs=plan.per_rank_running, topk_for=topk_for)
        check_tables(node, rids, tables)
    for rid in rids:
        node.finish(rid)
    assert_back_to_start(node)
