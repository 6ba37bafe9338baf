"""Score predictions that let prefetch start before the exact top-k is known.

Prefetch is lossless by construction (docs/ARCHITECTURE.md section 6): the exact top-k
always decides what attention reads, so a prediction only changes *when* bytes move. A
bad prediction costs bandwidth (decode: fetching tokens that lose) or coverage (prefill:
fewer tokens certain enough to fetch early), never correctness.

Both predictors keep per-request state in fixed-shape device tensors indexed by the
request's row in the request table (``SeqState.row``), so their updates are plain tensor
ops: no host synchronisation, capturable in a CUDA graph. Row ``max_rows`` is a scratch
row that padded or inactive lanes write into; it is restored after every update.
"""

from __future__ import annotations

import torch

from sglang_echo.kernels.host_copy import upload

_INF = float("inf")


def _check_alpha(alpha: float) -> float:
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"EMA weight alpha must be in (0, 1], got {alpha}")
    return float(alpha)


def _check_rows(max_rows: int) -> int:
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1 (one per request-table row), got {max_rows}")
    return int(max_rows)


class DecodeThresholdPredictor:
    """theta[row] = EMA (weight ``alpha`` on the newest value) of the request's previous
    exact k-th indexer scores; decode prefetches miss tokens that score above theta.

    Choices:
    - No prediction yet (a new request): theta = +inf, i.e. prefetch nothing; the first
      decode step of a request falls back to recalling after the exact top-k.
    - A k-th score of -inf means the request saw fewer than k keys, so every visible key
      is selected: theta becomes -inf (prefetch every visible miss, which is exact) and
      the next finite k-th score *replaces* theta rather than being averaged with -inf
      (an EMA with -inf would stay -inf for ever).
    """

    def __init__(
        self, max_rows: int, device: torch.device | str = "cpu", alpha: float = 0.5
    ) -> None:
        self.max_rows = _check_rows(max_rows)
        self.alpha = _check_alpha(alpha)
        self.scratch_row = self.max_rows
        dev = torch.device(device)
        self.theta = torch.full((self.max_rows + 1,), _INF, dtype=torch.float32, device=dev)
        # True where theta is an EMA of finite k-th scores (new values are averaged in).
        self.finite = torch.zeros(self.max_rows + 1, dtype=torch.bool, device=dev)

    @property
    def device(self) -> torch.device:
        return self.theta.device

    def reset(self, rows: torch.Tensor | list[int]) -> None:
        """Rows handed to new requests: back to "no prediction" (+inf)."""
        idx = upload(torch.as_tensor(rows, dtype=torch.int64), self.device)  # no host wait
        self.theta.index_fill_(0, idx, _INF)
        self.finite.index_fill_(0, idx, False)

    def predict(self, rows: torch.Tensor) -> torch.Tensor:
        """theta for each lane's row: [B] float32 (+inf = prefetch nothing)."""
        return self.theta[rows.long()]

    def update(
        self, kth: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor | None = None
    ) -> None:
        """Fold this step's exact k-th scores [B] into the rows [B] (distinct where valid).

        ``valid`` [B] masks padded lanes (they write the scratch row). Fixed shapes only.
        """
        if kth.shape != rows.shape or kth.dim() != 1:
            raise ValueError(
                f"expected kth [B] and rows [B], got {tuple(kth.shape)} and {tuple(rows.shape)}"
            )
        idx = rows.long()
        if valid is not None:
            idx = torch.where(valid, idx, torch.full_like(idx, self.scratch_row))
        new = kth.to(torch.float32)
        old = self.theta[idx]
        new_finite = torch.isfinite(new)
        blend = self.finite[idx] & new_finite
        value = torch.where(blend, self.alpha * new + (1.0 - self.alpha) * old, new)
        self.theta.index_copy_(0, idx, value)
        self.finite.index_copy_(0, idx, new_finite)
        # narrow().fill_(): a device-side fill (indexed assignment of a Python scalar
        # copies from the host, which CUDA-graph capture rejects).
        self.theta.narrow(0, self.scratch_row, 1).fill_(_INF)
        self.finite.narrow(0, self.scratch_row, 1).fill_(False)


class PrefillOffsetPredictor:
    """Per-request offset subtracted from prefill indexer scores before the prefetch
    histogram (kernels/prefill_prefetch.py).

    The histogram's 256 bins are the top 8 bits of the order-preserving key of
    (score - offset): sign and 7 exponent bits, so a bin spans a factor of 4 in
    |score - offset|. Tokens strictly above the bin holding the k-th value are certain
    top-k members; the ambiguous bin's width is proportional to |k-th score - offset|.
    A good offset is therefore a close estimate of the row's k-th score.

    Choice: the offset of a request is an EMA of the *mean* exact k-th score over the rows
    of its previous query blocks (weight ``alpha``; the default alpha 0.5 weighs the newest
    block as much as all before it). Measured on
    synthetic indexer scores (``benchmark/kernels/prefill_prefetch_bench.py`` prints the
    census; tests/test_kernel_prefill_prefetch.py checks the shrink): the block mean
    matched the best single per-request value (the current block's own mean) and beat the
    block max or min, because the spread of k-th scores across a block's rows, not the
    drift between blocks, dominates the error. A per-row offset equal to the row's own
    k-th score would leave only exact ties ambiguous, but the row's k-th score is what
    the exact top-k computes later, so it is not available when the histogram runs.

    No prediction yet (the request's first query block): offset 0, the plain histogram
    (still lossless, fewer candidates). ``predict`` also returns which rows had one.
    """

    def __init__(
        self, max_rows: int, device: torch.device | str = "cpu", alpha: float = 0.5
    ) -> None:
        self.max_rows = _check_rows(max_rows)
        self.alpha = _check_alpha(alpha)
        self.scratch_row = self.max_rows
        dev = torch.device(device)
        self.offset = torch.zeros(self.max_rows + 1, dtype=torch.float32, device=dev)
        self.known = torch.zeros(self.max_rows + 1, dtype=torch.bool, device=dev)

    @property
    def device(self) -> torch.device:
        return self.offset.device

    def reset(self, rows: torch.Tensor | list[int]) -> None:
        idx = upload(torch.as_tensor(rows, dtype=torch.int64), self.device)  # no host wait
        self.offset.index_fill_(0, idx, 0.0)
        self.known.index_fill_(0, idx, False)

    def predict(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per query row [R] (each lane's request row): (offset [R] float32, known [R])."""
        idx = rows.long()
        return self.offset[idx], self.known[idx]

    def update(
        self, kth: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor | None = None
    ) -> None:
        """Fold one query block's exact k-th scores [R] into the requests owning the rows.

        ``rows`` [R] gives each query row's request row (repeats expected: a block holds
        many queries of one request); padded lanes may name any row, e.g. the scratch
        row, with ``valid`` False. Non-finite k-th scores (fewer than k visible keys) and
        masked lanes are ignored. Fixed shapes only; the float sums use atomics on CUDA,
        so the offset may differ in its last bits between runs (prefetch stays lossless).
        """
        if kth.shape != rows.shape or kth.dim() != 1:
            raise ValueError(
                f"expected kth [R] and rows [R], got {tuple(kth.shape)} and {tuple(rows.shape)}"
            )
        value = kth.to(torch.float32)
        use = torch.isfinite(value)
        if valid is not None:
            use = use & valid
        # Lanes not used add (0, 0) to their row: no effect, no data-dependent indexing.
        lane = torch.stack((torch.where(use, value, 0.0), use.to(torch.float32)), 1)
        acc = torch.zeros(self.offset.shape[0], 2, device=self.device).index_add_(0, rows, lane)
        seen = acc[:, 1] > 0
        block_mean = acc[:, 0] / acc[:, 1].clamp(min=1.0)
        target = torch.where(
            self.known, torch.lerp(self.offset, block_mean, self.alpha), block_mean
        )
        self.offset.copy_(torch.where(seen, target, self.offset))
        self.known.logical_or_(seen)
