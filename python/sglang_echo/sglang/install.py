"""Wire ECHO into SGLang: runs in every sglang process when ``NSA_KV_OFFLOAD=1``.

1. Two server-args resolution hooks (they run once, in the launcher; children receive
   the resolved record pickled):
   - at the first step (``handle_deprecated_dp_attention``): check the user's flags and
     declare HiSparse + ECHO's sizes (``args.plan_echo``);
   - late (``handle_other_validations``): check that SGLang's own defaults kept them.
2. ``HiSparseCoordinator`` -> ``EchoCoordinator`` (class REPLACE; ModelRunner imports
   the name lazily, and the registry also rebinds earlier ``from ... import`` copies).
   SGLang only logs a hook that fails to apply, so the late resolution step checks the
   class in the launcher, and an AFTER hook on ``ModelRunner.maybe_init_hisparse_
   coordinator`` checks what each scheduler process built (``guards``).
   An AFTER hook on ``KVCacheConfigurator._profile_available_bytes`` sizes ECHO's pools
   against what sglang measured, before its pools are built (``guards.profile_guard``);
   the late resolution step checks that it applied.
3. The prefetch switches: logged, not yet wired (the plugin's decode resolve runs the
   exact top-k, then ECHO's resolve; the runtime's prefetch is not in the plugin yet).
"""

from __future__ import annotations

import logging
from typing import Any

from sglang_echo.config import (
    ENV_FUSE_DECODE,
    ConfigError,
    EchoConfig,
    decode_prefetch_mode,
    load_settings,
    settings,
)
from sglang_echo.sglang.args import (
    DEFAULT_TOP_K,
    SOURCE,
    EchoPlan,
    format_problems,
    plan_echo,
)
from sglang_echo.sglang.args_sizing import check_resolved
from sglang_echo.sglang.guards import (
    PROFILE_TARGET,
    RUNNER_TARGET,
    class_replace_problem,
    hooks_problem,
    profile_guard,
    runner_guard,
)

logger = logging.getLogger(__name__)

COORDINATOR_TARGET = "sglang.srt.managers.hisparse_coordinator.HiSparseCoordinator"
PLAN_STEP = "handle_deprecated_dp_attention"
CHECK_STEP = "handle_other_validations"
_plans: dict[int, EchoPlan] = {}  # id(server_args) -> plan, within the resolving process


def model_facts(server_args: Any, view: Any) -> tuple[int, int | None]:
    """(index top-k, context length) from the model's config when SGLang can read it."""
    from sglang.srt.arg_groups.overrides import model_config_of

    model_config = model_config_of(server_args)
    text_config = getattr(model_config, "hf_text_config", None)
    top_k = int(getattr(text_config, "index_topk", None) or DEFAULT_TOP_K)
    context_len = getattr(view, "context_length", None) or getattr(
        model_config, "context_len", None
    )
    return top_k, context_len


def plan_step(server_args: Any, previous) -> None:
    from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view

    previous(server_args)
    view = resolving_view(server_args)
    # Resolution is the launcher's start-up: the environment parsed as the launch sees it
    # (register() parsed it when the plugins loaded; the resolved plan goes to children).
    env_settings = load_settings(reader="plugin")
    config = EchoConfig.from_settings(env_settings)
    top_k, context_len = model_facts(server_args, view)
    plan = plan_echo(view, config, top_k=top_k, context_len=context_len)
    declare_resolution(server_args, SOURCE, **plan.declarations())
    _plans[id(server_args)] = plan
    logger.info(
        "%s: ECHO on, per attention-DP rank (%d rank(s)): device cache %d slots/layer, "
        "host pool %d tokens, top-k %d, <= %d running requests; HiSparse pool %d device "
        "rows x ratio %d",
        SOURCE,
        plan.attn_dp_size,
        plan.dev_cache_size,
        plan.host_tokens,
        plan.top_k,
        plan.per_rank_running,
        plan.device_rows,
        plan.host_to_device_ratio,
    )
    logger.info("%s: %s", SOURCE, env_settings.summary())


def check_step(server_args: Any, previous) -> None:
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.plugins.hook_registry import HookRegistry

    previous(server_args)
    plan = _plans.pop(id(server_args), None)
    if plan is None:
        return  # resolved by a process that did not plan it (cannot happen in a launch)
    problems = check_resolved(resolving_view(server_args), plan)
    patched = getattr(HookRegistry, "_patched", None)  # what apply_hooks patched
    for problem in (
        replaced_class_problem(),
        None if patched is None else hooks_problem(patched),
    ):
        if problem:
            problems.append(problem)
    if problems:
        raise ConfigError(format_problems(problems))


def replaced_class_problem() -> str | None:
    """The class REPLACE of HiSparseCoordinator must have applied in this process."""
    import sglang.srt.managers.hisparse_coordinator as hisparse

    from sglang_echo.sglang.coordinator import EchoCoordinator

    return class_replace_problem(hisparse.HiSparseCoordinator, EchoCoordinator)


def install() -> None:
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_echo.sglang.coordinator import EchoCoordinator

    register_resolution_hook(PLAN_STEP)(plan_step)
    register_resolution_hook(CHECK_STEP)(check_step)
    HookRegistry.register(COORDINATOR_TARGET, EchoCoordinator, HookType.REPLACE)
    HookRegistry.register(RUNNER_TARGET, runner_guard(EchoCoordinator), HookType.AFTER)
    HookRegistry.register(PROFILE_TARGET, profile_guard, HookType.AFTER)

    log_prefetch_switches(settings())  # parsed by register() in this process


def log_prefetch_switches(config: Any) -> None:
    """The prefetch switches are accepted, and the log says what they do in the plugin."""
    mode = decode_prefetch_mode(config.fuse_decode)
    if mode == "1":
        logger.info(
            "sglang-echo: SGLANG_NSA_FUSE_LOGITS_RECALL_DECODE=1: decode steps stage the "
            "predicted misses from sglang's indexer logits while its top-k runs "
            "(lossless: the exact top-k decides every row)."
        )
    elif mode == "auto" and ENV_FUSE_DECODE in getattr(config, "from_environment", ()):
        # Set, not the default: say that the plugin does not run it (unset, it is off quietly).
        logger.warning(
            "sglang-echo: SGLANG_NSA_FUSE_LOGITS_RECALL_DECODE=auto accepted, but its rule "
            "needs two decode graphs per batch size, which sglang's graph runner does not "
            "keep; the plugin runs it as 0 (no decode prefetch). Set 1 to prefetch always."
        )
    if config.fuse_extend:
        logger.warning(
            "sglang-echo: SGLANG_NSA_FUSE_LOGITS_RECALL_EXTEND=1 accepted, but prefill "
            "prefetch does not apply here: a local prefill keeps its prompt on the device."
        )


def install_error(error: ConfigError) -> None:
    """A bad ECHO setting: fail the launch at argument resolution, with its message
    (an exception in a plugin's register() is only logged by SGLang, which then starts
    without the plugin)."""
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook

    def fail(server_args: Any, previous) -> None:
        raise error

    register_resolution_hook(PLAN_STEP)(fail)
