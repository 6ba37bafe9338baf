"""The flat, padding-free batch one model forward consumes.

Tokens of all requests are packed end to end (as in SGLang/vLLM), so prefill chunks of
different lengths and decode tokens share one layout. Decode batches use only tensors
(no per-request Python ints), which keeps a decode step capturable in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, position of each token in its request
    out_locs: torch.Tensor  # [T] int64, token location each token's KV rows are written to
    context_locs: torch.Tensor  # [R, L] int64, locations of positions 0..L-1 of each request
    # Per-request segmentation of the T tokens. Decode: every request has one token.
    extend_lens: list[int]
    # Tokens each request sees after this batch (prefix + new). Host ints, used by the
    # prefill path only: a captured decode step must not bake them in.
    context_lens: list[int]
    is_decode: bool
    # Which rows of the output hidden states get logits: [R] for sampling, or None = all T.
    logits_indices: torch.Tensor | None = None
    # [R] int64 request-table row of each request: keys per-request state that lives
    # across steps (decode prefetch thresholds). None outside a runtime (oracles, traces).
    request_rows: torch.Tensor | None = None
    # Whether no location is selected twice in the batch. A decode step's are distinct (a
    # query per request, requests share no location); a speculative verify's are not: its
    # Q queries of one request, decode lanes of one row, select mostly the same keys
    # (KVCache.resolve's ``distinct``).
    selections_distinct: bool = True

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_requests(self) -> int:
        return len(self.extend_lens)

    @classmethod
    def whole_prompt(cls, input_ids: torch.Tensor, locs: torch.Tensor) -> ForwardBatch:
        """One request's whole prompt in one prefill (positions 0..n-1 written to ``locs``):
        what oracles and traces run, outside any scheduler."""
        n = int(input_ids.shape[0])
        return cls(
            input_ids=input_ids,
            positions=torch.arange(n, device=input_ids.device),
            out_locs=locs,
            context_locs=locs.unsqueeze(0),
            extend_lens=[n],
            context_lens=[n],
            is_decode=False,
            logits_indices=None,
        )

    def extend_starts(self) -> list[int]:
        starts, acc = [], 0
        for n in self.extend_lens:
            starts.append(acc)
            acc += n
        return starts
