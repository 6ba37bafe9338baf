"""Record what the indexer selects, step by step, without changing what the model computes.

Each layer's ``indexer.select`` and ``self_attn._attend`` are wrapped: the original runs and
its result is returned untouched; the wrapper recomputes the indexer scores of the step's
queries (the same function the selection used) and records, per request:

- the selected positions and the exact k-th score;
- ECHO's decode threshold prediction theta (EMA, alpha 0.5, of the previous steps' k-th
  scores, started from the last prompt query's) and how many keys score above it;
- the size of the threshold bin of a 256-bin histogram over the top 8 bits of an
  order-preserving key of (score - offset), with offset 0 and offset theta, for the key
  of the fp16-rounded score (the first pass of radix top-k kernels) and of the fp32 score;
- the recall of the dense attention's top-k (head-averaged probabilities) by the
  indexer's top-k, and the attention mass that the selection covers.

Positions are token positions in the request (token location minus the request's base
location, which the driver assigns contiguously).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch

from sglang_echo.model.forward_batch import ForwardBatch
from sglang_echo.model.kv_cache import PlainKVCache

EMA_ALPHA = 0.5
INT32_SIGN = -(2**31)
INT16_SIGN = -(2**15)


def fp32_key_bins(x: torch.Tensor) -> torch.Tensor:
    """Top 8 bits of the order-preserving uint32 key of float32 values, as int64 0..255."""
    bits = x.float().contiguous().view(torch.int32)
    key = torch.where(bits < 0, ~bits, bits | INT32_SIGN)
    return ((key >> 24) & 0xFF).long()


def fp16_key_bins(x: torch.Tensor) -> torch.Tensor:
    """Top 8 bits of the order-preserving uint16 key of the fp16-rounded values."""
    bits = x.half().contiguous().view(torch.int16).int()
    key = torch.where(bits < 0, ~bits, bits | INT16_SIGN) & 0xFFFF
    return ((key >> 8) & 0xFF).long()


def threshold_bin(
    bins: torch.Tensor, valid: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """256-bin histogram per row; the threshold bin is the highest bin whose suffix count
    (elements in it and above) reaches k. -> (elements in that bin, elements above it)."""
    rows = bins.shape[0]
    idx = torch.where(valid, bins, torch.full_like(bins, 256))
    hist = torch.zeros(rows, 257, dtype=torch.int64, device=bins.device)
    hist.scatter_add_(1, idx, torch.ones_like(idx))
    hist = hist[:, :256]
    suffix = hist.flip(-1).cumsum(-1).flip(-1)
    b = ((suffix >= k).sum(-1) - 1).clamp(min=0)
    size = hist.gather(1, b[:, None]).squeeze(1)
    above = suffix.gather(1, b[:, None]).squeeze(1) - size
    return size, above


def selection_mask(pos: torch.Tensor, width: int) -> torch.Tensor:
    """positions [R, K] (-1 none) -> bool [R, width]."""
    mask = torch.zeros(pos.shape[0], width, dtype=torch.bool, device=pos.device)
    valid = pos >= 0
    first = pos[:, :1].clamp(min=0)
    mask.scatter_(1, torch.where(valid, pos, first), True)
    mask &= valid.any(dim=1, keepdim=True)
    return mask


class TopkTracer:
    """Wraps every layer of ``model`` while installed; records decode steps of one run."""

    def __init__(self, model: torch.nn.Module, alpha: float = EMA_ALPHA) -> None:
        self.model = model
        self.alpha = alpha
        self.layers = list(model.model.layers)
        self._originals: list[tuple[object, str]] = []
        self.recording = False
        self.reset(0)

    # ------------------------------------------------------------------ set-up
    def reset(self, num_requests: int) -> None:
        n_layers = len(self.layers)
        self.num_requests = num_requests
        self.bases: torch.Tensor | None = None
        self.cache: PlainKVCache | None = None
        self.prefill_request = -1
        self.prefill_sel: list[list[torch.Tensor | None]] = [
            [None] * num_requests for _ in range(n_layers)
        ]
        self.theta: list[torch.Tensor | None] = [None] * n_layers
        self._prefill_kth = [[0.0] * num_requests for _ in range(n_layers)]
        self._last_sel: list[torch.Tensor | None] = [None] * n_layers
        self.steps: list[dict[str, list[torch.Tensor]]] = [
            defaultdict(list) for _ in range(n_layers)
        ]

    def begin(self, cache: PlainKVCache, bases: torch.Tensor) -> None:
        if not isinstance(cache, PlainKVCache):
            raise TypeError("tracing needs the PlainKVCache (it reads every token's KV row)")
        self.reset(int(bases.shape[0]))
        self.cache = cache
        self.bases = bases

    def install(self) -> TopkTracer:
        for layer_id, layer in enumerate(self.layers):
            attn = layer.self_attn
            self._wrap(attn.indexer, "select", self._select_hook(layer_id, attn.indexer))
            self._wrap(attn, "_attend", self._attend_hook(layer_id, attn))
        self.recording = True
        return self

    def remove(self) -> None:
        for obj, name in reversed(self._originals):
            delattr(obj, name)  # drop the instance attribute: the class method shows again
        self._originals.clear()
        self.recording = False

    def __enter__(self) -> TopkTracer:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.remove()

    def _wrap(self, obj, name: str, factory) -> None:
        if name in vars(obj):
            raise RuntimeError(f"{type(obj).__name__}.{name} is already wrapped")
        wrapper = factory(getattr(obj, name))
        self._originals.append((obj, name))
        setattr(obj, name, wrapper)

    # ------------------------------------------------------------------ hooks
    def _positions(self, locs: torch.Tensor, requests: torch.Tensor) -> torch.Tensor:
        base = self.bases[requests].unsqueeze(-1)
        return torch.where(locs >= 0, locs - base, torch.full_like(locs, -1))

    def _select_hook(self, layer_id: int, indexer):
        def factory(original):
            def select(q, weights, all_keys, batch: ForwardBatch):
                locs = original(q, weights, all_keys, batch)
                if self.recording and self.bases is not None:
                    args = (layer_id, indexer, q, weights, all_keys, batch, locs)
                    if batch.is_decode:
                        self._record_decode(*args)
                    else:
                        self._record_prefill(*args)
                return locs

            return select

        return factory

    def _record_prefill(self, layer_id, indexer, q, weights, all_keys, batch, locs) -> None:
        r = self.prefill_request
        if r < 0 or batch.num_requests != 1:
            return
        n = batch.context_lens[0]
        if int(batch.positions[-1]) != n - 1:
            return
        ctx = batch.context_locs[0, :n]
        scores = indexer._scores(
            q[-1:].unsqueeze(0), weights[-1:].unsqueeze(0), all_keys[ctx][None]
        )
        pos = self._positions(locs[-1:], torch.tensor([r], device=locs.device))
        valid = pos >= 0
        kth = scores[0].gather(1, pos.clamp(min=0)).masked_fill(~valid, float("inf")).min()
        self.prefill_sel[layer_id][r] = pos[0].detach()
        self._prefill_kth[layer_id][r] = float(kth)

    def _record_decode(self, layer_id, indexer, q, weights, all_keys, batch, locs) -> None:
        scores = indexer._scores(
            q.unsqueeze(1), weights.unsqueeze(1), all_keys[batch.context_locs]
        ).squeeze(1)  # [R, L]
        width = scores.shape[1]
        requests = torch.arange(scores.shape[0], device=scores.device)
        pos = self._positions(locs, requests)
        valid_sel = pos >= 0
        kth = scores.gather(1, pos.clamp(min=0)).masked_fill(~valid_sel, float("inf")).min(1).values
        visible = torch.arange(width, device=scores.device)[None, :] <= batch.positions[:, None]
        theta = self.theta[layer_id]
        if theta is None:
            theta = torch.tensor(self._prefill_kth[layer_id], device=scores.device)
        k = locs.shape[1]
        rec = self.steps[layer_id]
        rec["sel"].append(pos.to(torch.int32))
        rec["kth"].append(kth)
        rec["theta"].append(theta.clone())
        rec["n_above"].append(((scores > theta[:, None]) & visible).sum(1))
        for name, key_fn in (("fp16", fp16_key_bins), ("fp32", fp32_key_bins)):
            size0, _ = threshold_bin(key_fn(scores), visible, k)
            size1, _ = threshold_bin(key_fn(scores - theta[:, None]), visible, k)
            rec[f"bin_{name}_raw"].append(size0)
            rec[f"bin_{name}_offset"].append(size1)
        self.theta[layer_id] = self.alpha * kth + (1 - self.alpha) * theta
        self._last_sel[layer_id] = pos

    def _attend_hook(self, layer_id: int, attn):
        def factory(original):
            def attend(q_full, selected, batch: ForwardBatch, kv_cache, lid, *rest):
                out = original(q_full, selected, batch, kv_cache, lid, *rest)
                if self.recording and batch.is_decode and self._last_sel[layer_id] is not None:
                    self._record_attention(layer_id, attn, q_full, batch)
                return out

            return attend

        return factory

    def _record_attention(self, layer_id, attn, q_full, batch) -> None:
        rows = self.cache.kv[layer_id][batch.context_locs].float()  # [R, L, row]
        logits = torch.einsum("rhd,rld->rhl", q_full.float(), rows) * attn.scale
        width = rows.shape[1]
        visible = torch.arange(width, device=rows.device)[None, :] <= batch.positions[:, None]
        logits = logits.masked_fill(~visible[:, None, :], float("-inf"))
        probs = torch.softmax(logits, dim=-1).mean(dim=1)  # [R, L]
        sel = self._last_sel[layer_id]
        k = sel.shape[1]
        top = probs.topk(min(k, width), dim=-1).indices
        member = selection_mask(sel, width)
        n_true = torch.minimum(visible.sum(1), torch.tensor(k, device=rows.device))
        recall = member.gather(1, top).float().sum(1) / n_true.float()
        rec = self.steps[layer_id]
        rec["recall"].append(recall)
        rec["attn_mass"].append((probs * member).sum(1))

    # ------------------------------------------------------------------ output
    def arrays(self) -> dict[str, np.ndarray]:
        """Recorded steps as numpy: per key [layers, steps, requests(, k)]."""
        out: dict[str, np.ndarray] = {}
        keys = self.steps[0].keys() if self.steps else []
        for key in keys:
            out[key] = np.stack(
                [
                    torch.stack(self.steps[layer][key]).cpu().numpy()
                    for layer in range(len(self.layers))
                ]
            )
        k = out["sel"].shape[-1] if "sel" in out else 0
        pre = np.full((len(self.layers), self.num_requests, k), -1, dtype=np.int32)
        for layer, sels in enumerate(self.prefill_sel):
            for r, sel in enumerate(sels):
                if sel is not None:
                    pre[layer, r, : sel.numel()] = sel.cpu().numpy()[:k]
        out["prefill_sel"] = pre
        out["prefill_kth"] = np.asarray(self._prefill_kth, dtype=np.float32)
        return out
