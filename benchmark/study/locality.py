"""A top-k locality knob that the real indexer and the exact top-k act on; this module
holds its weight side (``install_preference``), the product runtime its key side
(python/sglang_echo/runtime/synthetic_kv.py: ``Locality``, ``favoured_directions``,
``index_keys``, re-exported here).

Why: random weights over random keys select nearly unrelated tokens at every step (hit
rates ~0.25), while DeepSeek-V3.2's trained indexer keeps selecting mostly the same tokens
(0.88-0.99 per layer in the ECHO paper). ECHO's gain depends on that, so the study needs a
workload whose locality is set on purpose, by one number, and still decided by the real
scoring path (fp8 keys, the indexer's logits kernel, the radix top-k), not by a trace.

How: each layer's indexer gets a *favoured direction* u (a unit vector on the key dims the
indexer does not rope, so position does not rotate it). ``install_preference`` gives the
indexer's query projection a bias of ``gain x u`` per head and its head-weight projection a
positive bias: every query then scores a key k by about sum_h w_h relu(gain u . k + noise),
for all queries of every request, step after step. Synthetic prompt keys
(``index_keys``) are random with their u-component removed ("cold": their scores depend on
the query only, so the cold part of the selection moves from step to step), except
``round(stable_fraction x top-k)`` hot positions per request and layer whose keys carry a
large u-component: they outscore every cold key, so they are in every step's top-k.
The knob ``stable_fraction`` p is therefore the fraction of each step's top-k that repeats
by construction; the measured hit rate is about p + (1 - p) x (what the cold part hits),
at least p once warm. p = 0 is the random-keys workload (labelled "random"), the
pessimistic bound. Weight bytes are unchanged (biases of 8K + 64 values per layer).
Keys the model itself computes for decoded tokens are scored by the same rule: those with
a positive u-component outrank every cold key, so as decoding goes on recent tokens join
the stable part (as recent tokens do in trained models) and the hit rate creeps above the
prompt's p (benchmark/results/e2e_study.json, p = 0.9: 0.923-0.927 over decode steps
8-40 at batch 1-4, 0.972 over steps ~117-149 at batch 17).
"""

from __future__ import annotations

import torch
from torch import nn

from sglang_echo.model.deepseek_v32 import DeepseekV32ForCausalLM
from sglang_echo.runtime.synthetic_kv import (  # the key side lives in the runtime
    HOT_KEY_SCALE,
    Locality,
    favoured_directions,
    index_keys,
)

__all__ = [
    "HOT_KEY_SCALE",
    "QUERY_GAIN",
    "WEIGHT_BIAS",
    "Locality",
    "favoured_directions",
    "index_keys",
    "install_preference",
]

# The query bias, in units of a head's typical query norm (||W_h|| over unit-RMS inputs).
QUERY_GAIN = 2.0
# The head-weight bias, in units of a head weight's typical noise.
WEIGHT_BIAS = 3.0


def _with_bias(linear: nn.Linear, bias: torch.Tensor) -> nn.Linear:
    """A copy of ``linear`` (same weight tensor) with ``bias`` added."""
    out = nn.Linear(linear.in_features, linear.out_features, bias=True)
    out = out.to(device=linear.weight.device, dtype=linear.weight.dtype)
    out.weight = linear.weight
    with torch.no_grad():
        out.bias.copy_(bias.to(out.bias.dtype))
    return out


@torch.no_grad()
def install_preference(model: DeepseekV32ForCausalLM, directions: torch.Tensor) -> None:
    """Give every layer's indexer its favoured direction (module docstring). Call once,
    before any step is captured."""
    for layer, direction in zip(model.model.layers, directions, strict=True):
        idx = layer.self_attn.indexer
        w = idx.wq_b.weight.float().view(idx.n_heads, idx.head_dim, -1)
        head_norm = w.flatten(1).norm(dim=1).mean()  # ~ |W_h q| for unit-RMS q
        bias = (QUERY_GAIN * head_norm * direction.to(w.device)).repeat(idx.n_heads)
        idx.wq_b = _with_bias(idx.wq_b, bias)
        noise = idx.weights_proj.weight.float().norm(dim=1).mean()
        idx.weights_proj = _with_bias(
            idx.weights_proj, torch.full((idx.n_heads,), float(WEIGHT_BIAS * noise))
        )
