"""Norms and feed-forward blocks of DeepSeek-V3.2; parameter names follow the checkpoint."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang_echo.model.config import DeepseekV32Config


class RMSNorm(nn.Module):
    """Normalizes in float32, scales in the input dtype (as the reference model does)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        biased = scores + self.e_score_correction_bias
        per_group = biased.view(-1, self.n_group, self.num_experts // self.n_group)
        group_scores = per_group.topk(2, dim=-1).values.sum(dim=-1)
        groups = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores).scatter_(1, groups, 1.0).bool()
        expert_mask = group_mask.unsqueeze(-1).expand_as(per_group).reshape(-1, self.num_experts)
        biased = biased.masked_fill(~expert_mask, float("-inf"))
        experts = biased.topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, experts)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
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
