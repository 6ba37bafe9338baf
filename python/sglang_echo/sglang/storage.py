"""ECHO's memory system over buffers that SGLang owns.

EchoManager works on a host pool (rows ``[layers, N_H + 2, D]``: row 0 the sink, row
N_H + 1 a scratch row) and a device cache (rows ``[layers, N_G + 2, D]``: slot 0 the
sink, slot N_G + 1 scratch). Under SGLang the bytes already exist: HiSparse's pinned host
pool holds every token of every layer, and its device pool holds one row space shared by
all layers. These adapters present those buffers in the manager's shapes, so the
manager's operations run unchanged and no row is stored twice:

- host: SGLang host ids are used as ECHO host ids. The coordinator keeps the first and
  the last host page out of SGLang's allocator, so id 0 (sink) and id N_H + 1 (scratch,
  N_H = host size - 2) are never a request's token.
- device: the coordinator reserves a contiguous run of device rows; ECHO slot ``s`` of
  every layer is device row ``row_base + s`` of that layer's buffer. Its eviction reserve
  is the runtime's (EchoConfig: ``SGLANG_ECHO_EVICTION_RESERVE``, else the default for
  N_G), so the plugin runs the same allocator as EchoKVCache.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from sglang_echo.config import (
    ENV_DEV_CACHE,
    ENV_EVICTION_RESERVE,
    ConfigError,
    EchoSettings,
    default_eviction_reserve,
    eviction_reserve_in_force,
    max_eviction_reserve,
    settings,
)
from sglang_echo.kernels.host_copy import cuda_alias_of_pinned
from sglang_echo.offload.device_cache import DeviceCache


class LayerRows:
    """Per-layer ``[N_G + 2, D]`` row views that index like one ``[layers, N_G + 2, D]``
    tensor (what EchoManager reads: ``rows[layer]``, ``dtype``, ``device``)."""

    def __init__(self, views: Sequence[torch.Tensor]) -> None:
        if not views:
            raise ValueError("LayerRows needs at least one layer")
        first = views[0]
        for v in views:
            if v.dim() != 2 or v.shape != first.shape or v.dtype != first.dtype:
                raise ValueError("every layer's rows must be [N_G + 2, D] of one dtype")
            if v.stride(1) != 1:
                raise ValueError("device rows must be contiguous within a row")
        self.views = list(views)
        self.dtype = first.dtype
        self.device = first.device
        self.shape = (len(self.views), *first.shape)
        self.nbytes = 0  # the bytes belong to SGLang's pool, not to ECHO

    def __getitem__(self, layer: int) -> torch.Tensor:
        return self.views[layer]

    def __len__(self) -> int:
        return len(self.views)

    def element_size(self) -> int:
        return self.views[0].element_size()


def eviction_reserve_for(num_slots: int, environ: Mapping[str, str] | None = None) -> int:
    """The eviction reserve of an N_G = ``num_slots`` cache, as EchoConfig resolves it for
    the runtime (echo_cache.EchoKVCache): ``SGLANG_ECHO_EVICTION_RESERVE`` when set, else
    EchoConfig's default for N_G. N_G is the plugin's (the launcher's resolved plan), not
    the environment's ``NSA_DEV_CACHE_SIZE``. The reserve comes from the process's
    settings (parsed once, by register()), or from ``environ`` when given (tests)."""
    if environ is None:
        asked = settings().eviction_reserve
    else:
        asked = EchoSettings.from_env({**environ, ENV_DEV_CACHE: str(num_slots)}).eviction_reserve
    reserve = eviction_reserve_in_force(num_slots, asked)
    if reserve > max_eviction_reserve(num_slots):
        raise ConfigError(
            f"{ENV_EVICTION_RESERVE}={reserve} would keep more than half of "
            f"the {num_slots} device slots ({ENV_DEV_CACHE}) free after each eviction; use "
            f"at most {max_eviction_reserve(num_slots)} (a few thousand is plenty), or unset "
            f"it for the default ({default_eviction_reserve(num_slots)})."
        )
    return reserve


class ExternalRowsCache(DeviceCache):
    """DeviceCache whose rows are views of another pool: ECHO allocates only metadata.

    ``eviction_reserve`` None: the runtime's (``eviction_reserve_for``)."""

    def __init__(
        self,
        layer_rows: Sequence[torch.Tensor],
        host_tokens: int,
        eviction_reserve: int | None = None,
    ) -> None:
        rows = LayerRows(layer_rows)
        num_slots = rows.shape[1] - 2
        if num_slots < 1:
            raise ValueError("the device cache needs at least one slot besides sink/scratch")
        if eviction_reserve is None:
            eviction_reserve = eviction_reserve_for(num_slots)
        # row_dim=0: the base class allocates an empty row tensor; the real rows follow.
        super().__init__(
            len(rows), num_slots, host_tokens, 0, rows.dtype, rows.device,
            eviction_reserve=eviction_reserve,
        )  # fmt: skip
        self.row_dim = rows.shape[2]
        self.rows = rows


class ExternalHostRows:
    """Host rows ``[layers, N_H + 2, D]`` owned elsewhere, in HostKVPool's interface."""

    def __init__(self, rows: torch.Tensor) -> None:
        if rows.dim() != 3 or rows.shape[1] < 3:
            raise ValueError("host rows must be [layers, N_H + 2, D] with N_H >= 1")
        self.rows = rows
        self.num_layers = rows.shape[0]
        self.num_tokens = rows.shape[1] - 2
        self.row_dim = rows.shape[2]
        self.scratch_row = self.num_tokens + 1
        self.pinned = rows.device.type == "cpu" and torch.cuda.is_available() and rows.is_pinned()
        self.device_view = cuda_alias_of_pinned(rows) if self.pinned else None

    @property
    def nbytes(self) -> int:
        return 0  # SGLang's host pool owns (and reports) these bytes

    def view_for(self, device: torch.device) -> torch.Tensor | None:
        if device.type == "cpu":
            return self.rows
        return self.device_view


def device_layer_rows(
    kv_buffers: Sequence[torch.Tensor], row_base: int, num_slots: int
) -> list[torch.Tensor]:
    """Views ``buffer[row_base : row_base + N_G + 2]`` of each layer's ``[rows, 1, D]`` or
    ``[rows, D]`` device buffer: slot s of the ECHO cache is row ``row_base + s``."""
    views = []
    for buf in kv_buffers:
        flat = buf.view(buf.shape[0], -1)  # a view: ECHO writes must land in SGLang's pool
        end = row_base + num_slots + 2
        if row_base < 0 or end > flat.shape[0]:
            raise ValueError(
                f"ECHO rows [{row_base}, {end}) do not fit a {flat.shape[0]}-row buffer"
            )
        views.append(flat[row_base:end])
    return views


def host_layer_rows(kv_buffer: torch.Tensor) -> torch.Tensor:
    """SGLang's layer-first host buffer ``[layers, size, 1, D]`` as ``[layers, size, D]``."""
    if kv_buffer.dim() == 4:
        if kv_buffer.shape[2] != 1:
            raise ValueError("the host pool must be layer_first with one MLA head")
        kv_buffer = kv_buffer.view(kv_buffer.shape[0], kv_buffer.shape[1], kv_buffer.shape[3])
    if kv_buffer.dim() != 3:
        raise ValueError(f"unexpected host buffer shape {tuple(kv_buffer.shape)}")
    return kv_buffer
