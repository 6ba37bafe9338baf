"""Norms and feed-forward blocks of DeepSeek-V3.2; parameter names follow the checkpoint.

Every projection of the model is this module's ``Linear``: ``nn.Linear`` (the same
parameters and names, the same ``F.linear`` by default) that, switched to batch-invariant
(``set_batch_invariant``; SGLANG_ECHO_BATCH_INVARIANT, handed down in ``ModelKernels``),
multiplies with the GEMM of kernels/invariant_matmul.py, whose per-row result does not
depend on how many rows share the batch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from sglang_echo.kernels.invariant_matmul import invariant_linear, invariant_row_sum
from sglang_echo.model.config import DeepseekV32Config


class Linear(nn.Linear):
    """``nn.Linear`` with a batch-invariant mode. Off (the default), ``forward`` is
    ``nn.Linear``'s; on, ``invariant_linear``: served ECHO and no-offload decode different
    batch sizes, and cuBLAS/MKL round a row by the batch's size, so only a GEMM whose row
    ignores the batch keeps their tokens equal."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.batch_invariant = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant:
            return invariant_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


# Elements per padded piece: a multiple of every CPU vector loop's step (2 x 16 floats).
_CPU_VECTOR_STEP = 64


def elementwise_apart(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for an elementwise ``fn`` (sigmoid, silu), each element's bits independent
    of how many elements there are. On the CPU torch runs full vectors through the SIMD
    path (Sleef's exp) and the leftover tail through the scalar one (std::exp), which round
    differently: the last row of an odd batch of 8-expert router scores took the scalar
    path. Padded to whole vectors, every element takes the SIMD path. CUDA computes every
    element by one code path, so there it is ``fn(x)``."""
    if x.is_cuda:
        return fn(x)
    flat = x.reshape(-1)
    padded = F.pad(flat, (0, -flat.numel() % _CPU_VECTOR_STEP))
    return fn(padded)[: flat.numel()].view(x.shape)


def ordered_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x.sum(dim)`` added left to right, one elementwise add per slice: the order (and so
    the bits) never depends on the other dimensions' sizes, which a CUDA reduction's
    thread layout does. For short dimensions (a token's top-k weights)."""
    parts = x.unbind(dim)
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def set_batch_invariant(model: nn.Module, enabled: bool) -> None:
    """Switch every module of ``model`` that has a batch-invariant mode (its ``Linear``
    layers and norms, the MoE router, the attention's absorption, the indexer's rotation)
    on or off: ``ModelKernels.apply`` and the entry points' draft layer call it."""
    for module in model.modules():
        if hasattr(module, "batch_invariant"):
            module.batch_invariant = enabled


class RMSNorm(nn.Module):
    """Normalizes in float32, scales in the input dtype (as the reference model does)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        # set_batch_invariant: the mean square by the invariant GEMM's row sum (a CUDA
        # reduction lays its threads out by the number of rows, so a row rounds by its batch)
        self.batch_invariant = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        if self.batch_invariant:
            mean_square = invariant_row_sum(xf * xf) / xf.shape[-1]
        else:
            mean_square = xf.pow(2).mean(-1, keepdim=True)
        xf = xf * torch.rsqrt(mean_square + self.eps)
        return self.weight * xf.to(dtype)


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)
        self.batch_invariant = False  # set_batch_invariant: silu per element apart too

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant:
            gate = elementwise_apart(F.silu, self.gate_proj(x))
            return self.down_proj(gate * self.up_proj(x))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GroupedTopkRouter(nn.Module):
    """Sigmoid scores; pick ``topk_group`` groups by their best-two sum, then top-k experts."""

    def __init__(self, config: DeepseekV32Config) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.n_routed_experts
        self.n_group = config.n_group
        self.topk_group = config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(config.n_routed_experts, config.hidden_size))
        self.register_buffer(
            "e_score_correction_bias", torch.zeros(config.n_routed_experts, dtype=torch.float32)
        )
        # Batch-invariant mode (set_batch_invariant): the scores by the invariant GEMM, and
        # each token's experts in ascending order, so the weights' normalizing sum adds
        # them in one order whatever order the top-k returned them in.
        self.batch_invariant = False

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.batch_invariant:
            logits = invariant_linear(x.float(), self.weight.float())
            scores = elementwise_apart(torch.sigmoid, logits)
        else:
            scores = F.linear(x.float(), self.weight.float()).sigmoid()
        biased = scores + self.e_score_correction_bias
        per_group = biased.view(-1, self.n_group, self.num_experts // self.n_group)
        group_scores = per_group.topk(2, dim=-1).values.sum(dim=-1)
        groups = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores).scatter_(1, groups, 1.0).bool()
        expert_mask = group_mask.unsqueeze(-1).expand_as(per_group).reshape(-1, self.num_experts)
        biased = biased.masked_fill(~expert_mask, float("-inf"))
        experts = biased.topk(self.top_k, dim=-1, sorted=False).indices
        if self.batch_invariant:
            experts = experts.sort(dim=-1).values
        weights = scores.gather(1, experts)
        if self.norm_topk_prob:
            if self.batch_invariant:
                total = ordered_sum(weights, -1).unsqueeze(-1)
            else:
                total = weights.sum(dim=-1, keepdim=True)
            weights = weights / (total + 1e-20)
        return experts, weights * self.routed_scaling_factor


class MoE(nn.Module):
    def __init__(self, config: DeepseekV32Config) -> None:
        super().__init__()
        self.gate = GroupedTopkRouter(config)
        self.experts = nn.ModuleList(
            GatedMLP(config.hidden_size, config.moe_intermediate_size)
            for _ in range(config.n_routed_experts)
        )
        self.shared_experts = GatedMLP(
            config.hidden_size, config.moe_intermediate_size * config.n_shared_experts
        )

        # Graph-capturable dispatch: every expert runs on every token, weighted by a dense
        # [T, E] routing matrix (zeros off-route). No host sync, fixed shapes; set by the
        # runner when decode steps are captured in CUDA graphs.
        self.dense_dispatch = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Routed experts plus the shared ones. A token's routed outputs are added in
        ascending expert order on both dispatches (the loop below, or ``_forward_dense``
        adding exact zeros off-route), one ``index_add_`` per expert in which a token occurs
        at most once: with batch-invariant experts (their ``Linear`` layers switched), a
        token's sum does not depend on how many tokens each expert got."""
        experts, weights = self.gate(x)
        if self.dense_dispatch:
            return self._forward_dense(x, experts, weights) + self.shared_experts(x)
        out = torch.zeros_like(x)
        # Sort token-expert pairs by expert once; each expert then sees a contiguous slice.
        flat_experts = experts.reshape(-1)
        order = flat_experts.argsort(stable=True)
        counts = torch.bincount(flat_experts, minlength=len(self.experts)).tolist()
        token_of_pair = order // experts.shape[1]
        start = 0
        for e, count in enumerate(counts):
            if count == 0:
                continue
            pairs = order[start : start + count]
            tokens = token_of_pair[start : start + count]
            start += count
            y = self.experts[e](x[tokens]) * weights.reshape(-1)[pairs, None]
            out.index_add_(0, tokens, y.to(out.dtype))
        return out + self.shared_experts(x)

    def _forward_dense(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        route = torch.zeros(x.shape[0], len(self.experts), dtype=weights.dtype, device=x.device)
        route.scatter_(1, experts, weights)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out += (expert(x) * route[:, e : e + 1]).to(out.dtype)
        return out
