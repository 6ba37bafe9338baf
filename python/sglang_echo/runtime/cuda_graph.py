"""Decode steps captured in CUDA graphs, one graph per batch size.

Batch sizes up to ``max_batch_size`` (SGLang's ``--cuda-graph-max-bs``) get a graph each;
larger batches run eagerly. There is no padding to a bucket: a padded lane would write KV
rows and, under ECHO, take device slots. The first step at a batch size runs eagerly (it
is a real step: ECHO's cache state moves exactly once) and is then captured; later steps
copy their inputs into the graph's static tensors and replay. Capturing needs the whole step to be device-only: fixed shapes, the
indexer over a fixed context width, MoE's dense dispatch, ECHO's graph-safe ops.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from sglang_echo.model.deepseek_v32 import DeepseekV32ForCausalLM
from sglang_echo.model.forward_batch import ForwardBatch
from sglang_echo.model.kv_cache import KVCache


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    batch: ForwardBatch
    logits: torch.Tensor


class CudaGraphDecodeRunner:
    def __init__(
        self,
        model: DeepseekV32ForCausalLM,
        kv_cache: KVCache,
        context_width: int,
        max_batch_size: int | None = None,
    ) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CUDA graphs need a CUDA device")
        if getattr(getattr(kv_cache, "manager", None), "graph_safe", True) is False:
            raise RuntimeError(
                "the ECHO host pool is not device-addressable (no pinned UVA view), so a "
                "decode step cannot be captured; run without CUDA graphs"
            )
        self.model = model
        self.kv_cache = kv_cache
        self.context_width = context_width
        self.max_batch_size = max_batch_size  # larger decode batches run eagerly; None = all
        self.device = model.lm_head.weight.device
        # One graph per batch size and decode-prefetch mode (on / off: under
        # SGLANG_NSA_FUSE_LOGITS_RECALL_DECODE=auto the rule picks per step).
        self.graphs: dict[tuple[int, bool], _Captured] = {}
        self.captures = 0  # batch sizes captured so far (each once, at its first step)
        self.capture_s = 0.0  # their eager first steps and captures, host seconds
        model.set_graph_safe(True)

    def _static_batch(self, bs: int) -> ForwardBatch:
        z = dict(dtype=torch.int64, device=self.device)
        return ForwardBatch(
            input_ids=torch.zeros(bs, **z),
            positions=torch.zeros(bs, **z),
            out_locs=torch.zeros(bs, **z),
            context_locs=torch.zeros(bs, self.context_width, **z),
            extend_lens=[1] * bs,
            context_lens=[0] * bs,
            is_decode=True,
            request_rows=torch.zeros(bs, **z),
        )

    @staticmethod
    def _load(static: ForwardBatch, batch: ForwardBatch) -> None:
        static.input_ids.copy_(batch.input_ids)
        static.positions.copy_(batch.positions)
        static.out_locs.copy_(batch.out_locs)
        width = batch.context_locs.shape[1]
        static.context_locs[:, :width].copy_(batch.context_locs)
        static.context_locs[:, width:].zero_()
        if batch.request_rows is not None:
            static.request_rows.copy_(batch.request_rows)

    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        if not batch.is_decode:
            raise ValueError("only decode batches are captured")
        bs = batch.num_requests
        if self.max_batch_size is not None and bs > self.max_batch_size:
            return self.model(batch, self.kv_cache)
        key = (bs, getattr(self.kv_cache, "decode_prefetch", None) is not None)
        captured = self.graphs.get(key)
        if captured is not None:
            self._load(captured.batch, batch)
            captured.graph.replay()
            return captured.logits.clone()
        t0 = time.perf_counter()
        static = self._static_batch(bs)
        self._load(static, batch)
        result = self.model(static, self.kv_cache).clone()  # the real step, eager
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = self.model(static, self.kv_cache)  # recorded, not executed
        self.graphs[key] = _Captured(graph, static, logits)
        self.captures += 1
        self.capture_s += time.perf_counter() - t0  # the eager step included
        return result
