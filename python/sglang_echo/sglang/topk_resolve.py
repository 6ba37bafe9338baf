"""Decode top-k positions -> device rows, through ECHO's per-layer cache.

This is the body of ``EchoCoordinator.swap_in_selected_pages``, kept free of sglang so
that it is tested on its own. Inputs are SGLang's: per request its pool index, its
sequence length (the current token included) and the indexer's top-k token positions
(-1 = none). Each position becomes:

- a row of the request's ring (its own device page), for its newest decoded tokens: the
  current one (written this step, not yet on the host) and up to 63 before it, which
  stay in place there (kernels/topk_rows.py);
- ``row_base + slot`` for every earlier token: its host id (SGLang's
  ``req_to_host_pool``) resolved by EchoManager, which protects hits, evicts and recalls
  misses, so the row holds that token's bytes for this layer;
- -1 for padding lanes, for rows past ``num_real_reqs`` (CUDA-graph padding), for
  requests that hold no ECHO state (the capture-time dummy request 0), and for top-k
  rows past the batch's requests: sglang's DSA backend pads the top-k tensor with -1
  rows to the number of q rows (``_pad_topk_indices``), which can exceed the number of
  requests, so rows are matched to requests by position and the rest are padding. An
  IDLE batch (a DP-attention rank with nothing to run) has zero rows.

One step's selections must all be resident at once, so at most N_G // top-k requests
can decode together (``max_rows``). A graph batch may be padded past that (the padding
selects nothing), so the resolve cannot tell real rows from padding by shape; the
coordinator calls ``check_batch`` with the step's real request count on the host, where
the scheduler builds the batch, and a batch past the limit fails there, loudly.

Every shape is fixed by the batch; counts stay on the device; so the call can be captured
in a CUDA graph whenever EchoManager's resolve can.
"""

from __future__ import annotations

import torch

from sglang_echo.config import ENV_DEV_CACHE, ConfigError, dev_cache_for, max_running
from sglang_echo.kernels.topk_rows import host_ids, host_ids_reference, rows, rows_reference
from sglang_echo.offload.manager import EchoManager


class TopkToRows:
    def __init__(
        self,
        manager: EchoManager,
        row_base: int,
        req_to_host: torch.Tensor,
        ring_rows: torch.Tensor,
        ring_start: torch.Tensor,
        top_k: int,
        out: torch.Tensor,
    ) -> None:
        """``req_to_host`` [requests, positions] int64 host ids (-1 none); ``ring_rows``
        [requests, RING] int64 (all 0 = no ECHO state) and ``ring_start`` [requests] int64:
        each request's ring; ``out`` [requests, >= top_k] int32, the static table FlashMLA
        reads (written in place, so graph replays see new rows)."""
        self.manager = manager
        self.row_base = row_base
        self.req_to_host = req_to_host
        self.ring_rows = ring_rows
        self.ring_start = ring_start
        self.top_k = top_k
        self.out = out
        # One decode step selects at most rows x top-k tokens per layer, and they must all
        # be resident at once (config.max_running, the capacity rule); the plugin's
        # arguments bound the running requests by the same rule.
        self.max_rows = max_running(manager.cache.num_slots, top_k)
        if self.max_rows < 1:
            raise ValueError(
                f"the ECHO device cache ({manager.cache.num_slots} slots) cannot hold one "
                f"request's top-{top_k}; raise NSA_DEV_CACHE_SIZE to >= {top_k}"
            )

    def check_batch(self, num_reqs: int) -> None:
        """A decode step of ``num_reqs`` real requests (a host-side count: no device read)
        must fit the cache: past ``max_rows`` the resolve would give the extra requests no
        rows and attention would read nothing. The plugin's --max-running-requests bound
        makes this unreachable in a correct configuration."""
        if num_reqs > self.max_rows:
            n_g = self.manager.cache.num_slots
            raise ConfigError(
                f"sglang-echo: this decode batch has {num_reqs} requests, but the ECHO "
                f"device cache holds one step's selections of at most {ENV_DEV_CACHE} "
                f"{n_g} // top-k {self.top_k} = {self.max_rows} requests; set "
                f"{ENV_DEV_CACHE} >= {dev_cache_for(num_reqs, self.top_k)}, or lower "
                f"--max-running-requests to <= {self.max_rows} per attention-DP rank."
            )

    def __call__(
        self,
        layer: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        topk: torch.Tensor,
        num_real_reqs: torch.Tensor,
    ) -> torch.Tensor:
        num_rows, width = topk.shape
        out = self._output(num_rows, width, topk.device)
        # Row i is request i; rows past the requests (sglang's padding to the q rows) and
        # past max_rows (only padding can be there: check_batch) select nothing.
        n = min(num_rows, req_pool_indices.shape[0], self.max_rows)
        device = topk.device
        req = req_pool_indices[:n]
        seq = seq_lens[:n]
        num_real = num_real_reqs.to(device).reshape(1)
        # One launch each side of the resolve with the kernels (kernels/topk_rows.py),
        # their torch reference elsewhere.
        kernels = self.manager.use_kernels
        to_ids = host_ids if kernels else host_ids_reference
        to_rows = rows if kernels else rows_reference
        slots = None
        if n > 0:
            lookup = to_ids(
                topk, req, seq, self.ring_rows, self.ring_start, self.req_to_host, num_real
            )
            # Distinct host ids: a top-k's positions are distinct, and no two requests
            # share a host id (the plugin runs sglang with the radix cache off, so no
            # prefix is shared), which spares the allocation its duplicate look-up.
            slots = self.manager.resolve(layer, lookup, distinct=True)
        to_rows(
            slots, topk, req, seq, self.ring_rows, self.ring_start, num_real, self.row_base, out
        )
        return out

    def _output(self, rows: int, width: int, device: torch.device) -> torch.Tensor:
        """The static table's first ``rows`` rows; a fresh table for an eager batch padded
        past it (a CUDA graph never is: its rows are the captured batch sizes)."""
        if rows <= self.out.shape[0] and width <= self.out.shape[1]:
            return self.out[:rows, :width]
        return torch.full((rows, width), -1, dtype=self.out.dtype, device=device)
