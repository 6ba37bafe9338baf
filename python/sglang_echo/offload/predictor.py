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


def layer_state(
    layers: int, max_rows: int, device: torch.device | str, value: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every layer's (value, flag) state in two [layers, max_rows + 1] tensors: a predictor
    per layer takes row ``layer`` of each (``state=``), and ``reset_layer_rows`` clears a
    request row in all layers with two launches. Why: a new request is admitted on the
    engine thread, and one reset per layer and predictor cost three launches per layer
    and admission (benchmark/arrival_launches.py counts them) while running requests
    waited."""
    rows = _check_rows(max_rows) + 1
    dev = torch.device(device)
    values = torch.full((layers, rows), value, dtype=torch.float32, device=dev)
    return values, torch.zeros(layers, rows, dtype=torch.bool, device=dev)


def reset_layer_rows(
    state: tuple[torch.Tensor, torch.Tensor], rows: torch.Tensor | list[int], value: float
) -> None:
    """Rows handed to new requests, in every layer of ``layer_state``'s tensors: value
    ``value``, flag False."""
    values, flags = state
    idx = upload(torch.as_tensor(rows, dtype=torch.int64), values.device)  # no host wait
    values.index_fill_(1, idx, value)
    flags.index_fill_(1, idx, False)


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
        self,
        max_rows: int,
        device: torch.device | str = "cpu",
        alpha: float = 0.5,
        state: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """``state``: (theta, finite) rows [max_rows + 1] of ``layer_state(..., +inf)``;
        by default its own."""
        self.max_rows = _check_rows(max_rows)
        self.alpha = _check_alpha(alpha)
        self.scratch_row = self.max_rows
        if state is None:
            theta, finite = layer_state(1, max_rows, device, _INF)
            state = theta[0], finite[0]
        # theta, and True where it is an EMA of finite k-th scores (new values averaged in).
        self.theta, self.finite = state

    @property
    def device(self) -> torch.device:
        return self.theta.device

    def reset(self, rows: torch.Tensor | list[int]) -> None:
        """Rows handed to new requests: back to "no prediction" (+inf)."""
        reset_layer_rows((self.theta.unsqueeze(0), self.finite.unsqueeze(0)), rows, _INF)

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
        self,
        max_rows: int,
        device: torch.device | str = "cpu",
        alpha: float = 0.5,
        state: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """``state``: (offset, known) rows [max_rows + 1] of ``layer_state(..., 0)``; by
        default its own."""
        self.max_rows = _check_rows(max_rows)
        self.alpha = _check_alpha(alpha)
        self.scratch_row = self.max_rows
        if state is None:
            offset, known = layer_state(1, max_rows, device, 0.0)
            state = offset[0], known[0]
        self.offset, self.known = state

    @property
    def device(self) -> torch.device:
        return self.offset.device

    def reset(self, rows: torch.Tensor | list[int]) -> None:
        reset_layer_rows((self.offset.unsqueeze(0), self.known.unsqueeze(0)), rows, 0.0)

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
