"""PD decode retraction that keeps the request's KV where it already is: the host pool.

Why: on a HiSparse decode node every token's KV is in the pinned host pool, so a request
retracted under memory pressure loses nothing but its newest page. sglang 0.5.23 cannot
resume it, though: with the retraction backup ``none`` (what the plugin declares, since
the DSA pool implements no ``cpu_tensor`` copy) ``release_req`` frees everything and the
request is aborted with 503; and its resume path (``resume_retracted_reqs``) would give
the request fresh host slots (``_pre_alloc``) and queue it without ``admit_request_direct``.

Seven AROUND hooks (registered once per process when the first coordinator is built, as
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
- ``discard_kv_cache_backup``: an abort while retracted releases the kept ids (once: a
  row already dropped is not released again);
- ``DecodePreallocQueue._prealloc_required_tokens``: a kept request's resume is charged
  its fill less the logical ids it holds (they are freed just before ``_pre_alloc``);
- ``DecodePreallocQueue.resume_retracted_reqs``: requests whose kept row was dropped
  leave the retracted queue with a 503 before sglang tries to resume any.

Capacity: the plugin's decode check looks at the logical pool only, which is exact while
logical free <= host free (``pool_layout.match_logical_to_host``). sglang's
``release_kv_cache`` frees a retracted request's logical ids while its host ids stay kept,
so the coordinator's kept rows (kept_rows.py) hold as many logical ids as the kept row has host ids until resume.
A kept row then frees no capacity, so when a decode step falls short the coordinator
drops kept rows (newest first) before sglang retracts or aborts a running request: their
host and logical ids go back, and the request ends with a 503 (what stock sglang answers
at once), never with a host-pool crash or a running request's 500.

Any other backup (another pool, a request admitted through staging) takes sglang's path.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from sglang_echo.sglang.kept_rows import SCOPES, KeptHostIds, KeptRows

logger = logging.getLogger(__name__)

TARGETS = {
    "release_req": "sglang.srt.managers.schedule_batch.release_req",
    "backup": "sglang.srt.mem_cache.common.backup_kv_cache",
    "restore": "sglang.srt.mem_cache.common.restore_kv_cache",
    "discard": "sglang.srt.mem_cache.common.discard_kv_cache_backup",
    "pre_alloc": "sglang.srt.disaggregation.decode.DecodePreallocQueue._pre_alloc",
    "required": "sglang.srt.disaggregation.decode.DecodePreallocQueue._prealloc_required_tokens",
    "resume": "sglang.srt.disaggregation.decode.DecodePreallocQueue.resume_retracted_reqs",
}
_installed = False
# Every hook applied: only then does a retraction keep host ids (a partial set would keep
# ids that the resume path then cannot restore).
ENABLED = False


def kept_of(req: Any) -> KeptHostIds | None:
    backup = getattr(getattr(req, "kv", None), "retraction_backup", None)
    kept = getattr(backup, "cpu_tensors", None)
    return kept if isinstance(kept, KeptHostIds) else None


# ------------------------------------------------------------------------- hooks
def release_req_scope(original, *args, **kwargs):
    """AROUND sglang's ``release_req``: the coordinator's retraction scope around it."""
    kept_rows = getattr(kwargs.get("hisparse_coordinator"), "kept_rows", None)
    if not isinstance(kept_rows, KeptRows):  # stock HiSparse, or no coordinator
        return original(*args, **kwargs)
    with kept_rows.scope():
        return original(*args, **kwargs)


def backup_keeping_host_ids(original, req, tree_cache, req_to_token_pool, allocator, backend):
    """AROUND ``backup_kv_cache``: a request whose host ids the scope's coordinator kept
    is backed up by them (True: sglang queues it as retracted)."""
    for kept_rows in reversed(SCOPES):
        kept = kept_rows.claim(req)
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
    with kept.owner.installing(kept):
        return original(queue, req, *args, **kwargs)


def restore_kept_host_ids(original, req, tree_cache, req_to_token_pool, allocator, backend):
    """AROUND ``restore_kv_cache``: a resumed request with kept host ids is admitted
    directly, its KV already in the host pool."""
    kept = kept_of(req)
    if kept is None:
        return original(req, tree_cache, req_to_token_pool, allocator, backend)
    kept.owner.resume(req, kept)
    req.kv.retraction_backup = None
    return None


def discard_kept_host_ids(original, req, tree_cache, backend):
    """AROUND ``discard_kv_cache_backup``: kept host ids of a request that will not
    resume (aborted while retracted, memory released) go back to the host pool."""
    kept = kept_of(req)
    if kept is None:
        return original(req, tree_cache, backend)
    kept.owner.discard(kept)
    req.kv.retraction_backup = None
    return None


def credit_held_logical_ids(original, queue, req):
    """AROUND ``DecodePreallocQueue._prealloc_required_tokens``: a kept request's resume
    needs its fill less the logical ids it holds (freed just before ``_pre_alloc``
    allocates the fill), or it would wait for both to fit in the free pool."""
    full, swa = original(queue, req)
    kept = kept_of(req)
    if kept is not None and kept.logical is not None:
        full -= kept.logical.numel()
    return full, swa


DROPPED_MESSAGE = (
    "Retracted under decode memory pressure; its KV, kept in the host pool for resume, "
    "was released because the running requests needed the room. Retry later; to keep "
    "retracted requests until they resume, give the decode node a larger KV pool "
    "(--max-total-tokens) or fewer running requests (--max-running-requests)."
)


def abort_dropped(original, queue, *args, **kwargs):
    """AROUND ``DecodePreallocQueue.resume_retracted_reqs``: requests whose kept row was
    dropped (their KV is gone) leave the retracted queue first, each with one 503, as
    sglang's abort of a retracted request does. A request dropped inside sglang's retract
    loop joins the queue only after it, hence here rather than at the drop."""
    dropped = [req for req in queue.retracted_queue if _dropped(req)]
    if dropped:
        queue.retracted_queue = [req for req in queue.retracted_queue if not _dropped(req)]
        for req in dropped:
            _send_503(queue.scheduler, req)
    return original(queue, *args, **kwargs)


def _dropped(req: Any) -> bool:
    kept = kept_of(req)
    return kept is not None and kept.dropped


def _send_503(scheduler: Any, req: Any) -> None:
    from sglang.srt.managers.schedule_batch import FINISH_ABORT
    from sglang.srt.managers.scheduler import _make_abort_req

    req.kv.retraction_backup = None
    reason = FINISH_ABORT(DROPPED_MESSAGE, status_code=HTTPStatus.SERVICE_UNAVAILABLE)
    req.to_finish = reason
    logger.warning("sglang-echo: aborted retracted request %s: %s", req.rid, DROPPED_MESSAGE)
    scheduler.send_abort_output(_make_abort_req(req, finished_reason=reason.to_json()), req)


HOOKS = {
    "release_req": release_req_scope,
    "backup": backup_keeping_host_ids,
    "restore": restore_kept_host_ids,
    "discard": discard_kept_host_ids,
    "pre_alloc": pre_alloc_with_kept_row,
    "required": credit_held_logical_ids,
    "resume": abort_dropped,
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
