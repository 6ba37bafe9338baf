"""Next-token choice per request: greedy (argmax, as the offline engine does) or sampled
with temperature / top-k / top-p from the request's own seeded generator, so a seeded
request gives the same tokens whatever else shares its batch."""

from __future__ import annotations

import torch

from sglang_echo.runtime.request import SamplingParams


def make_generator(params: SamplingParams) -> torch.Generator | None:
    if params.greedy:
        return None
    gen = torch.Generator(device="cpu")
    if params.seed is not None:
        gen.manual_seed(params.seed)
    else:
        gen.seed()
    return gen


def sample_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> int:
    """``logits`` [vocab] float32 -> token id."""
    if params.greedy or generator is None:
        return int(torch.argmax(logits).item())
    scores = logits.detach().to("cpu", torch.float64) / params.temperature
    if 0 < params.top_k < scores.numel():
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, 0) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator).item())
