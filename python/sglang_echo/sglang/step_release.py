"""One release per decode step: the requests sglang finishes while it processes one step's
results give their host ids back to ECHO's cache together.

Why: a finished request's host ids must be unmapped from ECHO's cache in every layer
before they are freed (a freed id still mapped would give its next owner another token's
rows); one release launch per step covers every request that finished in it, where one
per request would add a launch per finish. The hook opens the coordinator's
``one_release_per_step`` scope around sglang's processing of a step's results; finishes
outside it (aborts, retraction, transfer failures) release at once.

Imports sglang's hook registry only when installed (by the coordinator).
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

# sglang's processing of one step's results: where its scheduler finishes requests.
RESULT_PROCESSOR = (
    "sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor"
)
STEP_RESULT_TARGETS = tuple(
    f"{RESULT_PROCESSOR}.{name}"
    for name in (
        "process_batch_result_decode",
        "process_batch_result_prefill",
        "process_batch_result_prebuilt",
    )
)
_step_release_installed = False
_echo_class: type | None = None  # EchoCoordinator, given when the first one is built


def release_finished_together(original: Any, processor: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND sglang's processing of one step's results: the host ids of every request it
    finishes are released from ECHO's cache in one call when it returns."""
    coordinator = getattr(processor, "hisparse_coordinator", None)
    if _echo_class is None or not isinstance(coordinator, _echo_class):
        return original(processor, *args, **kwargs)
    with coordinator.one_release_per_step():
        return original(processor, *args, **kwargs)


def install_step_release(echo_class: type) -> None:
    """Register ``release_finished_together`` on sglang's result processing, once per
    process, for coordinators of ``echo_class`` (given, not imported: the coordinator
    imports this module). The coordinator is built after the plugin's hooks were applied,
    so they are applied again (targets already patched are skipped). If sglang cannot
    apply it (it only logs that), finished requests release one at a time: slower,
    equally correct."""
    global _step_release_installed, _echo_class
    _echo_class = echo_class
    if _step_release_installed:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookSource, HookType

    source = HookSource(plugin_name="echo", dist_name="sglang-echo")
    for target in STEP_RESULT_TARGETS:
        HookRegistry.register(target, release_finished_together, HookType.AROUND, source=source)
    HookRegistry.apply_hooks()
    _step_release_installed = True
    missing = [t for t in STEP_RESULT_TARGETS if t not in HookRegistry._patched]
    if missing:
        logger.warning(
            "sglang-echo: could not wrap %s; finished requests release their host ids one "
            "request at a time (correct, one release launch per request).",
            ", ".join(missing),
        )
