"""Next tokens for a whole batch on the device, in float32, with one host read per step.

Greedy rows take the argmax. Sampled rows apply temperature, top-k and top-p, then draw
by an exponential race: token = argmax(p / E) with E ~ Exp(1) per vocabulary entry, which
picks each token with probability p. The race's uniforms come from a counter-based hash
of (request key, output index, token id), not from a stateful generator, so a request's
draw depends on nothing else in the batch, and a preempted request recomputed later draws
exactly the tokens it would have drawn (the same logits give the same token).

Rows whose logits are not finite are reported, not sampled: the scheduler ends only those
requests with an error instead of letting one bad row break the step for everyone.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sglang_echo.kernels.host_copy import upload
from sglang_echo.kernels.pinned_store import PinnedReadback, Readback, copy_by_torch
from sglang_echo.runtime.request import SamplingParams, TokenLogprob

_M32 = 0xFFFFFFFF
_MIX = 0x45D9F3B  # < 2**27: products with 32-bit values stay inside int64
_GOLDEN = 0x9E3779B9
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs


def new_sample_key(params: SamplingParams) -> int:
    """The request's 64-bit noise key: its seed, or fresh randomness when it has none."""
    if params.seed is not None:
        return params.seed % (1 << 64)
    return random.SystemRandom().getrandbits(64)


def _signed64(key: int) -> int:
    """An unsigned 64-bit key as the int64 with the same bits."""
    return key - (1 << 64) if key >= 1 << 63 else key


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer on int64 tensors holding values in [0, 2**32)."""
    x = ((x ^ (x >> 16)) * _MIX) & _M32
    x = ((x ^ (x >> 16)) * _MIX) & _M32
    return x ^ (x >> 16)


def race_uniforms(keys: torch.Tensor, counters: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniforms in (0, 1), float32 [rows, vocab], a pure function of (key, counter, token)."""
    lo = keys & _M32
    hi = (keys >> 32) & _M32
    row = _mix32(lo ^ _mix32(hi ^ _mix32((counters & _M32) ^ _GOLDEN)))
    tok = torch.arange(vocab, dtype=torch.int64, device=keys.device)
    bits = _mix32(row[:, None] ^ _mix32(tok * _GOLDEN & _M32)[None, :])
    # 24 bits: exactly representable in float32, never 0 or 1.
    return ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def _filter_top_k_top_p(
    probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Zero what top-k and top-p exclude (rows sorted once; ties kept by position)."""
    vocab = probs.shape[-1]
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    ranks = torch.arange(vocab, device=probs.device)[None, :]
    before = torch.cumsum(sorted_p, dim=-1) - sorted_p
    drop = (ranks >= top_k[:, None]) | ((before >= top_p[:, None]) & (ranks > 0))
    return probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))


@dataclass
class SampledBatch:
    tokens: list[int]
    finite: list[bool]  # False: the row's logits held NaN or inf; its token is meaningless
    logprobs: list[TokenLogprob | None]


@dataclass
class DeviceSample:
    """A step's choices still on the device (``tokens`` feeds the next step's inputs there),
    with a copy to pinned host memory queued behind them: ``read`` waits for that copy
    only, never for work queued after it (the next step's forward)."""

    tokens: torch.Tensor  # [rows] int64, on the device
    _copies: Readback  # tokens, finite, then (chosen, top values, top ids) when asked
    _want: list[int]
    _top_logprobs: list[int]

    def read(self) -> SampledBatch:
        host = self._copies.wait()
        token_list = host[0].tolist()
        finite_list = host[1].tolist()
        logprobs: list[TokenLogprob | None] = [None] * len(token_list)
        if self._want:
            chosen_list = host[2].tolist()
            top_vals = host[3].tolist() if len(host) > 3 else None
            top_ids = host[4].tolist() if len(host) > 3 else None
            for j, i in enumerate(self._want):
                n = self._top_logprobs[j]
                top = tuple(zip(top_ids[j][:n], top_vals[j][:n], strict=True)) if n else ()
                logprobs[i] = TokenLogprob(token_list[i], chosen_list[j], top)
        return SampledBatch(token_list, finite_list, logprobs)


def _on(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on ``device``, queued without waiting (a pageable copy would make
    the host wait for every kernel queued before it: the step just launched)."""
    return upload(torch.tensor(values, dtype=dtype), device)


def sample_on_device(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    keys: Sequence[int],
    counters: Sequence[int],
    readback: PinnedReadback | None = None,
) -> DeviceSample:
    """``logits`` [rows, vocab] -> one token per row on the device, its host copy queued
    (see the module docstring; ``sample_batch`` reads it at once). ``readback``: the
    engine's pinned ring (kernels/pinned_store.py: no copy engine); None: torch's copy."""
    vocab = logits.shape[-1]
    dev = logits.device
    x = logits.float()
    # A non-finite row still yields some token (argmax and the race do not raise on NaN);
    # it is flagged and its request ended, so no pass over the logits cleans it first.
    finite = torch.isfinite(x).all(dim=-1)
    tokens = torch.argmax(x, dim=-1)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if sampled:
        idx = _on(sampled, torch.int64, dev)
        sp = [params[i] for i in sampled]
        temp = _on([p.temperature for p in sp], torch.float32, dev)
        probs = torch.softmax(x.index_select(0, idx) / temp[:, None], dim=-1)
        if any(p.top_p < 1.0 or 0 < p.top_k < vocab for p in sp):
            top_k = _on([p.top_k if 0 < p.top_k < vocab else vocab for p in sp], torch.int64, dev)
            top_p = _on([p.top_p for p in sp], torch.float32, dev)
            probs = _filter_top_k_top_p(probs, top_k, top_p)
        u = race_uniforms(
            _on([_signed64(keys[i]) for i in sampled], torch.int64, dev),
            _on([counters[i] for i in sampled], torch.int64, dev),
            vocab,
        )
        choice = torch.argmax(probs / -torch.log(u), dim=-1)
        tokens = tokens.index_copy(0, idx, choice)
    want = [i for i, p in enumerate(params) if p.logprobs]
    top_n = max((params[i].top_logprobs for i in want), default=0)
    on_device = [tokens, finite]
    if want:
        idx = _on(want, torch.int64, dev)
        lsm = torch.log_softmax(x.index_select(0, idx), dim=-1)
        on_device.append(lsm.gather(1, tokens.index_select(0, idx)[:, None])[:, 0])
        if top_n > 0:
            top = torch.topk(lsm, top_n, dim=-1)
            on_device += [top.values, top.indices]
    copies = readback.copy(on_device) if readback is not None else copy_by_torch(on_device)
    return DeviceSample(tokens, copies, want, [params[i].top_logprobs for i in want])


def sample_batch(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    keys: Sequence[int],
    counters: Sequence[int],
) -> SampledBatch:
    """``logits`` [rows, vocab] -> one token per row (see the module docstring)."""
    return sample_on_device(logits, params, keys, counters).read()
