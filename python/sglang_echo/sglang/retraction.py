"""PD decode retraction that keeps the request's KV where it already is: the host pool.

Why: on a HiSparse decode node every token's KV is in the pinned host pool, so a request
retracted under memory pressure loses nothing but its newest page. sglang 0.5.23 cannot
resume it, though: with the retraction backup ``none`` (what the plugin declares, since
the DSA pool implements no ``cpu_tensor`` copy) ``release_req`` frees everything and the
request is aborted with 503; and its resume path (``resume_retracted_reqs``) would give
the request fresh host slots (``_pre_alloc``) and queue it without ``admit_request_direct``.

Five AROUND hooks (registered once per process when the first coordinator is built, as
the step release is) make a retraction keep the request's host ids instead:

- ``release_req``: a retraction scope of the coordinator. Its ``retract_req`` then backs
  up the newest row's token to the host if it is not there yet, and keeps the host-id row
  (the ids stay allocated, and mapped in ECHO's cache: their rows are still right);
- ``backup_kv_cache``: the kept row becomes the request's ``retraction_backup`` (a
  ``RetractionBackup`` whose ``cpu_tensors`` is a ``KeptHostIds``), so sglang queues the
  request as retracted instead of aborting it. A kept row no backup claims (a release
  that does not back up) is released when the scope closes;
- ``DecodePreallocQueue._pre_alloc``: at resume the kept row is installed as the new
  request slot's host row before sglang's host allocation runs, which then allocates
  nothing (its range is already allocated);
- ``restore_kv_cache``: the request is admitted directly (a newest page, no first backup);
- ``discard_kv_cache_backup``: an abort while retracted releases the kept ids.

Any other backup (another pool, a request admitted through staging) takes sglang's path.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger(__name__)

TARGETS = {
    "release_req": "sglang.srt.managers.schedule_batch.release_req",
    "backup": "sglang.srt.mem_cache.common.backup_kv_cache",
    "restore": "sglang.srt.mem_cache.common.restore_kv_cache",
    "discard": "sglang.srt.mem_cache.common.discard_kv_cache_backup",
    "pre_alloc": "sglang.srt.disaggregation.decode.DecodePreallocQueue._pre_alloc",
}
# Coordinators inside a retraction scope (sglang's release_req), innermost last.
SCOPES: list[Any] = []
_installed = False
# Every hook applied: only then does a retraction keep host ids (a partial set would keep
# ids that the resume path then cannot restore).
ENABLED = False


@dataclass
class KeptHostIds:
    """A retracted request's host-id row, kept allocated for its resume."""

    coordinator: Any  # the EchoCoordinator that kept it
    row: torch.Tensor  # host ids over the allocated pages, -1 where none
    allocated: int  # req_to_host_pool_allocated_len of the row
    tokens: int  # tokens whose KV the row holds (sglang's fill length at resume)
    installed: bool = field(default=False)  # put back into a request slot's row


def kept_of(req: Any) -> KeptHostIds | None:
    backup = getattr(getattr(req, "kv", None), "retraction_backup", None)
    kept = getattr(backup, "cpu_tensors", None)
    return kept if isinstance(kept, KeptHostIds) else None


# ------------------------------------------------------------------------- hooks
def release_req_scope(original, *args, **kwargs):
    """AROUND sglang's ``release_req``: the coordinator's retraction scope around it."""
    coordinator = kwargs.get("hisparse_coordinator")
    if not hasattr(coordinator, "retraction_scope"):
        return original(*args, **kwargs)
    with coordinator.retraction_scope():
        return original(*args, **kwargs)


def backup_keeping_host_ids(original, req, tree_cache, req_to_token_pool, allocator, backend):
    """AROUND ``backup_kv_cache``: a request whose host ids the scope's coordinator kept
    is backed up by them (True: sglang queues it as retracted)."""
    for coordinator in reversed(SCOPES):
        kept = coordinator.claim_kept(req)
        if kept is not None:
            from sglang.srt.mem_cache.common import RetractionBackup

            req.kv.retraction_backup = RetractionBackup(cpu_tensors=kept, host_indices=kept.row)
            return True
    return original(req, tree_cache, req_to_token_pool, allocator, backend)


def pre_alloc_with_kept_row(original, queue, req, *args, **kwargs):
    """AROUND ``DecodePreallocQueue._pre_alloc``: a resumed request gets its kept host
    row back instead of fresh host slots."""
    kept = kept_of(req)
    if kept is None:
        return original(queue, req, *args, **kwargs)
    with kept.coordinator.installing_kept_row(kept):
        return original(queue, req, *args, **kwargs)


def restore_kept_host_ids(original, req, tree_cache, req_to_token_pool, allocator, backend):
    """AROUND ``restore_kv_cache``: a resumed request with kept host ids is admitted
    directly, its KV already in the host pool."""
    kept = kept_of(req)
    if kept is None:
        return original(req, tree_cache, req_to_token_pool, allocator, backend)
    kept.coordinator.resume_kept(req, kept)
    req.kv.retraction_backup = None
    return None


def discard_kept_host_ids(original, req, tree_cache, backend):
    """AROUND ``discard_kv_cache_backup``: kept host ids of a request that will not
    resume (aborted while retracted, memory released) go back to the host pool."""
    kept = kept_of(req)
    if kept is None:
        return original(req, tree_cache, backend)
    kept.coordinator.discard_kept(kept)
    req.kv.retraction_backup = None
    return None


HOOKS = {
    "release_req": release_req_scope,
    "backup": backup_keeping_host_ids,
    "restore": restore_kept_host_ids,
    "discard": discard_kept_host_ids,
    "pre_alloc": pre_alloc_with_kept_row,
}


def install_retraction() -> None:
    """Register the hooks once per process (the coordinator is built after the plugin's
    hooks were applied, so they are applied again). If sglang cannot apply one (it only
    logs that), retraction keeps sglang's behaviour: the request is aborted with 503."""
    global _installed, ENABLED
    if _installed:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookSource, HookType

    source = HookSource(plugin_name="echo", dist_name="sglang-echo")
    for key, target in TARGETS.items():
        HookRegistry.register(target, HOOKS[key], HookType.AROUND, source=source)
    HookRegistry.apply_hooks()
    _installed = True
    missing = [t for t in TARGETS.values() if t not in HookRegistry._patched]
    ENABLED = not missing
    if missing:
        logger.warning(
            "sglang-echo: could not wrap %s; a PD decode retraction aborts the request "
            "(503, the client retries) instead of keeping its host KV.",
            ", ".join(missing),
        )
