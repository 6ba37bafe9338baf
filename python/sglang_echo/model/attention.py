"""Multi-head latent attention (MLA) with the weight-absorbed form over the latent cache.

Each token caches one row: its normalized 512-d latent and its roped 64-d key. Queries are
absorbed into latent space (q_nope . W_UK), so attention reads only the selected rows and
the output is lifted back with W_UV. Prefill and decode take the same sparse path:
the selected rows are read in place from the KV buffer by the Triton kernel
(kernels/sparse_mla.py) on CUDA, or gathered and attended in torch (the CPU path and the
reference; SGLANG_ECHO_SPARSE_MLA=torch forces it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from sglang_echo.config import (
    ENV_SPARSE_MLA,
    SPARSE_MLA_BACKENDS,
    ConfigError,
    parse_choice,
)
from sglang_echo.kernels.fp8_kv import decode_kv_rows
from sglang_echo.kernels.invariant_matmul import invariant_bmm
from sglang_echo.kernels.sparse_mla import DECODE_SPLITS, sparse_mla, sparse_mla_from_buffer
from sglang_echo.model.config import DeepseekV32Config, ModelConfigError
from sglang_echo.model.forward_batch import ForwardBatch
from sglang_echo.model.indexer import LightningIndexer
from sglang_echo.model.kv_cache import KVCache
from sglang_echo.model.layers import Linear, RMSNorm, set_batch_invariant
from sglang_echo.model.rope import apply_rope_half, apply_rope_interleaved, attention_softmax_scale

# Largest gathered [queries x top-k x row] block materialized at once (elements).
GATHER_BLOCK_ELEMENTS = 1 << 26
# Which sparse-MLA implementation attends: "torch" (gather the selected rows, then
# sparse_mla), "kernel" (kernels/sparse_mla.py reads them from the buffer, no gather), or
# "auto" (the default): the kernel on CUDA, where it was faster than the torch path on an
# H200 in decode and prefill (benchmark/results/sparse_mla.json; the evidence row "sparse
# MLA kernel"), torch on the CPU. The switch is SGLANG_ECHO_SPARSE_MLA (config.ENV_SPARSE_MLA,
# choices config.SPARSE_MLA_BACKENDS), handed to the model in its ModelKernels.


@dataclass(frozen=True)
class ModelKernels:
    """The model's kernel choices, given when it is built (``load_model(..., kernels=)``,
    ``DeepseekV32ForCausalLM(config, kernels=)``): the model reads no process settings.
    The entry points (the server, ``generate``, the benchmarks) pass
    ``ModelKernels.from_settings(settings())``; the defaults are the registry's, so a model
    built without them (a library user, a test) runs as unset variables do.

    ``sparse_mla``: SGLANG_ECHO_SPARSE_MLA; ``kernel`` applies on CUDA and under
    TRITON_INTERPRET=1 (tests), a CPU run without the interpreter keeps the torch path;
    ``auto`` takes the kernel on CUDA only, so interpreted CPU tests stay fast.
    ``batch_invariant``: SGLANG_ECHO_BATCH_INVARIANT; every matmul of the forward by
    the batch-invariant GEMM (kernels/invariant_matmul.py; model/layers.py
    ``set_batch_invariant``), so a request's logits do not depend on its batch. Values are
    read as the registry reads them (case and spaces ignored); a bad one fails when the
    model is built, naming the allowed values."""

    sparse_mla: str = SPARSE_MLA_BACKENDS[0]
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        try:
            sparse_mla = parse_choice(SPARSE_MLA_BACKENDS)(ENV_SPARSE_MLA, self.sparse_mla)
        except ConfigError as exc:
            raise ModelConfigError(str(exc)) from None
        object.__setattr__(self, "sparse_mla", sparse_mla)

    @classmethod
    def from_settings(cls, parsed) -> ModelKernels:
        """The choices of parsed settings (``config.EchoSettings``: ``.sparse_mla``,
        ``.batch_invariant``); the entry points pass ``settings()``."""
        return cls(sparse_mla=parsed.sparse_mla, batch_invariant=parsed.batch_invariant)

    def apply(self, model: nn.Module) -> None:
        """Switch an already built model (or layer) to these choices: every attention
        layer's sparse-MLA path and every matmul's batch-invariant mode (a model a
        ``--model-loader`` built, a test comparing backends on one model's weights)."""
        set_batch_invariant(model, self.batch_invariant)
        for module in model.modules():
            if isinstance(module, MLAttention):
                module.sparse_mla_backend = self.sparse_mla


def resolve_chunk(
    kv_cache: KVCache, layer_id: int, selected: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Resolve a whole prefill chunk's selections [Q, K] at once -> (buffer, rows [Q, K]).

    Queries of one chunk select heavily overlapping locations (at most the context), so
    under ECHO their distinct locations are resolved in a single call when they fit the
    cache: one look-up, one allocation and one recall per layer and chunk, instead of one
    per block of queries (each with a host read of its distinct count). Rows where
    ``selected`` is -1 point at row 0 (callers mask them). Returns None when the distinct
    locations do not fit; the caller then tries smaller ranges of queries.
    """
    n_queries, topk = selected.shape
    if kv_cache.max_resolve_queries(topk) >= n_queries:
        buffer, rows = kv_cache.resolve(layer_id, selected)
        return buffer, rows.clamp(min=0)
    budget = kv_cache.max_resolve_queries(topk) * topk
    return _resolve_distinct(kv_cache, layer_id, selected, budget)


def kv_storage_dtype(kv_cache: KVCache, q: torch.Tensor) -> torch.dtype:
    """The dtype the pool keeps KV rows in: its row buffer's (uint8 for fp8 rows); the
    query's for a backend that does not say."""
    return kv_cache.kv_dtype or q.dtype


def gather_selected(
    kv_cache: KVCache, layer_id: int, selected: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """Resolve ``selected`` [Q, K] locations and copy their rows into ``out`` [Q, K, D], in
    pieces of as many queries as one resolve may carry; a piece's rows are copied out before
    the next piece may evict them. For a block of queries whose distinct locations exceed
    the cache. Returns the valid mask [Q, K].
    """
    n_queries, topk = selected.shape
    piece = min(n_queries, kv_cache.max_resolve_queries(topk))
    for s in range(0, n_queries, piece):
        e = min(s + piece, n_queries)
        buffer, rows = kv_cache.resolve(layer_id, selected[s:e])
        out[s:e] = buffer[rows.clamp(min=0)]
    return selected >= 0


def _resolve_distinct(
    kv_cache: KVCache, layer_id: int, selected: torch.Tensor, budget: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Resolve the distinct locations of ``selected`` in one call if at most ``budget``
    -> (buffer, rows [Q, K], -1 entries on row 0); None (nothing done) if they do not fit.
    Reads the distinct count on the host: prefill only, never inside a captured step.

    Distinct locations come from a mark per pool location (location 0 is never a token),
    not a sort of all Q x K selections, and each selection finds its row through a table
    over the pool, not a binary search."""
    pool = kv_cache.index_keys(layer_id).shape[0]  # every location, + the unused 0
    flat = selected.clamp(min=0).view(-1)
    mark = torch.zeros(pool, dtype=torch.bool, device=selected.device)
    mark.index_fill_(0, flat, True)
    mark[0] = False
    distinct = mark.nonzero().squeeze(1)  # ascending
    if distinct.numel() > budget or distinct.numel() == 0:
        return None
    buffer, rows = kv_cache.resolve(layer_id, distinct.view(1, -1))
    row_of = torch.zeros(pool, dtype=rows.dtype, device=rows.device)
    row_of.index_copy_(0, distinct, rows.view(-1))  # location 0 keeps row 0
    return buffer, row_of[flat].view(selected.shape)


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}  # one per device


class ResolvedBeside:
    """A decode resolve running on a side stream; ``join`` makes the current stream wait
    for it and returns its (buffer, rows)."""

    def __init__(self, buffer: torch.Tensor, rows: torch.Tensor, side: torch.cuda.Stream):
        self.buffer, self.rows, self.side = buffer, rows, side

    def join(self) -> tuple[torch.Tensor, torch.Tensor]:
        torch.cuda.current_stream(self.rows.device).wait_stream(self.side)
        return self.buffer, self.rows


def resolves_beside(from_tokens: int, batch: ForwardBatch) -> bool:
    """Whether a step of ``batch``'s size runs its resolve on the side stream: a decode
    step of ``from_tokens`` tokens or more (0: none). Why not every step: the fork and join
    cost a fixed few microseconds a layer in the decode graph, and a small step's resolve
    has little to hide behind the query's GEMMs, so below a measured batch the join costs
    more than the overlap saves (SGLANG_ECHO_RESOLVE_OVERLAP). Under CUDA graphs the
    batch is the captured size, so each graph takes one path for all its replays."""
    return batch.is_decode and 0 < from_tokens <= batch.num_tokens


def resolve_beside(
    kv_cache: KVCache, layer_id: int, selected: torch.Tensor, batch: ForwardBatch
) -> ResolvedBeside | None:
    """Start a decode step's resolve on a side stream, forked from the current one (event
    fork and join: it captures in a CUDA graph), where the backend asks for it
    (``resolve_beside_from``: ECHO, ``resolves_beside``). Why: the resolve (cache
    management and the recall of misses over PCIe) is a chain of small, latency-bound
    launches that needs only the selection; beside it the query's up-projection and
    absorption (weight-bound GEMMs) run on the main stream, so at low load the resolve
    costs little more than its join. None: resolve in place, on the current stream. The
    same kernels run in the same order on each stream, so the bits do not change."""
    if not (selected.is_cuda and resolves_beside(kv_cache.resolve_beside_from, batch)):
        return None
    side = _SIDE_STREAMS.get(selected.device)
    if side is None:
        side = _SIDE_STREAMS[selected.device] = torch.cuda.Stream(device=selected.device)
    side.wait_stream(
        torch.cuda.current_stream(selected.device)
    )  # fork: the selection and the step's writes first
    with torch.cuda.stream(side):
        buffer, rows = kv_cache.resolve(layer_id, selected, distinct=batch.selections_distinct)
    return ResolvedBeside(buffer, rows, side)


class MLAttention(nn.Module):
    def __init__(self, config: DeepseekV32Config, kernels: ModelKernels | None = None) -> None:
        super().__init__()
        kernels = kernels if kernels is not None else ModelKernels()
        self.n_heads = config.num_attention_heads
        self.nope_dim = config.qk_nope_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.v_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.rope_interleave = config.rope_interleave
        self.scale = attention_softmax_scale(config.rope, config.qk_head_dim)
        self.q_a_proj = Linear(config.hidden_size, config.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.q_b_proj = Linear(config.q_lora_rank, self.n_heads * config.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(
            config.hidden_size, config.kv_lora_rank + self.rope_dim, bias=False
        )
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, config.rms_norm_eps)
        self.kv_b_proj = Linear(
            config.kv_lora_rank, self.n_heads * (self.nope_dim + self.v_dim), bias=False
        )
        self.o_proj = Linear(self.n_heads * self.v_dim, config.hidden_size, bias=False)
        self.indexer = LightningIndexer(config)
        self.sparse_mla_backend = kernels.sparse_mla  # SGLANG_ECHO_SPARSE_MLA, handed down
        # SGLANG_ECHO_BATCH_INVARIANT (set_batch_invariant sets it with every Linear's): the
        # per-head absorption by the invariant GEMM too.
        self.batch_invariant = False
        if kernels.batch_invariant:
            set_batch_invariant(self, True)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.rope_interleave:
            return apply_rope_interleaved(x, cos, sin)
        return apply_rope_half(x, cos, sin)

    def _absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.kv_b_proj.weight.view(self.n_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return w[:, : self.nope_dim], w[:, self.nope_dim :]  # W_UK [H, dn, r], W_UV [H, dv, r]

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        kv_cache: KVCache,
        layer_id: int,
    ) -> torch.Tensor:
        n_tokens = hidden.shape[0]
        q_resid = self.q_a_layernorm(self.q_a_proj(hidden))
        latent, k_pe = self.kv_a_proj_with_mqa(hidden).split(
            [self.kv_lora_rank, self.rope_dim], dim=-1
        )
        latent = self.kv_a_layernorm(latent)
        k_pe = self._rope(k_pe.unsqueeze(1), cos, sin).squeeze(1)

        kv_cache.write(
            layer_id,
            batch.out_locs,
            torch.cat((latent, k_pe), dim=-1),
            self.indexer.project_key(hidden, cos, sin),
            decode=batch.is_decode,
        )
        iq, iw = self.indexer.project_query(hidden, q_resid, cos, sin)
        keys = kv_cache.index_keys(layer_id)
        # ECHO's decode and prefill prefetch, when on (None otherwise: KVCache). The decode
        # prefetch's thresholds are one per request row: a verify, whose lanes share rows,
        # runs without it (what attention reads is the exact top-k's either way).
        prefetch = kv_cache.decode_prefetch if batch.selections_distinct else None
        extend_prefetch = kv_cache.prefill_prefetch
        if prefetch is None and extend_prefetch is None:
            # The plain call (hooks such as topk/tracer.py wrap it).
            selected = self.indexer.select(iq, iw, keys, batch)
        else:
            selected = self.indexer.select(
                iq, iw, keys, batch, prefetch, layer_id, extend_prefetch=extend_prefetch
            )
        # The query's up-projection and absorption need nothing from the cache: they run
        # after the selection, so that a decode resolve started beside them overlaps them.
        resolved = resolve_beside(kv_cache, layer_id, selected, batch)
        q = self.q_b_proj(q_resid).view(n_tokens, self.n_heads, self.nope_dim + self.rope_dim)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q_pe = self._rope(q_pe, cos, sin)
        w_uk, w_uv = self._absorbed_weights()
        if self.batch_invariant:
            q_lat = self._absorb(q_nope, w_uk.transpose(1, 2))
        else:
            q_lat = torch.einsum("thd,hdr->thr", q_nope, w_uk)
        q_full = torch.cat((q_lat, q_pe), dim=-1)
        out_lat = self._attend(q_full, selected, batch, kv_cache, layer_id, resolved)
        if self.batch_invariant:
            out = self._absorb(out_lat, w_uv)
        else:
            out = torch.einsum("thr,hvr->thv", out_lat, w_uv)
        return self.o_proj(out.reshape(n_tokens, self.n_heads * self.v_dim))

    def _absorb(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Batch-invariant mode's absorption: per head h, x[:, h] @ w[h].T, x [T, H, K],
        w [H, N, K] -> [T, H, N], by the invariant GEMM on head-major views (no copies)."""
        out = x.new_empty(x.shape[0], x.shape[1], w.shape[1])
        invariant_bmm(x.transpose(0, 1), w, out=out.transpose(0, 1))
        return out

    def _attend(
        self,
        q_full: torch.Tensor,
        selected: torch.Tensor,
        batch: ForwardBatch,
        kv_cache: KVCache,
        layer_id: int,
        resolved: ResolvedBeside | None = None,
    ) -> torch.Tensor:
        # The kernel runs on CUDA, and on the CPU only under the Triton interpreter when asked
        # for by name (tests); elsewhere the torch path runs, whatever the switch says.
        kernel = q_full.is_cuda and self.sparse_mla_backend != "torch"
        kernel = kernel or (
            self.sparse_mla_backend == "kernel" and os.environ.get("TRITON_INTERPRET") == "1"
        )
        if batch.is_decode:
            # One resolve for the whole decode step (the config guarantees it fits), so the
            # step keeps fixed shapes and stays capturable in a CUDA graph.
            if resolved is not None:
                buffer, rows = resolved.join()
            else:
                buffer, rows = kv_cache.resolve(
                    layer_id, selected, distinct=batch.selections_distinct
                )
            if kernel:  # rows are -1 where selected is (KVCache.resolve)
                return self._kernel(q_full, buffer, rows, splits=DECODE_SPLITS)
            kv = decode_kv_rows(buffer[rows.clamp(min=0)], self.kv_lora_rank, q_full.dtype)
            return sparse_mla(q_full, kv, selected >= 0, self.kv_lora_rank, self.scale)
        return self._attend_prefill(q_full, selected, kv_cache, layer_id, kernel)

    def _attend_prefill(
        self,
        q_full: torch.Tensor,
        selected: torch.Tensor,
        kv_cache: KVCache,
        layer_id: int,
        kernel: bool,
    ) -> torch.Tensor:
        """Prefill attention in blocks of queries on a grid fixed from query 0, so every
        block has the same shape whatever the KV backend (batched matmuls may round
        differently at other shapes: the blocks keep offload bit-identical).

        Resolves go by ranges of whole blocks: the whole chunk if its distinct locations
        fit the cache (always, without ECHO), otherwise halves, quarters... A range's rows
        are used before the next range is resolved, since that may evict them. A single
        block that does not fit is gathered piece by piece (``gather_selected``).
        """
        n_tokens, topk = selected.shape
        block = max(1, GATHER_BLOCK_ELEMENTS // (topk * q_full.shape[-1]))
        out = q_full.new_empty(n_tokens, self.n_heads, self.kv_lora_rank)
        # Staged rows as the pool stores them (fp8 rows are bytes), decoded after the copy.
        row_dim = kv_cache.kv_row_dim
        staged = torch.empty(
            min(block, n_tokens), topk, row_dim, dtype=kv_storage_dtype(kv_cache, q_full),
            device=q_full.device,
        )  # fmt: skip
        ranges = [(0, -(-n_tokens // block))]  # [first block, end block), a stack
        while ranges:
            b0, b1 = ranges.pop()
            s0, e0 = b0 * block, min(b1 * block, n_tokens)
            resolved = resolve_chunk(kv_cache, layer_id, selected[s0:e0])
            if resolved is None and b1 - b0 > 1:
                mid = (b0 + b1) // 2
                ranges += [(mid, b1), (b0, mid)]  # the lower half first
                continue
            if kernel and resolved is not None:  # straight from the buffer, no staging
                buffer, rows = resolved
                rows = torch.where(selected[s0:e0] >= 0, rows, -1)
                out[s0:e0] = self._kernel(q_full[s0:e0], buffer, rows)
                continue
            for s in range(s0, e0, block):
                e = min(s + block, e0)
                kv = staged[: e - s]
                if resolved is None:
                    valid = gather_selected(kv_cache, layer_id, selected[s:e], kv)
                else:
                    buffer, rows = resolved
                    flat_rows = rows[s - s0 : e - s0].reshape(-1)
                    torch.index_select(buffer, 0, flat_rows, out=kv.view(-1, row_dim))
                    valid = selected[s:e] >= 0
                if kernel:  # the staged copy as the buffer: the same rows in the same order
                    flat = torch.arange(kv.shape[0] * topk, device=kv.device).view(-1, topk)
                    rows_in_stage = torch.where(valid, flat, -1)
                    out[s:e] = self._kernel(q_full[s:e], kv.view(-1, row_dim), rows_in_stage)
                else:
                    rows_e = decode_kv_rows(kv, self.kv_lora_rank, q_full.dtype)
                    out[s:e] = sparse_mla(q_full[s:e], rows_e, valid, self.kv_lora_rank, self.scale)
        return out

    def _kernel(
        self, q: torch.Tensor, buffer: torch.Tensor, rows: torch.Tensor, splits: int = 1
    ) -> torch.Tensor:
        """Sparse MLA read through ``rows`` from ``buffer`` (the Triton kernel); decode
        splits each query's rows (``DECODE_SPLITS``), prefill does not."""
        return sparse_mla_from_buffer(q, buffer, rows, self.kv_lora_rank, self.scale, splits=splits)
