"""Silent degradations become start-up errors (sglang_echo.sglang.guards), on sglang
0.5.23's real classes: the coordinator is built through the real
``ModelRunner.maybe_init_hisparse_coordinator`` on a stub runner (only what that method
reads), with the plan's hisparse_config parsed by sglang's own parser; a failed class
REPLACE, too few device rows after memory profiling, and a host pool without a UVA alias
under decode CUDA graphs each stop the start with the change to make."""

from __future__ import annotations

import json
from types import SimpleNamespace

import plugin_testenv  # first: sets the process up before sglang loads
import pytest
import torch
import torch.distributed as dist

plugin_testenv.require_sglang()

from sglang_world import (  # noqa: E402
    PAGE,
    build_pools,
    cpu_machine,  # noqa: F401 (autouse: CPU shims, process group)
)

from sglang_echo.config import ConfigError, EchoConfig  # noqa: E402
from sglang_echo.sglang import guards  # noqa: E402
from sglang_echo.sglang.args import plan_echo  # noqa: E402

TOP_K, DEV_CACHE = 16, 64


def plan(host_tokens: int = 1536):
    view = SimpleNamespace(max_total_tokens=host_tokens, disaggregation_mode="decode")
    return plan_echo(view, EchoConfig(dev_cache_size=DEV_CACHE), top_k=TOP_K, context_len=None)


def stub_runner(monkeypatch, echo_plan, device_rows: int | None = None):
    """The attributes maybe_init_hisparse_coordinator reads, around sglang's real pools
    sized as the plan says (or with ``device_rows``, as memory profiling may leave)."""
    import sglang.srt.mem_cache.sparsity.factory as factory
    import sglang.srt.model_executor.model_runner as model_runner

    config = echo_plan.hisparse_config()
    monkeypatch.setattr(factory, "get_memory", lambda: SimpleNamespace(hisparse_config=config))
    group = SimpleNamespace(cpu_group=dist.group.WORLD)
    monkeypatch.setattr(model_runner, "get_dp_tp_group", lambda: group)
    monkeypatch.setenv("NSA_DEV_CACHE_SIZE", "1")  # must not be what the coordinator reads
    rows = echo_plan.device_rows if device_rows is None else device_rows
    _, allocator, req_to_token = build_pools(
        rows, echo_plan.host_to_device_ratio, 2, echo_plan.per_rank_running, 256, torch.bfloat16
    )
    runner = SimpleNamespace(
        enable_hisparse=True,
        model_config=SimpleNamespace(hf_text_config=SimpleNamespace(index_topk=TOP_K)),
        req_to_token_pool=req_to_token,
        token_to_kv_pool_allocator=allocator,
        device="cpu",
        spec_algorithm=SimpleNamespace(is_none=lambda: True),
        hisparse_coordinator=None,
    )
    return runner, group


def build(runner) -> None:
    """sglang's own construction, then the AFTER hook that install() registers on it."""
    from sglang.srt.model_executor.model_runner import ModelRunner

    from sglang_echo.sglang.coordinator import EchoCoordinator

    ModelRunner.maybe_init_hisparse_coordinator(runner)
    guards.runner_guard(EchoCoordinator)(None, runner)


def test_real_construction_builds_echo_with_the_plan(monkeypatch):
    import sglang.srt.managers.hisparse_coordinator as hisparse

    from sglang_echo.sglang.coordinator import EchoCoordinator

    seen = {}

    class Recording(EchoCoordinator):
        def __init__(self, *args, **kwargs):
            seen.update(kwargs)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(hisparse, "HiSparseCoordinator", Recording)  # what REPLACE does
    echo_plan = plan()
    runner, group = stub_runner(monkeypatch, echo_plan)
    build(runner)
    coord = runner.hisparse_coordinator
    assert isinstance(coord, EchoCoordinator)
    config = json.loads(echo_plan.hisparse_config())
    assert seen["top_k"] == TOP_K  # the model's index_topk
    assert seen["device_buffer_size"] == config["device_buffer_size"]
    assert seen["host_to_device_ratio"] == echo_plan.host_to_device_ratio
    assert seen["tp_group"] is group.cpu_group  # the attention-DP rank's TP group
    assert seen["num_draft_tokens"] == 0
    assert coord.num_slots == DEV_CACHE  # from the resolved config, not the environment
    usable = coord.mem_pool_host.available_size()
    assert usable >= echo_plan.host_tokens  # T tokens fit after ECHO's two pages


def test_failed_class_replace_is_an_error(monkeypatch):
    runner, _ = stub_runner(monkeypatch, plan())
    with pytest.raises(ConfigError, match="class REPLACE did not apply"):
        build(runner)  # stock HiSparseCoordinator built: the guard refuses it


def test_fewer_device_rows_than_planned_is_an_error(monkeypatch):
    import sglang.srt.managers.hisparse_coordinator as hisparse

    from sglang_echo.sglang.coordinator import EchoCoordinator

    monkeypatch.setattr(hisparse, "HiSparseCoordinator", EchoCoordinator)
    echo_plan = plan()
    runner, _ = stub_runner(monkeypatch, echo_plan, device_rows=echo_plan.device_rows - 2 * PAGE)
    with pytest.raises(ConfigError) as info:
        build(runner)
    message = str(info.value)
    assert f"fewer than the {echo_plan.device_rows} planned" in message
    assert "--mem-fraction-static" in message
    assert f"fewer than --max-total-tokens {echo_plan.host_tokens}" in message


def test_graph_and_capacity_decisions():
    assert guards.graph_problem(is_cuda=False, graph_safe=False, decode_graphs=True) is None
    assert guards.graph_problem(is_cuda=True, graph_safe=True, decode_graphs=True) is None
    assert guards.graph_problem(is_cuda=True, graph_safe=False, decode_graphs=False) is None
    problem = guards.graph_problem(is_cuda=True, graph_safe=False, decode_graphs=True)
    assert problem is not None and "--disable-cuda-graph" in problem
    assert not guards.decode_graphs_enabled()  # nothing published in this process
    settings = {"echo_device_rows": 384, "echo_host_tokens": 1536}
    assert guards.capacity_problems(settings, device_rows=384, host_tokens=1536) == []
    assert len(guards.capacity_problems(settings, device_rows=320, host_tokens=1000)) == 2
    assert guards.capacity_problems({}, device_rows=1, host_tokens=1) == []
