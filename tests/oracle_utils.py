"""Run our model and transformers' DeepseekV32ForCausalLM side by side on one prompt set."""

from __future__ import annotations

import contextlib

import torch

from sglang_echo.model.deepseek_v32 import DeepseekV32ForCausalLM
from sglang_echo.model.forward_batch import ForwardBatch
from sglang_echo.model.kv_cache import PlainKVCache


@contextlib.contextmanager
def lowest_index_tie_break():
    """Run transformers with top-k ties going to the lowest index, as our indexer does.

    Exactly equal indexer scores are common (a key whose every head logit is clipped by
    relu scores 0), and torch.topk orders ties however its kernel happens to. Only the tie
    order is aligned; every score is still transformers' own.
    """
    original = torch.Tensor.topk

    def stable_topk(self, k, dim=-1, largest=True, sorted=True):
        values, idx = torch.sort(self, dim=dim, descending=largest, stable=True)
        return torch.return_types.topk((values.narrow(dim, 0, k), idx.narrow(dim, 0, k)))

    torch.Tensor.topk = stable_topk
    try:
        yield
    finally:
        torch.Tensor.topk = original


def prefill_all_logits(
    model: DeepseekV32ForCausalLM, prompt: list[int], record_topk: bool = False
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Logits at every prompt position, and per layer the selected positions [S, topk]."""
    cfg = model.config
    device = model.lm_head.weight.device
    dtype = model.lm_head.weight.dtype
    n = len(prompt)
    cache = PlainKVCache.for_model(cfg, n, dtype, device)
    locs = torch.arange(1, n + 1, device=device)
    batch = ForwardBatch.whole_prompt(torch.tensor(prompt, device=device), locs)
    captured: list[torch.Tensor] = []
    originals = []
    if record_topk:
        for layer in model.model.layers:
            indexer = layer.self_attn.indexer
            original = indexer.select
            originals.append((indexer, original))

            def hooked(*args, _orig=original, **kwargs):
                out = _orig(*args, **kwargs)
                captured.append(torch.where(out >= 0, out - 1, out))  # loc i <-> position i-1
                return out

            indexer.select = hooked
    try:
        logits = model(batch, cache)
    finally:
        for indexer, original in originals:
            indexer.select = original
    return logits, captured


def hf_prefill(hf_model, prompt: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """transformers' logits [S, V] and per-layer indexer top-k [S, topk] (hooked)."""
    device = next(hf_model.parameters()).device
    captured: list[torch.Tensor] = []
    hooks = [
        layer.self_attn.indexer.register_forward_hook(
            lambda _m, _i, out: captured.append(out[0].detach())
        )
        for layer in hf_model.model.layers
    ]
    try:
        with torch.no_grad(), lowest_index_tie_break():
            logits = hf_model(torch.tensor([prompt], device=device)).logits[0].float()
    finally:
        for h in hooks:
            h.remove()
    return logits, captured


def topk_set_mismatches(ours: torch.Tensor, theirs: torch.Tensor) -> list[int]:
    """Query positions whose selected key sets differ (keys <= the query only)."""
    bad = []
    for t in range(ours.shape[0]):
        a = {int(x) for x in ours[t].tolist() if x >= 0}
        b = {int(x) for x in theirs[t].tolist() if 0 <= x <= t}
        if a != b:
            bad.append(t)
    return bad


def hf_greedy(hf_model, prompt: list[int], new_tokens: int) -> list[int]:
    device = next(hf_model.parameters()).device
    with torch.no_grad(), lowest_index_tie_break():
        out = hf_model.generate(
            torch.tensor([prompt], device=device),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=2,
        )
    return out[0, len(prompt) :].tolist()
