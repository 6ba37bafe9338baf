"""A finished request's end: its newest page freed and its host ids released.

Why a collaborator of its own: a finished request's host ids must be unmapped from ECHO's
cache in every layer before they go back to sglang's host pool (a freed id still mapped
would give its next owner another token's rows), and the requests finished while sglang
processes one step's results release together, in one ``EchoManager.release`` when the
outermost ``per_step`` scope closes (step_release.py); finishes outside a step's
processing (aborts, retraction, transfer failures) release at once. The bookkeeping for
that (rows waiting, the scope depth) is this object's alone.

Imports sglang: loaded only with the coordinator.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import sglang.srt.managers.hisparse_coordinator as hisparse
import torch


class HostRelease:
    """Ends requests' decode state and releases their host ids, once per step."""

    def __init__(self, coordinator: Any) -> None:
        self.c = coordinator
        # Finished requests' host-id rows (-1 padded) not yet released: one release per
        # step (per_step), or at once outside a step's result processing.
        self.finished_rows: list[torch.Tensor] = []
        self.depth = 0

    def release_now(self, req_pool_idx: int) -> torch.Tensor:
        """The request's host ids, unmapped from ECHO's cache in every layer: a host id
        freed while still mapped would give its next owner another token's rows."""
        c = self.c
        host_ids = c.mem_pool_host.allocated_host_indices(
            c.req_to_host_pool,
            req_pool_idx,
            c.req_to_host_pool_allocated_len[req_pool_idx],
        )
        if host_ids.numel() > 0:
            c.manager.release(host_ids.to(c.cache.device, torch.int64))
        return host_ids

    def host_id_row(self, req_pool_idx: int) -> torch.Tensor | None:
        """A copy of the request's host-id row over its allocated pages (-1 = none), as
        ``allocated_host_indices`` reads it, without its device-to-host filter."""
        c = self.c
        allocated = int(c.req_to_host_pool_allocated_len[req_pool_idx])
        if allocated <= 0:
            return None
        page = c.mem_pool_host.page_size
        length = min(-(-allocated // page) * page, c.req_to_host_pool.shape[1])
        return c.req_to_host_pool[req_pool_idx, :length].clone()

    @contextmanager
    def per_step(self) -> Iterator[None]:
        """Requests finished inside release their host ids together when the outermost
        scope closes (sglang's processing of one step's results: release_finished_together).
        Until then their host ids stay allocated in sglang's host pool, so none can be
        reused while ECHO's maps still name it."""
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            if self.depth == 0:
                self.release_finished()

    def release_finished(self) -> None:
        """Every finished request's host ids not yet released: unmapped from ECHO's cache
        in every layer in ONE EchoManager.release, then (the host having waited for the
        last decode backup) given back to sglang's host pool, in that order."""
        c = self.c
        rows, self.finished_rows = self.finished_rows, []
        if not rows:
            return
        ids = torch.cat(rows) if len(rows) > 1 else rows[0]
        ids = ids[ids >= 0]
        if ids.numel() == 0:
            return
        if c.decode_producer_stream is not None:
            hisparse.device_module.current_stream().wait_stream(c.decode_producer_stream)
        c.manager.release(ids.to(c.cache.device, torch.int64))
        c.backup.finish_on_host()
        c.mem_pool_host.free(ids)

    def finish(self, req) -> None:
        """Finish, abort or retract: free the newest page and unmap the request's token
        ids now; its host ids are released from ECHO's cache, then given back to the
        host pool, with the other requests finished in this step (or at once outside a
        step's result processing)."""
        self.end_decode_state(req)
        idx = req.kv.req_pool_idx
        row = self.host_id_row(idx)
        if row is not None:
            self.finished_rows.append(row)
        self.clear_host_row(idx)
        if self.depth == 0:
            self.release_finished()

    def end_decode_state(self, req) -> None:
        """After the in-flight forward and the last backup: the newest page freed and the
        request's token ids unmapped from it."""
        c = self.c
        if c.decode_producer_stream is not None:
            hisparse.device_module.current_stream().wait_stream(c.decode_producer_stream)
        c.wait_for_pending_backup()
        idx = req.kv.req_pool_idx
        page = c.newest_page.pop(idx, None)
        if page is not None:
            c.token_to_kv_pool_allocator.free_hisparse_indices(page)
            logical = c.req_to_token_pool.req_to_token[idx, : req.kv.kv_allocated_len]
            c.mem_pool_device.full_to_hisparse_device_index_mapping[logical.to(torch.int64)] = 0
            c.ring_rows[idx] = 0
            c.ring_start[idx] = 0
        # Without a page the request ended during prefill: release_kv_cache frees its
        # prompt rows through the mapping, as in HiSparse.

    def clear_host_row(self, idx: int) -> None:
        c = self.c
        c.req_to_host_pool[idx, :] = -1
        c.req_to_host_pool_allocated_len[idx] = 0
        c._skip_first_backup[idx] = False
        c.backup.host_len.pop(idx, None)
