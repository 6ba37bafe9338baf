"""The lightning indexer: scores every earlier token for each query and keeps the exact top-k.

score(t, s) = sum_h w[t, h] * relu(q[t, h] . k[s] * d^-1/2), over s <= t; w = weights_proj(x)
times H^-1/2. Keys are LayerNorm'ed, and the first rope dims of q and k are roped half-split.
``indexer_mode = "fp8_hadamard"`` is DeepSeek's deployed indexer: q and k are rotated by a
Hadamard matrix and stored in float8 e4m3 with per-row fp32 scales; each key is one packed
row of D + 4 bytes padded to 144 (SGLang's 132-byte index-K row, 16-byte aligned; see
``config.fp8_row_bytes``), the query scale and d^-1/2 fold into
the head weights. On CUDA, decode scores these rows with the Triton kernel
(kernels/indexer.py); the torch functions here compute the same formula and are the CPU path.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from sglang_echo.kernels.invariant_matmul import invariant_linear
from sglang_echo.kernels.pick_locs import pick_locs, pick_locs_reference
from sglang_echo.kernels.topk import select_topk, topk_positions
from sglang_echo.model.config import DeepseekV32Config, fp8_row_bytes
from sglang_echo.model.forward_batch import ForwardBatch
from sglang_echo.model.layers import Linear
from sglang_echo.model.rope import apply_rope_half
from sglang_echo.model.selection_hooks import DecodeSelectionHooks, PrefillSelectionHooks

FP8_E4M3_MAX = 448.0
# Largest [queries x heads x keys] float32 score block materialized at once (elements).
SCORE_BLOCK_ELEMENTS = 1 << 25
# The indexer's kernels (fp8 decode logits, decode prefetch, top-k) run on CUDA; tests set
# this to run them through the Triton interpreter on the CPU too.
INDEXER_KERNELS_ON_CPU = False


def use_kernels(q: torch.Tensor) -> bool:
    """Whether the indexer's Triton kernels run for this query tensor."""
    return q.is_cuda or INDEXER_KERNELS_ON_CPU


@functools.lru_cache(maxsize=16)
def hadamard_matrix(n: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Orthonormal Sylvester-Hadamard matrix; rotating q and k by it preserves q . k.

    Built once per (n, device, dtype) on the device itself: the first (eager) decode step
    creates it, so a captured CUDA graph only reads it.
    """
    if n & (n - 1):
        raise ValueError(f"Hadamard rotation needs a power-of-two dim, got {n}")
    h = torch.ones(1, 1, dtype=torch.float32, device=device)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return (h / math.sqrt(n)).to(dtype)


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows (last dim) -> e4m3 values and their fp32 scales (amax / 448)."""
    scale = x.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / FP8_E4M3_MAX
    return (x.float() / scale).to(torch.float8_e4m3fn), scale.squeeze(-1)


def fp8_round_trip(x: torch.Tensor) -> torch.Tensor:
    """Quantize rows to e4m3 with a per-row scale, then dequantize (for accuracy checks)."""
    q, scale = quantize_fp8(x)
    return (q.float() * scale.unsqueeze(-1)).to(x.dtype)


def pack_fp8_rows(
    values: torch.Tensor, scales: torch.Tensor, row_bytes: int | None = None
) -> torch.Tensor:
    """e4m3 [T, D] + fp32 [T] -> uint8 [T, row_bytes]: one row per key, scale after it,
    zero padding up to ``row_bytes`` (default D + 4, none; the model uses
    ``fp8_row_bytes``)."""
    dim = values.shape[-1]
    row_bytes = dim + 4 if row_bytes is None else row_bytes
    if row_bytes < dim + 4 or row_bytes % 4:
        raise ValueError(f"row_bytes must be >= {dim + 4} and a multiple of 4, got {row_bytes}")
    parts = [values.view(torch.uint8), scales.float().view(torch.uint8).view(-1, 4)]
    if row_bytes > dim + 4:
        parts.append(values.new_zeros(values.shape[0], row_bytes - dim - 4, dtype=torch.uint8))
    return torch.cat(parts, 1)


def unpack_fp8_rows(
    rows: torch.Tensor, dim: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 [..., row_bytes] -> (e4m3 [..., D], fp32 [...]) views of the same bytes; D
    defaults to row_bytes - 4 (unpadded rows)."""
    dim = rows.shape[-1] - 4 if dim is None else dim
    values = rows[..., :dim].view(torch.float8_e4m3fn)
    scales = rows.view(torch.float32)[..., dim // 4]  # strided view, no copy
    return values, scales


def fp8_index_scores(
    q: torch.Tensor, weights: torch.Tensor, key_rows: torch.Tensor
) -> torch.Tensor:
    """q [G, Q, H, D] e4m3, weights [G, Q, H] (scales folded in), packed key rows
    [G, L, row_bytes >= D + 4] -> [G, Q, L] fp32: k_scale * sum_h w_h relu(q_h . k)."""
    keys, scales = unpack_fp8_rows(key_rows, q.shape[-1])
    logits = F.relu(torch.matmul(q.float(), keys.float().transpose(-1, -2).unsqueeze(1)))
    return torch.matmul(weights.unsqueeze(-2), logits).squeeze(-2) * scales.unsqueeze(1)


def index_scores(
    q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, softmax_scale: float
) -> torch.Tensor:
    """q [G, Q, H, D], weights [G, Q, H] fp32, keys [G, L, D] -> scores [G, Q, L] fp32."""
    logits = torch.matmul(q.float(), keys.float().transpose(-1, -2).unsqueeze(1)) * softmax_scale
    return torch.matmul(weights.unsqueeze(-2), F.relu(logits)).squeeze(-2)


def exact_topk(
    scores: torch.Tensor,
    query_pos: torch.Tensor,
    topk: int,
    use_kernel: bool,
    with_kth: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``select_topk`` with the k-th score, for scores [R, L] and query_pos [R]: positions
    [R, topk] and k-th scores [R]. With ``use_kernel`` (CUDA, or the interpreter in tests)
    the kernel top-k (the radix select) picks the same set, listed by ascending position
    instead of by score (offload and no-offload both take this path, so their outputs stay
    equal); the k-th score is the smallest picked score, -inf where fewer than ``topk``
    keys are visible, exactly as ``select_topk`` reports it. Only the prefetchers read the k-th
    score: without ``with_kth`` it is not computed (None)."""
    if not use_kernel:
        if not with_kth:
            return select_topk(scores.unsqueeze(1), query_pos.unsqueeze(1), topk).squeeze(1), None
        pos, kth = select_topk(scores.unsqueeze(1), query_pos.unsqueeze(1), topk, True)
        return pos.squeeze(1), kth.squeeze(1)
    scores = scores.float()
    pos = topk_positions(scores, query_pos, topk)
    if not with_kth:
        return pos, None
    missing = pos < 0
    picked = torch.gather(scores, 1, pos.clamp(min=0)).masked_fill(missing, float("inf"))
    kth = picked.amin(dim=1).masked_fill(missing.any(dim=1), float("-inf"))
    return pos, kth


def positions_to_locs(
    positions: torch.Tensor, context_locs: torch.Tensor, kernels: bool = False
) -> torch.Tensor:
    """positions [G, Q, K] (-1 none), context_locs [G, L] -> token locations, -1 kept.
    ``kernels``: one launch (kernels/pick_locs.py) instead of torch's five."""
    if kernels:
        return pick_locs(positions, context_locs)
    return pick_locs_reference(positions, context_locs)


class LightningIndexer(nn.Module):
    def __init__(self, config: DeepseekV32Config) -> None:
        super().__init__()
        self.n_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.topk = config.index_topk
        self.mode = config.indexer_mode
        self.softmax_scale = self.head_dim**-0.5
        self.wq_b = Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = Linear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = Linear(config.hidden_size, self.n_heads, bias=False)
        # Batch-invariant mode (model/layers.py set_batch_invariant): the Hadamard rotation
        # by the invariant GEMM too (its projections are ``Linear`` layers).
        self.batch_invariant = False

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        roped = apply_rope_half(x[..., : self.rope_dim], cos, sin)
        return torch.cat((roped, x[..., self.rope_dim :]), dim=-1)

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        h = hadamard_matrix(self.head_dim, x.device, x.dtype)
        if self.batch_invariant:
            return invariant_linear(x, h.t())  # x @ h as F.linear takes it
        return x @ h

    def project_key(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """[T, hidden] -> the cached key row: [T, D] (bf16 mode) or packed uint8
        [T, fp8_row_bytes(D)]."""
        k = self._rope(self.k_norm(self.wk(hidden)), cos, sin)
        if self.mode != "fp8_hadamard":
            return k
        return pack_fp8_rows(*quantize_fp8(self._rotate(k)), fp8_row_bytes(self.head_dim))

    def project_query(
        self, hidden: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> q [T, H, D] (e4m3 in fp8 mode) and per-head weights [T, H] (fp32)."""
        q = self.wq_b(q_resid).view(-1, self.n_heads, self.head_dim)
        q = self._rope(q, cos, sin)
        w = self.weights_proj(hidden.to(self.weights_proj.weight.dtype)).float()
        w = w * self.n_heads**-0.5
        if self.mode != "fp8_hadamard":
            return q, w
        q8, q_scale = quantize_fp8(self._rotate(q))
        return q8, w * q_scale * self.softmax_scale

    def _scores(
        self, q: torch.Tensor, weights: torch.Tensor, key_rows: torch.Tensor
    ) -> torch.Tensor:
        if self.mode == "fp8_hadamard":
            return fp8_index_scores(q, weights, key_rows)
        return index_scores(q, weights, key_rows, self.softmax_scale)

    def _decode_topk(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        all_keys: torch.Tensor,
        batch: ForwardBatch,
        prefetch: DecodeSelectionHooks | None,
        layer: int,
    ) -> torch.Tensor:
        """One query per request; context padded to the table width: fixed shapes only.
        Returns top-k positions [B, 1, topk]. With ``prefetch`` (the chunked staged
        design, model/selection_hooks.py; ECHO implements it) each chunk of scores is handed to it as soon
        as it is computed, so its likely misses start moving while the next chunks and the
        top-k run, and its thresholds learn the step's k-th scores from the top-k."""
        ctx = batch.context_locs
        lens = batch.positions + 1
        theta = None if prefetch is None else prefetch.theta(layer, batch.request_rows)
        if self.mode == "fp8_hadamard" and use_kernels(q):
            from sglang_echo.kernels.indexer import fp8_index_logits, program_span

            keys, scales = unpack_fp8_rows(all_keys, self.head_dim)
            lens32 = lens.to(torch.int32)
            if prefetch is None:
                scores = fp8_index_logits(q, weights, keys, scales, ctx, lens32)
            else:
                scores = torch.empty(ctx.shape[0], ctx.shape[1], dtype=torch.float32,
                                     device=q.device)  # fmt: skip
                bounds = prefetch.chunk_bounds(ctx.shape[1], program_span())
                for i, (start, end) in enumerate(bounds):
                    fp8_index_logits(
                        q, weights, keys, scales, ctx, lens32, out=scores, start=start, end=end
                    )
                    prefetch.stage(layer, i, scores, ctx, lens32, theta, start, end)
        else:
            scores = self._scores(q.unsqueeze(1), weights.unsqueeze(1), all_keys[ctx]).squeeze(1)
            if prefetch is not None:
                prefetch.stage(layer, 0, scores, ctx, lens, theta, 0, scores.shape[1])
        pos, _ = exact_topk(scores, batch.positions, self.topk, use_kernels(q), False)
        if prefetch is not None:
            prefetch.finish(layer, scores.float(), pos, batch.request_rows)
        return pos.unsqueeze(1)

    def select(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        all_keys: torch.Tensor,
        batch: ForwardBatch,
        prefetch: DecodeSelectionHooks | None = None,
        layer: int = 0,
        extend_prefetch: PrefillSelectionHooks | None = None,
    ) -> torch.Tensor:
        """Top-k token locations [T, topk] (-1 none) for every query token of the batch.

        ``prefetch`` (ECHO's decode prefetch, decode batches with request rows only): the
        misses scoring above each request's threshold are staged before the top-k, and
        each request's exact k-th score is learnt after it. ``extend_prefetch`` (prefill, with
        request rows): each query block's scores go to its histogram before the block's
        top-k, and the block's k-th scores after it. The selection itself is unchanged.
        """
        if batch.is_decode:
            if batch.request_rows is None:
                prefetch = None
            pos = self._decode_topk(q, weights, all_keys, batch, prefetch, layer)
            return positions_to_locs(pos, batch.context_locs, use_kernels(q)).squeeze(1)

        out = torch.empty(q.shape[0], self.topk, dtype=torch.int64, device=q.device)
        if batch.request_rows is None:
            extend_prefetch = None
        if extend_prefetch is not None:
            extend_prefetch.begin_chunk(q.shape[0])
        for r, start in enumerate(batch.extend_starts()):
            n, length = batch.extend_lens[r], batch.context_lens[r]
            ctx = batch.context_locs[r, :length].unsqueeze(0)
            keys = all_keys[ctx]
            block = max(1, SCORE_BLOCK_ELEMENTS // max(1, self.n_heads * length))
            for s in range(start, start + n, block):
                e = min(s + block, start + n)
                scores = self._scores(q[s:e].unsqueeze(0), weights[s:e].unsqueeze(0), keys)
                query_pos = batch.positions[s:e]
                if extend_prefetch is not None:
                    row = batch.request_rows[r]
                    extend_prefetch.launch(layer, scores[0], ctx[0], query_pos, row, self.topk)
                pos, kth = exact_topk(
                    scores[0],
                    query_pos,
                    self.topk,
                    use_kernels(q),
                    extend_prefetch is not None,
                )
                if extend_prefetch is not None:
                    extend_prefetch.observe(layer, kth, row)
                out[s:e] = positions_to_locs(pos.unsqueeze(0), ctx, use_kernels(q)).squeeze(0)
        return out
