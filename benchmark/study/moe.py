"""One DP worker's share of DeepSeek-V3.2's routed MoE, at equal bytes, for the e2e study.

Why: a decode step of DeepSeek-V3.2 on one worker of the paper's deployment (8 DP ranks
with DP attention, experts sharded 8 ways) reads the attention weights whatever the batch,
and of the MoE only the experts that the *global* batch touches. That weight traffic is
what ECHO's larger batches amortise, so the study's FFN must move the same bytes with the
same dependence on batch size; a dense FFN (or every expert for every token) would not.

The emulation, per layer:
- 32 local routed experts (experts 0..31 of 256: this worker's shard). DeepSeek-V3.2's
  experts are 4-bit with intermediate 2048: 3 x 7168 x 2048 x 0.5 B = 22.0 MB each. Here
  they are bf16 with intermediate 512: 3 x 7168 x 512 x 2 B = 22.0 MB, the same bytes
  (a quarter of the FLOPs, which decode does not miss: it is memory-bound).
- One shared expert of the same bytes, run on the local tokens.
- The global batch is ``dp_ranks`` x the local one: the local b tokens plus
  (dp_ranks - 1) x b peer tokens, emulated as the local hidden states under fixed random
  sign flips (so they route differently). Every token picks top-8 of 256 experts by a
  sigmoid router (no group limit, so the touch pattern is the uniform one below); only
  pairs that land on the 32 local experts are computed, by a fixed-capacity grouped GEMM
  (``torch._grouped_mm``): pairs sorted by expert, the per-expert offsets computed on the
  device, so the whole thing is graph-capturable and an untouched expert's weights are
  never read. Peer tokens' outputs are computed and dropped (they would go back through
  the all-to-all, which this study does not model).

Experts touched per step: 32 x (1 - (31/32)^(8b)). Bytes read per layer per step
(attention + indexer projections 402.1 MB bf16, replicated under DP attention; router
3.7 MB; shared expert 22.0 MB; touched routed experts 22.0 MB each):

| b  | experts touched | MoE MB | layer MB |
|----|-----------------|--------|----------|
| 1  | 7.18            | 183.7  | 585.9    |
| 2  | 12.75           | 306.3  | 708.5    |
| 3  | 17.06           | 401.4  | 803.6    |
| 4  | 20.41           | 475.2  | 877.3    |
| 8  | 27.81           | 638.0  | 1040.1   |
| 16 | 31.45           | 718.2  | 1120.4   |
| 24 | 31.93           | 728.7  | 1130.9   |
| 32 | 31.99           | 730.1  | 1132.3   |
| 64 | 32.00           | 730.3  | 1132.5   |

(``bytes_table`` computes it; benchmark/e2e_study.py checks measured layer parts against
it.) Measured on an H200 (benchmark/results/e2e_study.json, ``components``; graph-
replayed): experts touched per step 7.28 / 17.35 / 31.5 at b = 1 / 3 / 17 (the formula:
7.18 / 17.06 / 31.5); the grouped GEMMs read the touched experts at ~3.1 TB/s (124 us at
b = 3, 254 us at b = 16), but the whole module takes 357 / 475 us: ~200 us per layer go to
the routing around them (two small sorts, gathers, casts: ~40 launches). That part is an
emulation overhead a fused MoE kernel would not pay; it is the same for both backends.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang_echo.kernels.invariant_matmul import invariant_grouped_mm, invariant_linear
from sglang_echo.model.layers import GatedMLP, elementwise_apart, ordered_sum

# The paper's deployment of DeepSeek-V3.2 (8xH20, DP attention, EP 8).
DP_RANKS = 8
GLOBAL_EXPERTS = 256
LOCAL_EXPERTS = 32
EXPERTS_PER_TOKEN = 8
# 4-bit intermediate 2048 = bf16 intermediate 512 in bytes.
EMULATED_INTERMEDIATE = 512
ROUTED_SCALING = 2.5
# Attention + indexer projection parameters of one DeepSeek-V3.2 layer (q_a, q_b, kv_a,
# kv_b, o_proj, indexer wq_b, wk, weights_proj).
ATTENTION_PARAMS = (
    7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256 + 128 * 128 * 7168
    + 1536 * 64 * 128 + 7168 * 128 + 7168 * 64
)  # fmt: skip


def experts_touched(
    local_batch: int,
    dp_ranks: int = DP_RANKS,
    local_experts: int = LOCAL_EXPERTS,
    global_experts: int = GLOBAL_EXPERTS,
    top_k: int = EXPERTS_PER_TOKEN,
) -> float:
    """Expected local experts with at least one routed pair when dp_ranks x b tokens each
    pick top_k of global_experts uniformly: E x (1 - (1 - k/E_global)^(R b))."""
    miss = 1.0 - top_k / global_experts
    return local_experts * (1.0 - miss ** (dp_ranks * local_batch))


def expert_bytes(hidden: int = 7168, intermediate: int = EMULATED_INTERMEDIATE) -> int:
    """Bytes of one bf16 gated expert (gate, up, down)."""
    return 3 * hidden * intermediate * 2


def bytes_table(batches: list[int], hidden: int = 7168) -> list[dict]:
    """Bytes read per layer per decode step at each local batch (the docstring's table)."""
    exp = expert_bytes(hidden)
    router = GLOBAL_EXPERTS * hidden * 2
    attn = ATTENTION_PARAMS * 2
    rows = []
    for b in batches:
        touched = experts_touched(b)
        moe = (touched + 1) * exp + router
        rows.append(
            {
                "batch": b,
                "experts_touched": round(touched, 3),
                "moe_bytes": int(moe),
                "attention_weight_bytes": attn,
                "layer_weight_bytes": int(moe + attn),
            }
        )
    return rows


def has_grouped_mm() -> bool:
    return hasattr(torch, "_grouped_mm")


def grouped_gemm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, impl: str) -> torch.Tensor:
    """Rows of ``x`` [C, K] sorted by group, group g = rows [offs[g-1], offs[g]) -> x @ w[g].T
    ([C, N]; w [G, N, K]). Rows past offs[-1] belong to no group: their output is
    unspecified (the caller masks them). ``impl``: ``grouped_mm`` (one fused kernel, no
    host sync) or ``loop`` (reads the offsets on the host: the CPU path and a reference)."""
    if impl == "grouped_mm":
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    out = x.new_zeros(x.shape[0], w.shape[1])
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = x[start:end] @ w[g].transpose(0, 1)
        start = end
    return out


def combine_pairs(
    contrib: torch.Tensor,
    pair_id: torch.Tensor,
    live: torch.Tensor,
    tokens: int,
    top_k: int,
    ordered: bool = False,
) -> torch.Tensor:
    """Sum each token's weighted expert outputs in routing-rank order -> [tokens, hidden].

    ``contrib`` [P, hidden] float32 rows in any order (the grouped GEMM's, by expert),
    ``pair_id`` [P] = token * top_k + rank, ``live`` [P] (dead lanes are dropped). Why not
    ``index_add_``: on CUDA it adds with atomics, so a token with three or more local pairs
    gets its float32 sum in whatever order the atomics land, which follows where its pairs
    fall among the lanes (the batch's order, the expert layout), and now and then its bf16
    output changes with it. It was the worker's only floating-point atomic, and on the H200
    runs of the same prompts on different engines (two no-offload pools among them) gave
    greedy outputs that parted after ~34 tokens, while repeats of one engine agreed: the
    study's offload-vs-no-offload comparisons were unreliable. Here every pair lands in its
    own row and a token's rows are summed by one fixed reduction, so the bits
    depend on the pairs alone, not on the lanes' order. ``ordered`` (batch-invariant mode):
    the top-k rows added left to right, whose order does not follow the number of tokens
    as a CUDA reduction's thread layout does.
    """
    hidden = contrib.shape[1]
    spare = tokens * top_k  # dead lanes' row, dropped
    row = torch.where(live, pair_id, torch.full_like(pair_id, spare))
    dense = torch.zeros(spare + 1, hidden, dtype=contrib.dtype, device=contrib.device)
    dense.index_copy_(0, row, contrib)  # dead lanes (garbage, even NaN) land in the spare row
    per_token = dense[:spare].view(tokens, top_k, hidden)
    return ordered_sum(per_token, 1) if ordered else per_token.sum(dim=1)


class LocalRoutedMoE(nn.Module):
    """The FFN of one DP worker (see the module docstring): routed pairs only, one shared
    expert, graph-capturable with the ``grouped_mm`` implementation."""

    def __init__(
        self,
        hidden: int,
        intermediate: int = EMULATED_INTERMEDIATE,
        local_experts: int = LOCAL_EXPERTS,
        global_experts: int = GLOBAL_EXPERTS,
        top_k: int = EXPERTS_PER_TOKEN,
        dp_ranks: int = DP_RANKS,
        shared_intermediate: int | None = None,
        routed_scaling: float = ROUTED_SCALING,
        impl: str = "auto",
        seed: int = 0,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        if not 0 < local_experts <= global_experts or top_k > global_experts:
            raise ValueError("need 0 < local_experts <= global_experts and top_k <= experts")
        self.hidden = hidden
        self.intermediate = intermediate
        self.local_experts = local_experts
        self.global_experts = global_experts
        self.top_k = top_k
        self.dp_ranks = dp_ranks
        self.routed_scaling = routed_scaling
        self.impl = impl
        device = torch.device(device)
        gen = torch.Generator(device=device).manual_seed(seed)

        def normal(*shape: int, std: float) -> nn.Parameter:
            w = torch.randn(*shape, generator=gen, device=device).mul_(std)
            return nn.Parameter(w.to(dtype))

        self.router = normal(global_experts, hidden, std=hidden**-0.5)
        # [E, N, K] (nn.Linear layout): gate and up stacked, then down.
        self.w_gate_up = normal(local_experts, 2 * intermediate, hidden, std=hidden**-0.5)
        self.w_down = normal(local_experts, hidden, intermediate, std=intermediate**-0.5)
        with device:
            self.shared = GatedMLP(hidden, shared_intermediate or intermediate).to(dtype)
        signs = torch.randint(0, 2, (dp_ranks, hidden), generator=gen, device=device) * 2 - 1
        signs[0] = 1  # rank 0 is this worker's own tokens
        self.register_buffer("peer_signs", signs.to(dtype))
        # set_batch_invariant (SGLANG_ECHO_BATCH_INVARIANT): router and expert GEMMs by the
        # invariant kernels, sums in a fixed order, so served ECHO and no-offload, which
        # decode different batches, give equal tokens.
        self.batch_invariant = False
        # Telemetry: local experts touched, summed over forwards (device counters).
        self.register_buffer("touched", torch.zeros((), dtype=torch.int64, device=device))
        self.register_buffer("forwards", torch.zeros((), dtype=torch.int64, device=device))

    def _impl(self, x: torch.Tensor) -> str:
        if self.impl != "auto":
            return self.impl
        return "grouped_mm" if x.is_cuda and has_grouped_mm() else "loop"

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Local tokens [b, H] -> (global batch [R b, H], experts [R b, k], weights [R b, k]).
        Global token r * b + i is local token i as peer rank r sees it."""
        b = x.shape[0]
        g = (x.unsqueeze(0) * self.peer_signs.to(x.dtype).unsqueeze(1)).reshape(
            self.dp_ranks * b, self.hidden
        )
        if self.batch_invariant:  # float32 scores: bf16 ties at the k-th expert would
            # leave the pick to torch.topk's algorithm, which follows the batch's size
            logits = invariant_linear(g.float(), self.router.float())
            scores = elementwise_apart(torch.sigmoid, logits)
            weights, experts = scores.topk(self.top_k, dim=-1)
            total = ordered_sum(weights, -1).unsqueeze(-1)
        else:
            scores = F.linear(g, self.router.to(g.dtype)).float().sigmoid()
            weights, experts = scores.topk(self.top_k, dim=-1)
            total = weights.sum(dim=-1, keepdim=True)
        return g, experts, weights / total * self.routed_scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        g, experts, weights = self.route(x)
        e = self.local_experts
        flat = experts.reshape(-1)
        local = flat < e
        key = torch.where(local, flat, torch.full_like(flat, e))  # non-local pairs sort last
        order = torch.argsort(key, stable=True)
        counts = torch.zeros(e + 1, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, key, torch.ones_like(key))
        offs = torch.cumsum(counts[:e], 0).to(torch.int32)
        self.touched += (counts[:e] > 0).sum()
        self.forwards += 1
        pair_token = order // self.top_k
        xs = g.index_select(0, pair_token)
        if self.batch_invariant:  # an expert holds at most every global token once
            rows = g.shape[0]
            h = invariant_grouped_mm(xs, self.w_gate_up, offs, rows)
            gate = elementwise_apart(F.silu, h[:, : self.intermediate])
            y = invariant_grouped_mm(gate * h[:, self.intermediate :], self.w_down, offs, rows)
        else:
            impl = self._impl(x)
            h = grouped_gemm(xs, self.w_gate_up, offs, impl)
            act = F.silu(h[:, : self.intermediate]) * h[:, self.intermediate :]
            y = grouped_gemm(act, self.w_down, offs, impl)
        # Keep the served local pairs of this worker's own tokens: at most b x top_k of
        # the 8 b x top_k rows, compacted first (a stable sort of the keep flags) so the
        # combine touches b x top_k rows, not all. Rows past offs[-1] are unwritten:
        # select, never multiply, so garbage there cannot leak in.
        lane = torch.arange(order.shape[0], device=x.device)
        keep = (lane < offs[-1].to(torch.int64)) & (pair_token < b)
        kept = torch.sort(keep.to(torch.int8), descending=True, stable=True).indices
        kept = kept[: b * self.top_k]
        live = keep.index_select(0, kept)
        pair_id = order.index_select(0, kept)  # token * top_k + its routing rank
        pair_w = weights.reshape(-1).index_select(0, pair_id)
        contrib = y.index_select(0, kept).float() * pair_w.unsqueeze(1)
        out = combine_pairs(contrib, pair_id, live, b, self.top_k, ordered=self.batch_invariant)
        return out.to(x.dtype) + self.shared(x)

    @torch.no_grad()
    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """Dense float32 reference: every local expert on every local token, weighted by the
        same routing (zero off-route). For tests at small sizes."""
        b = x.shape[0]
        _, experts, weights = self.route(x)
        experts, weights = experts[:b], weights[:b]  # this worker's own tokens
        xf = x.float()
        out = torch.zeros(b, self.hidden, dtype=torch.float32, device=x.device)
        for j in range(self.local_experts):
            w_route = (weights * (experts == j)).sum(dim=-1)  # [b]
            wg, wu = self.w_gate_up[j].float().split(self.intermediate, dim=0)
            h = F.silu(xf @ wg.T) * (xf @ wu.T)
            out += (h @ self.w_down[j].float().T) * w_route.unsqueeze(1)
        return out + self.shared(x).float()
