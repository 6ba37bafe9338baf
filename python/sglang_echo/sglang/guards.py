"""Checks that turn ECHO's silent degradations under SGLang into clear start-up errors.

Each would otherwise leave a server that runs, but not as configured:

- the class REPLACE of ``HiSparseCoordinator`` did not apply (SGLang only logs a failed
  hook): stock HiSparse would run with the pool sizes planned for ECHO;
- the host pool has no UVA alias (recalls copy through the host) while decode CUDA
  graphs are on: the capture would fail or replay stale copies;
- memory profiling left fewer device rows than planned (SGLang caps
  ``--max-total-tokens`` at what fits, with a warning): the host pool, S x R, would be
  smaller than the user's ``--max-total-tokens``.

The decisions are plain functions (tested without sglang); ``runner_guard`` is the AFTER
hook on ``ModelRunner.maybe_init_hisparse_coordinator`` that ``install`` registers, so the
coordinator's class is checked in every scheduler process, where it is built.
"""

from __future__ import annotations

from typing import Any

from sglang_echo.config import ENV_DEV_CACHE, ENV_OFFLOAD, ConfigError
from sglang_echo.sglang.args import DEVICE_ROWS_KEY, HOST_TOKENS_KEY

RUNNER_TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.maybe_init_hisparse_coordinator"


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


def runner_guard(result: Any, runner: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``maybe_init_hisparse_coordinator``: the runner must hold an EchoCoordinator."""
    from sglang_echo.sglang.coordinator import EchoCoordinator

    if not getattr(runner, "enable_hisparse", False):
        return  # no HiSparse on this runner: argument resolution already refused ECHO
    coordinator = getattr(runner, "hisparse_coordinator", None)
    problem = class_replace_problem(
        None if coordinator is None else type(coordinator), EchoCoordinator
    )
    if problem:
        raise ConfigError(problem)


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
