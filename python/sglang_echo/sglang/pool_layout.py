"""ECHO's layout over sglang's HiSparse pools, made once when the coordinator is built.

Why a module of its own: these steps run once, before any request, and each changes what
sglang's allocators can hand out for the rest of the process. Kept apart from the
coordinator's per-step lifecycle, each can be read (and tested) as one rule:

- the host pool's first and last pages are ECHO's (the sink row 0 and the scratch row);
- the logical pool never outgrows what the host pool can serve (logical free <= host free);
- N_G + 1 contiguous device rows after the padding page are ECHO's cache;
- HiSparse's per-request buffer tables are emptied (ECHO does not use them);
- on the CPU (tests), the host pool's copies are torch copies.

Imports sglang's pools only through the objects it is given.
"""

from __future__ import annotations

from typing import Any

import torch

from sglang_echo.config import ENV_DEV_CACHE, ConfigError
from sglang_echo.sglang.storage import host_layer_rows


class CpuStream(torch.cpu.Stream):
    """torch.cpu.Stream with HiSparse's ``synchronize``: CPU work is already synchronous."""

    def synchronize(self) -> None:
        return None


def use_torch_transfers(coordinator: Any) -> None:
    """sglang's host<->device copy ops and stream sync exist on CUDA/ROCm/XPU only. On the
    CPU (where sglang does not serve; our tests run there) the coordinator's host pool
    gets the same copies in torch, synchronously."""
    host = coordinator.mem_pool_host

    def backup_from_device_all_layer(device_pool, host_indices, device_indices, io_backend):
        rows = host_layer_rows(host.kv_buffer)
        ids = host_indices.to(torch.int64)
        for layer, buf in enumerate(device_pool.kv_buffer):
            src = buf.view(buf.shape[0], -1).index_select(0, device_indices.to(torch.int64))
            rows[layer].index_copy_(0, ids, src.to(rows.dtype))

    def load_to_device_per_layer(
        device_pool, host_indices, device_indices, layer_id, io_backend, *, is_draft=False
    ):
        rows = host_layer_rows(host.kv_buffer)[layer_id]
        buf = device_pool.kv_buffer[layer_id]
        flat = buf.view(buf.shape[0], -1)
        src = rows.index_select(0, host_indices.to(torch.int64))
        flat.index_copy_(0, device_indices.to(torch.int64), src.to(flat.dtype))

    host.backup_from_device_all_layer = backup_from_device_all_layer
    host.load_to_device_per_layer = load_to_device_per_layer
    coordinator.write_staging_stream = CpuStream()
    coordinator.decode_backup_stream = CpuStream()


PER_REQUEST_BUFFERS = (
    "req_to_device_buffer",
    "req_device_buffer_tokens",
    "req_device_buffer_token_locs",
    "lru_slots",
    "_lru_init",
    "raw_indices_buffer",
)


def drop_per_request_buffers(coordinator: Any) -> None:
    """HiSparse's per-request, per-layer buffer tables (about a megabyte per request slot
    for 61 layers) are unused by ECHO: replace them by empty tensors, so a HiSparse path that
    ECHO does not override fails loudly instead of reading stale tables."""
    for name in PER_REQUEST_BUFFERS:
        old = getattr(coordinator, name)
        setattr(coordinator, name, torch.empty(0, dtype=old.dtype, device=old.device))


def reserve_host_pages(host: Any) -> torch.Tensor:
    """Keep the first host page (id 0: ECHO's sink) and the last (id size-1: ECHO's
    scratch row) out of sglang's host allocator for good."""
    page = host.page_size
    total = host.available_size()
    if total != host.size or total % page or total < 3 * page:
        raise ConfigError(
            f"sglang-echo needs a fresh host pool of >= 3 pages, got {total} free of "
            f"{host.size} slots (page {page}); raise --max-total-tokens."
        )
    every = host.alloc(total)
    keep = (every < page) | (every >= host.size - page)
    host.free(every[~keep])
    reserved = every[keep]
    if reserved.numel() != 2 * page:
        raise ConfigError("sglang-echo: could not reserve the host pool's first and last page")
    return reserved


def match_logical_to_host(logical: Any, host: Any, page: int, device: Any) -> torch.Tensor:
    """Every logical token id must be able to get a host slot (PD pre-allocation and each
    decode backup take one per token). sglang sizes the host pool one page above the
    logical pool, and ECHO keeps two host pages, so the logical pool would be one page
    larger than the host pool can serve: once it filled, the host allocation would raise.
    Hold the excess logical pages for good instead, so that admission and retraction see
    the capacity the host pool really has.

    The invariant, logical free <= host free, then holds at every moment (a running
    request holds at least as many logical ids as host ids: the host lags one token), and
    checks on the logical pool alone also cover the host pool. A retraction that keeps
    host ids holds as many logical ids until resume, to keep it (kept_rows.py)."""
    excess = logical.available_size() - host.available_size()
    if excess <= 0:
        return torch.empty(0, dtype=torch.int64, device=device)
    excess = -(-excess // page) * page
    ids = logical.alloc(excess)
    if ids is None:
        raise ConfigError(
            f"sglang-echo: could not hold {excess} logical token ids to match the host "
            "pool; the pool was used before the coordinator."
        )
    return ids


def reserve_device_rows(allocator: Any, num_slots: int, page: int) -> tuple[torch.Tensor, int]:
    """Reserve N_G + 1 contiguous device rows right after the padding page; ECHO's sink
    slot 0 then sits on the padding page's last row (never written by ECHO). Returns the
    rows and the row base (slot s of every layer is row ``row_base + s``)."""
    need = -(-(num_slots + 1) // page) * page
    available = allocator.available_size()
    if available < need + page:
        raise ConfigError(
            f"{ENV_DEV_CACHE}={num_slots} needs {need} device rows plus one "
            f"{page}-row page per running request, but the device pool has {available} "
            f"free rows; lower {ENV_DEV_CACHE} or give the KV pool more GPU memory "
            "(--mem-fraction-static)."
        )
    rows = allocator.alloc(need)
    if rows is None:
        raise ConfigError(f"sglang-echo: the device allocator refused {need} rows")
    rows_cpu = rows.cpu()
    first = int(rows_cpu[0])
    if first != page or not torch.equal(rows_cpu, torch.arange(first, first + need)):
        allocator.free(rows)
        raise ConfigError(
            "sglang-echo: the device rows for the ECHO cache must be contiguous and "
            "start after the padding page; the pool was used before the coordinator."
        )
    return rows, first - 1
