"""Checks that turn ECHO's silent degradations under SGLang into clear start-up errors.

Each would otherwise leave a server that runs, but not as configured:

- the class REPLACE of ``HiSparseCoordinator`` did not apply (SGLang only logs a failed
  hook): stock HiSparse would run with the pool sizes planned for ECHO;
- the host pool has no UVA alias (recalls copy through the host) while decode CUDA
  graphs are on: the capture would fail or replay stale copies;
- memory profiling left fewer device rows than planned (SGLang caps
  ``--max-total-tokens`` at what fits, with a warning): the host pool, S x R, would be
  smaller than the user's ``--max-total-tokens``;
- what sglang measured cannot hold ECHO's pools (``profile_guard``): its profile only
  counts its own pools, and ECHO's metadata and HiSparse's request tables come after it,
  so they would eat the memory sglang keeps for activations and CUDA graphs, and the
  server would run out of memory later, or the coordinator's allocation would fail.

The decisions are plain functions (tested without sglang); ``runner_guard(echo_class)``
makes the AFTER hook on ``ModelRunner.maybe_init_hisparse_coordinator`` that ``install``
registers, so the coordinator's class is checked in every scheduler process, where it is
built (the class is given, not imported: the coordinator imports this module);
``profile_guard`` is the AFTER hook on ``KVCacheConfigurator._profile_available_bytes``,
where sglang turns the memory it sampled into its KV budget, before any pool exists.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from sglang_echo.config import ENV_DEV_CACHE, ENV_OFFLOAD, ConfigError
from sglang_echo.sglang.args import (
    DEVICE_ROWS_KEY,
    HOST_TOKENS_KEY,
    SOURCE,
    format_problems,
)
from sglang_echo.sglang.args_sizing import measured_sizing

logger = logging.getLogger(__name__)

RUNNER_TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.maybe_init_hisparse_coordinator"
# Where sglang turns the memory it sampled (free before loading, free after) into its KV
# budget in bytes; pools are sized from that budget and built right after.
PROFILE_TARGET = (
    "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._profile_available_bytes"
)


def class_replace_problem(current: type | None, echo: type) -> str | None:
    """The coordinator class sglang will build is not ECHO's."""
    if isinstance(current, type) and issubclass(current, echo):
        return None
    name = "none" if current is None else f"{current.__module__}.{current.__qualname__}"
    return (
        f"sglang-echo ({ENV_OFFLOAD}=1): the HiSparse coordinator is {name}, not "
        "EchoCoordinator: the plugin's class REPLACE did not apply (look for 'Failed to "
        "apply hooks' in the log). Stock HiSparse would run with ECHO's pool sizes; fix "
        f"the plugin install, or launch without {ENV_OFFLOAD}=1."
    )


def runner_guard(echo_class: type) -> Callable[..., None]:
    """The AFTER hook on ``maybe_init_hisparse_coordinator``: the runner must hold an
    ``echo_class`` (EchoCoordinator, given by ``install``)."""

    def guard(result: Any, runner: Any, *args: Any, **kwargs: Any) -> None:
        if not getattr(runner, "enable_hisparse", False):
            return  # no HiSparse on this runner: argument resolution already refused ECHO
        coordinator = getattr(runner, "hisparse_coordinator", None)
        problem = class_replace_problem(
            None if coordinator is None else type(coordinator), echo_class
        )
        if problem:
            raise ConfigError(problem)

    return guard


def profile_guard(kv_bytes: int, configurator: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``_profile_available_bytes(pre_model_load_memory)``: ECHO's device totals
    against the bytes sglang's profile just returned (``args_sizing.measured_sizing``). Every rank
    sees the same numbers (sglang takes the least free memory over the ranks), so all stop
    together, naming every total and the values that fit."""
    if getattr(configurator, "is_draft_worker", False):
        return  # a draft pool reuses the target's budget (ECHO refuses drafts anyway)
    pre_model_load_memory = args[0] if args else kwargs["pre_model_load_memory"]
    result = measured_sizing(configurator, float(pre_model_load_memory), int(kv_bytes))
    if result is None:
        return
    if not result.fits:
        raise ConfigError(format_problems([result.message()]))
    logger.info("%s: ECHO's pools fit what sglang measured:\n%s", SOURCE, result.summary())


def hooks_problem(patched: set[str]) -> str | None:
    """The profile hook must have applied (sglang only logs a hook that fails to)."""
    if PROFILE_TARGET in patched:
        return None
    return (
        f"sglang-echo ({ENV_OFFLOAD}=1): the hook on {PROFILE_TARGET} did not apply (look "
        "for 'Failed to apply hooks' in the log), so nothing would check ECHO's pools "
        "against the memory sglang measures; fix the plugin install, or launch without "
        f"{ENV_OFFLOAD}=1."
    )


def graph_problem(*, is_cuda: bool, graph_safe: bool, decode_graphs: bool) -> str | None:
    """Recalls that copy through the host cannot be captured in a decode CUDA graph."""
    if not is_cuda or graph_safe or not decode_graphs:
        return None
    return (
        "sglang-echo: the host pool has no UVA alias on the GPU (its pinned memory is not "
        "addressable from the device), so ECHO's recalls copy through the host and cannot "
        "be captured in the decode CUDA graphs; add --disable-cuda-graph (or "
        "--disable-decode-cuda-graph) to the launch."
    )


def decode_graphs_enabled() -> bool:
    """Whether this process will capture decode CUDA graphs (sglang's resolved config);
    False where nothing is published (a coordinator built by hand)."""
    from sglang.srt.model_executor.cuda_graph_config import Backend
    from sglang.srt.runtime_context import get_exec

    try:
        config = get_exec().graph.cuda_graph_config
    except ValueError:
        return False
    return config is not None and config.decode.backend != Backend.DISABLED


def capacity_problems(settings: dict[str, Any], *, device_rows: int, host_tokens: int) -> list[str]:
    """The pools sglang built against the plan written at argument resolution."""
    problems = []
    planned_rows = settings.get(DEVICE_ROWS_KEY)
    if planned_rows is not None and device_rows < int(planned_rows):
        problems.append(
            f"sglang-echo: after memory profiling the GPU holds {device_rows} device rows "
            f"per layer, fewer than the {planned_rows} planned (ECHO's {ENV_DEV_CACHE} "
            "slots, one page per running request, and on a non-PD server one prompt); the "
            "host pool would shrink with them. Raise --mem-fraction-static, or lower "
            f"{ENV_DEV_CACHE} or --max-running-requests."
        )
    planned_host = settings.get(HOST_TOKENS_KEY)
    if planned_host is not None and host_tokens < int(planned_host):
        problems.append(
            f"sglang-echo: the host pool holds {host_tokens} tokens, fewer than "
            f"--max-total-tokens {planned_host}; see the device-row message above, or "
            "lower --max-total-tokens."
        )
    return problems
