"""The host side of each request's ring: its newest decoded tokens backed up to the host.

Why a collaborator of its own: the coordinator's ring rows (kernels/topk_rows.py) hold a
request's newest RING tokens on the device; every decode step copies the token decoded
last step to a fresh host slot on the backup stream, long before its ring row is written
again. That copy, the host slot it lands in, how many tokens the host pool holds for a
request admitted directly (a retraction keeps those: kept_rows.py) and the host's wait for
the last copy before host ids are freed are one job, apart from admission and release.

Imports sglang: loaded only with the coordinator.
"""

from __future__ import annotations

from typing import Any

import sglang.srt.managers.hisparse_coordinator as hisparse
import torch


class NewestRowBackup:
    """Backs up each request's newest rows (all layers) to their host slots."""

    def __init__(self, coordinator: Any) -> None:
        self.c = coordinator
        # For each request admitted directly (PD: its KV is all in the host pool), how
        # many of its tokens the host pool holds (a retraction keeps those: kept_rows.py).
        self.host_len: dict[int, int] = {}
        self.issued = False  # a decode backup recorded and not yet waited on

    def previous_tokens(
        self,
        seq_lens: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        req_pool_indices_cpu: torch.Tensor,
    ) -> None:
        """The token decoded last step is in its ring row: copy it (all layers) to a fresh
        host slot at its position, long before its row is written again (RING steps
        on); the resolve reads it from the ring meanwhile."""
        c = self.c
        batch_rows: list[int] = []
        host_ids: list[torch.Tensor] = []
        for i, (req_idx, seq_len) in enumerate(
            zip(req_pool_indices_cpu.tolist(), seq_lens_cpu.tolist(), strict=True)
        ):
            if c._skip_first_backup[req_idx]:  # prompt already on the host
                c._skip_first_backup[req_idx] = False
                continue
            batch_rows.append(i)
            host_ids.append(self.host_slot(req_idx, seq_len - 2))
        if not batch_rows:
            return
        rows = torch.tensor(batch_rows, dtype=torch.int64, pin_memory=c.is_cuda)
        rows = rows.to(c.device, non_blocking=True)
        previous = c.ring_row_of(req_pool_indices[rows], seq_lens[rows] - 2)
        self.copy(previous, torch.cat(host_ids))

    def host_slot(self, req_idx: int, position: int) -> torch.Tensor:
        """The host slot of the request's token at ``position`` (allocated by page)."""
        c = self.c
        slot = c.mem_pool_host.alloc_paged_token_slots(
            c.req_to_host_pool, c.req_to_host_pool_allocated_len, req_idx, position, 1
        )
        if req_idx in self.host_len:
            self.host_len[req_idx] = max(self.host_len[req_idx], position + 1)
        return slot

    def copy(self, device_rows: torch.Tensor, host_locs: torch.Tensor) -> None:
        """Copy newest rows (all layers) to their host slots on the backup stream, after
        the forward that wrote them."""
        c = self.c
        device_module = hisparse.device_module
        c.wait_for_pending_backup()
        schedule_stream = device_module.current_stream()
        with device_module.stream(c.decode_backup_stream):
            c.decode_backup_stream.wait_stream(schedule_stream)
            if c.decode_producer_stream is not None:
                c.decode_backup_stream.wait_stream(c.decode_producer_stream)
            c.mem_pool_host.backup_from_device_all_layer(
                c.mem_pool_device, host_locs, device_rows, io_backend="kernel"
            )
            c._backup_done_event.record()
            self.issued = True
            if c.is_cuda:
                host_locs.record_stream(c.decode_backup_stream)
                device_rows.record_stream(c.decode_backup_stream)
        c._has_pending_backup = True

    def finish_on_host(self) -> None:
        """Block the host until the last decode backup has landed, before host ids go
        back to the allocator. wait_for_pending_backup only orders the device streams;
        a freed host id can be handed at once to a PD transfer, whose RDMA write into
        pinned memory follows no stream, and an in-flight backup of this request's
        previous token would then land on the new owner's row. (A device sync on a
        boolean mask happens to wait for it today; this does not rely on that.)"""
        if self.issued:
            self.c._backup_done_event.synchronize()
            self.issued = False
