"""Run requests through our model as a server would: prefill each, then decode them together.

Teacher-forced by default (each decode step feeds the request's real next token, so the
contexts stay real held-out text and the decode losses are held-out losses); greedy when
asked (feeds the argmax, for comparisons with transformers' ``generate``). Request r owns
the contiguous token locations ``base_r + position``; the decode batch pads each row of
``context_locs`` with the sink location 0, beyond the request's length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from research.topk.tracer import TopkTracer
from sglang_echo.model.forward_batch import ForwardBatch
from sglang_echo.model.kv_cache import PlainKVCache


@dataclass
class RunOutput:
    prefill_nll: list[torch.Tensor]  # per request: NLL of tokens 1..prompt_len (teacher-forced)
    decode_nll: torch.Tensor  # [steps, R]
    generated: torch.Tensor  # [R, steps] tokens fed after each step's logits (greedy) / targets


def run_requests(
    model: torch.nn.Module,
    tokens: list[list[int]],
    prompt_lens: list[int],
    decode_steps: int,
    tracer: TopkTracer | None = None,
    greedy: bool = False,
) -> RunOutput:
    """Prefill ``tokens[r][:prompt_lens[r]]`` for each r, then ``decode_steps`` batched steps.

    Teacher-forced runs need ``len(tokens[r]) >= prompt_lens[r] + decode_steps + 1``.
    """
    if len(tokens) != len(prompt_lens) or not tokens:
        raise ValueError("tokens and prompt_lens must be non-empty lists of equal length")
    config = model.config
    device = model.lm_head.weight.device
    dtype = model.lm_head.weight.dtype
    for r, (toks, n) in enumerate(zip(tokens, prompt_lens, strict=True)):
        need = n if greedy else n + decode_steps + 1
        if n < 1 or len(toks) < need:
            raise ValueError(f"request {r}: {len(toks)} tokens, need >= {need}")
        if n + decode_steps > config.max_position_embeddings:
            raise ValueError(
                f"request {r}: {n} + {decode_steps} tokens exceed max_position_embeddings "
                f"{config.max_position_embeddings}"
            )
    lens = [n + decode_steps for n in prompt_lens]
    cache = PlainKVCache.for_model(config, sum(lens), dtype, device)
    bases = torch.tensor([1 + sum(lens[:r]) for r in range(len(lens))], device=device)
    if tracer is not None:
        tracer.begin(cache, bases)

    prefill_nll, last_logits = [], []
    for r, n in enumerate(prompt_lens):
        ids = torch.tensor(tokens[r][:n], device=device)
        locs = bases[r] + torch.arange(n, device=device)
        batch = ForwardBatch.whole_prompt(ids, locs)
        if tracer is not None:
            tracer.prefill_request = r
        logits = model(batch, cache)
        last_logits.append(logits[-1])
        if not greedy:
            targets = torch.tensor(tokens[r][1 : n + 1], device=device)
            prefill_nll.append(F.cross_entropy(logits, targets, reduction="none").cpu())
    if tracer is not None:
        tracer.prefill_request = -1

    n_req = len(tokens)
    width = max(lens)
    context = torch.zeros(n_req, width, dtype=torch.int64, device=device)
    for r, length in enumerate(lens):
        context[r, :length] = bases[r] + torch.arange(length, device=device)
    starts = torch.tensor(prompt_lens, device=device)
    if greedy:
        current = torch.stack(last_logits).argmax(-1)
    else:
        current = torch.tensor([tokens[r][n] for r, n in enumerate(prompt_lens)], device=device)
    nll = torch.zeros(decode_steps, n_req)
    fed = torch.zeros(n_req, decode_steps, dtype=torch.int64)
    for step in range(decode_steps):
        fed[:, step] = current.cpu()
        positions = starts + step
        batch = ForwardBatch(
            input_ids=current,
            positions=positions,
            out_locs=bases + positions,
            context_locs=context,
            extend_lens=[1] * n_req,
            context_lens=[n + step + 1 for n in prompt_lens],
            is_decode=True,
            logits_indices=None,
        )
        logits = model(batch, cache)
        if greedy:
            current = logits.argmax(-1)
        else:
            idx = [n + step + 1 for n in prompt_lens]
            current = torch.tensor([tokens[r][i] for r, i in enumerate(idx)], device=device)
            nll[step] = F.cross_entropy(logits, current, reduction="none").cpu()
    return RunOutput(prefill_nll=prefill_nll, decode_nll=nll, generated=fed)
