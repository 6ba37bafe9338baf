"""Pinned host memory that holds every token's MLA rows for every layer.

Row 0 is the padding sink and row N_H + 1 a scratch row that masked writes land in, so
the fixed-shape ops never need a data-dependent index. On CUDA the pool is page-locked
and also exposed as a CUDA tensor aliasing the same bytes (unified virtual addressing):
device kernels then read and write host rows directly, with no host synchronisation.
"""

from __future__ import annotations

import torch

from sglang_echo.config import ConfigError
from sglang_echo.kernels.host_copy import cuda_alias_of_pinned


class HostKVPool:
    def __init__(
        self,
        num_layers: int,
        num_tokens: int,
        row_dim: int,
        dtype: torch.dtype,
        pin: bool | None = None,
    ) -> None:
        self.num_layers = num_layers
        self.num_tokens = num_tokens
        self.row_dim = row_dim
        self.scratch_row = num_tokens + 1
        pin = torch.cuda.is_available() if pin is None else pin
        shape = (num_layers, num_tokens + 2, row_dim)
        nbytes = (
            num_layers * (num_tokens + 2) * row_dim * torch.empty((), dtype=dtype).element_size()
        )
        try:
            self.rows = torch.zeros(shape, dtype=dtype, pin_memory=pin)
        except (RuntimeError, MemoryError) as exc:
            what = "pin" if pin else "allocate"
            raise ConfigError(
                f"could not {what} the host KV pool: {nbytes / 2**30:.2f} GiB asked for "
                f"({num_tokens} tokens x {num_layers} layers x {row_dim} values); lower "
                f"--max-total-tokens or free host memory ({exc})."
            ) from exc
        self.pinned = pin
        self.device_view = cuda_alias_of_pinned(self.rows) if pin else None

    @property
    def nbytes(self) -> int:
        return self.rows.nbytes

    def view_for(self, device: torch.device) -> torch.Tensor | None:
        """Host rows addressable by kernels on ``device`` (None: host-side copies needed)."""
        if device.type == "cpu":
            return self.rows
        return self.device_view
