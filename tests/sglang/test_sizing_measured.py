"""The exact start-up check (issue 50, item 3): ECHO's pools against what sglang measured,
on sglang 0.5.23's own profiling code, on the CPU.

sglang's KVCacheConfigurator, built as ModelRunner builds it (fp8 DeepSeek-V3.2, its
published config.json, as a PD decode node under DP attention 8 on an H200), from the
launch's arguments resolved by sglang with ECHO's declarations (``plan_echo``), runs its
own ``_resolve_memory_pool_config``: ``_profile_available_bytes`` samples the free memory
through ``get_available_gpu_memory`` (an all-reduce over a one-rank gloo group, as over the
ranks) and turns it into the KV budget, with the plugin's AFTER hook
(``guards.profile_guard``) wrapped around it by sglang's own ``_wrap_fn``, as its
HookRegistry applies it. Stubbed, and nothing else: the CUDA queries that sampling makes
(device count, current device, its properties, and ``mem_get_info``, whose free memory
each test sets), and the GPU's capacity and capability that argument resolution reads.

A plan that misses is refused naming every total, what sglang sampled, and the values
that fit. Each named value is then launched the same way: at it, sglang's configuration
goes through and keeps the S rows ECHO planned; one past it (one token of
--max-total-tokens, one slot of NSA_DEV_CACHE_SIZE, 0.001 of --mem-fraction-static, one
batch of --cuda-graph-max-bs-decode), refused. The totals are test_sizing.py's
independent ones (sglang's pools and ECHO's tensors built on the meta device), compared
with the budget sglang's function returned.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from types import SimpleNamespace

import plugin_testenv  # first: sets the process up before sglang loads
import pytest
import torch
import torch.distributed as dist

plugin_testenv.require_sglang()

from sglang_world import init_process_group  # noqa: E402
from test_sizing import DSV32_CONFIG, GPU_MIB, N_G, TOP_K, T, device_totals  # noqa: E402

from sglang_echo.config import ConfigError, EchoConfig, reset_settings  # noqa: E402
from sglang_echo.sglang import guards, sizing_weights  # noqa: E402
from sglang_echo.sglang.args import plan_echo  # noqa: E402

GiB = 2**30
H200_MIB = GPU_MIB["H200"]
CONTEXT = 163840  # the model's context (no --context-length on a PD decode node)
# What sglang's bootstrap found free before loading (pre_model_load_memory, in GiB, as
# sglang passes it): an H200's 140.40 GiB less 1.65 GiB of start-up.
FREE_BEFORE = 138.75
LAUNCH = [
    "--tp-size", "8", "--dp-size", "8", "--enable-dp-attention", "--trust-remote-code",
    "--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "mooncake",
    "--kv-cache-dtype", "fp8_e4m3", "--device", "cuda", "--skip-tokenizer-init",
]  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    init_process_group(str(tmp_path_factory.mktemp("pg")))
    model = tmp_path_factory.mktemp("dsv32")
    (model / "config.json").write_text(json.dumps(DSV32_CONFIG))
    return model


@dataclass
class Profiled:
    """One launch's profile: the budget sglang's function returned, and then either
    sglang's pool configuration or the plugin's refusal."""

    plan: object
    budget: int
    config: object | None
    error: str | None


def as_flags(declarations: dict) -> list[str]:
    """The plan's declarations as the command-line flags that set the same fields."""
    flags = []
    for name, value in declarations.items():
        flag = "--" + name.replace("_", "-")
        flags += [flag] if value is True else [flag, str(value)]
    return flags


def pd_plan(n_g: int, t: int):
    """ECHO's plan for a PD decode rank under DP attention 8 (the launcher's plan_echo)."""
    view = SimpleNamespace(max_total_tokens=t, disaggregation_mode="decode", attn_dp_size=8)
    return plan_echo(view, EchoConfig(dev_cache_size=n_g), top_k=TOP_K, context_len=None)


def resolve(mp: pytest.MonkeyPatch, model_dir, plan, flags=()):
    """sglang's resolution of the launch with the plan's declarations, on an H200 (its
    capacity and capability stubbed), with ECHO's settings at their defaults."""
    from sglang.srt.arg_groups import memory_hook
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import common

    for key in ("SGLANG_ECHO_EVICTION_RESERVE", "SGLANG_NSA_FUSE_LOGITS_RECALL_DECODE"):
        mp.delenv(key, raising=False)
    reset_settings()  # ECHO's settings as this environment says (their defaults)
    capacity = lambda device=None: H200_MIB  # noqa: E731
    mp.setattr(common, "get_device_memory_capacity", capacity)
    mp.setattr(memory_hook, "get_device_memory_capacity", capacity)
    mp.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    argv = ["--model-path", str(model_dir), *LAUNCH, *as_flags(plan.declarations()), *flags]
    server_args = prepare_server_args(argv)
    server_args.resolve_once()
    return server_args


def profile(model_dir, free_after: float, *, n_g=N_G, t=T, flags=()) -> Profiled:
    """Resolve the launch with ECHO's plan for (N_G, T), then run sglang's memory-pool
    configuration with ``free_after`` GiB free after loading, the plugin's hook on."""
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.model_executor.model_runner_components.layer_setup import ModelLayerInfo
    from sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state import (
        SpecAuxHiddenStateConfig,
    )
    from sglang.srt.plugins.hook_registry import HookType, _wrap_fn
    from sglang.srt.runtime_context import create_context, get_parallel, use_context
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    plan = pd_plan(n_g, t)
    returned: list[int] = []
    with pytest.MonkeyPatch.context() as mp:
        server_args = resolve(mp, model_dir, plan, flags)
        context = create_context(server_args, role="scheduler")
        # What get_available_gpu_memory asks CUDA on the scheduler's GPU.
        mp.setattr(torch.cuda, "device_count", lambda: 1)
        mp.setattr(torch.cuda, "current_device", lambda: 0)
        mp.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(is_integrated=False))  # fmt: skip
        mp.setattr(torch.cuda, "mem_get_info", lambda i=0: (int(free_after * GiB), H200_MIB << 20))

        def record(result, *args, **kwargs):
            returned.append(result)

        original = KVCacheConfigurator._profile_available_bytes
        hooked = _wrap_fn(_wrap_fn(original, record, HookType.AFTER), guards.profile_guard, HookType.AFTER)  # fmt: skip
        mp.setattr(KVCacheConfigurator, "_profile_available_bytes", hooked)
        group = SimpleNamespace(cpu_group=dist.group.WORLD)
        with use_context(context), get_parallel().override(world_group=group):
            from sglang.srt.arg_groups.overrides import model_config_of

            configurator = KVCacheConfigurator(
                device="cuda", gpu_id=0, attn_dp_size=get_parallel().attn_dp_size,
                pp_size=1, pp_group=None, model=None, model_config=model_config_of(server_args),
                server_args=server_args, kv_cache_dtype=torch.float8_e4m3fn,
                kv_cache_dtype_str="fp8_e4m3", model_dtype=torch.bfloat16, page_size=64,
                sliding_window_size=None, spec_algorithm=SpeculativeAlgorithm.NONE,
                is_draft_worker=False, post_capture_kv_active=False,
                spec_aux_config=SpecAuxHiddenStateConfig(), is_hybrid_swa=False,
                is_hybrid_swa_compress=False, use_mla_backend=True,
                layer_info=ModelLayerInfo(start_layer=0, end_layer=61, num_effective_layers=61),
                forward_stream=None, req_to_token_pool=None, token_to_kv_pool_allocator=None,
                memory_pool_config=None,
            )  # fmt: skip
            try:
                config = configurator._resolve_memory_pool_config(FREE_BEFORE)
                error = None
            except ConfigError as exc:
                config, error = None, str(exc)
    reset_settings()
    assert len(returned) == 1  # sglang's profile ran once, and its budget reached the hook
    return Profiled(plan, returned[0], config, error)


def device_total(n_g: int, t: int) -> int:
    """The plan's device bytes, independently (test_sizing.device_totals)."""
    want = device_totals(n_g, t, fp8=True, context=CONTEXT)
    return sum(v for k, v in want.items() if k != "host")


def extra_slots(n_g: int) -> int:
    """sglang's PD pre-allocation slots at this per-rank batch (none above 32)."""
    return 2 * (n_g // TOP_K) if n_g // TOP_K <= 32 else 0


def named(error: str, pattern: str) -> str | None:
    found = re.search(pattern, error)
    return None if found is None else found[1]


def assert_starts(result: Profiled, n_g: int, t: int) -> None:
    assert result.error is None, result.error
    assert device_total(n_g, t) <= result.budget
    # sglang's own arithmetic kept every row ECHO planned (it caps silently otherwise)
    assert result.config.max_total_num_tokens == result.plan.device_rows


def assert_refused(result: Profiled, n_g: int, t: int) -> None:
    assert result.config is None
    assert "ECHO's pools do not fit the GPU as sglang measured it" in (result.error or "")
    assert device_total(n_g, t) > result.budget


def test_refusal_names_what_sglang_measured_and_exact_boundaries(model_dir):
    """README's PD line (--cuda-graph-max-bs-decode 128: sglang's default fraction 0.929)
    with 35 GiB free after loading: refused; each named value starts, one past it not."""
    free_after = 35.0
    flags = ["--cuda-graph-max-bs-decode", "128"]
    base = profile(model_dir, free_after, flags=flags)
    assert extra_slots(N_G) == 0  # 126 per rank: no pre-allocation slots on this node
    assert_refused(base, N_G, T)
    error = base.error
    assert error.startswith("sglang-echo (NSA_KV_OFFLOAD=1) cannot run with these settings")
    want = device_totals(N_G, T, fp8=True, context=CONTEXT)
    for key in ("rows", "keys", "metadata", "tables"):
        assert sizing_weights.gib(want[key]) in error, key
    total = device_total(N_G, T)
    assert (
        f"({sizing_weights.gib(total)} > {sizing_weights.gib(base.budget)})" in error
    )  # sglang's budget
    # what sglang sampled: before loading (its argument), after (the stubbed free memory)
    assert f"free before loading {sizing_weights.gib(FREE_BEFORE * GiB)} of 140.40 GiB" in error
    assert f"free after loading {sizing_weights.gib(free_after * GiB)}" in error
    assert (
        f"other start-up allocations: {sizing_weights.gib((FREE_BEFORE - free_after) * GiB)}"
        in error
    )
    assert "0.929" in error and "is an estimate" not in error  # measured, not estimated
    assert "no --cuda-graph-max-bs-decode fits" in error  # 128 is at sglang's 10 GiB floor

    best_t = int(named(error, r"--max-total-tokens (\d+) \(with"))
    assert device_total(N_G, best_t) <= base.budget < device_total(N_G, best_t + 1)
    assert_starts(profile(model_dir, free_after, t=best_t, flags=flags), N_G, best_t)
    assert_refused(profile(model_dir, free_after, t=best_t + 1, flags=flags), N_G, best_t + 1)

    best_n = int(named(error, r"NSA_DEV_CACHE_SIZE=(\d+) \(with"))
    assert device_total(best_n, T) <= base.budget < device_total(best_n + 1, T)
    assert_starts(profile(model_dir, free_after, n_g=best_n, flags=flags), best_n, T)
    assert_refused(profile(model_dir, free_after, n_g=best_n + 1, flags=flags), best_n + 1, T)

    fraction = named(error, r"--mem-fraction-static ([\d.]+) \(the smallest")
    below = f"{float(fraction) - 0.001:.3f}"
    at = profile(model_dir, free_after, flags=[*flags, "--mem-fraction-static", fraction])
    assert_starts(at, N_G, T)
    under = profile(model_dir, free_after, flags=[*flags, "--mem-fraction-static", below])
    assert_refused(under, N_G, T)
    # a fraction the user set does not move with the graphs: the flag is not offered
    assert "--cuda-graph-max-bs-decode" not in under.error


def test_graph_batch_named_is_the_boundary(model_dir):
    """sglang's default decode graphs (512 per rank: default fraction 0.833) with 45 GiB
    free after loading: refused, naming the largest --cuda-graph-max-bs-decode whose
    default fraction fits; at it the launch starts, one batch more it does not."""
    free_after = 45.0
    base = profile(model_dir, free_after)
    assert_refused(base, N_G, T)
    batch = int(named(base.error, r"--cuda-graph-max-bs-decode (\d+) \(sglang's default"))
    assert 1 <= batch < 512
    at = profile(model_dir, free_after, flags=["--cuda-graph-max-bs-decode", str(batch)])
    assert_starts(at, N_G, T)
    above = profile(model_dir, free_after, flags=["--cuda-graph-max-bs-decode", str(batch + 1)])
    assert_refused(above, N_G, T)
    assert at.budget > above.budget > base.budget  # the default fraction falls with batches


def test_launcher_weights_come_from_the_checkpoint_index(tmp_path):
    """At argument resolution the launcher's sizing reads the weights through the model
    folder's model.safetensors.index.json (a small DeepSeek-V3.2-shaped checkpoint
    written here), and from config.json once the index is gone."""
    from sglang.srt.arg_groups.overrides import resolving_view
    from test_plugin_args import MODEL_CONFIG
    from test_sizing import write_small_checkpoint

    from sglang_echo.sglang.args_sizing import sizing_inputs

    config = {**MODEL_CONFIG, "num_nextn_predict_layers": 1}
    write_small_checkpoint(tmp_path, config)
    parallel = sizing_weights.Parallel(tp_size=8, attn_dp_size=8)
    want = sizing_weights.checkpoint_weight_bytes(tmp_path, config, parallel)
    plan = pd_plan(N_G, T)
    with pytest.MonkeyPatch.context() as mp:
        view = resolving_view(resolve(mp, tmp_path, plan))
        _, budget = sizing_inputs(view, plan)
        assert budget.weights == want and "index" in budget.weights.source
        (tmp_path / sizing_weights.INDEX_FILE).unlink()
        _, budget = sizing_inputs(view, plan)
        assert budget.weights == sizing_weights.weight_bytes(config, parallel)
    reset_settings()
