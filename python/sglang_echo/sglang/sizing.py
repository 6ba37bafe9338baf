"""Start-up sizing: every byte ECHO's plan puts on a GPU and in pinned host memory, and
whether it fits, decided while sglang resolves its arguments (before any weight loads).

Why at resolution: sglang sizes its KV pools only after loading the weights (minutes on
a 671B model), and HiSparse and ECHO allocate more after that. A plan that cannot fit
must fail in the launcher, with the sizes that would fit, not after the load.

All sizes are per attention-DP rank, i.e. per GPU: under DP attention each rank has its
own pools, and under plain TP every rank holds a copy of the same pools. Symbols:
N_G = ``NSA_DEV_CACHE_SIZE``, T = the user's ``--max-total-tokens``, S = HiSparse's
device rows (sglang's ``max_total_tokens``), R = ``host_to_device_ratio``, L = layers.

On the GPU (``device_bytes``):

- ECHO's rows, in HiSparse's device pool: ``(S + 64) x row x L`` (sglang adds a padding
  page); row = 656 B for fp8 KV, 1152 B for bf16 (DeepSeek-V3.2's 512 + 64 dims).
- sglang's index keys for the whole host pool (HiSparseDSATokenToKVPool sizes its
  IndexKeyCache by ``S x R``): ``floor((S x R + 65) / 64)`` pages of 64 x 132 B per layer.
- ECHO's metadata, allocated by the coordinator after sglang profiled memory, so sglang
  does not count it: per layer the DeviceCache tensors (host_to_device int32 over the host
  pool, device_to_host int32 and priority int64 over the slots, the free stack, counters),
  plus one allocation workspace per rank.
- the request tables HiSparse allocates after profiling: ``req_to_host_pool`` int64
  [slots, context + 68], its top-k row table, ECHO's newest-row table, and the
  per-request buffer tables that ECHO frees right away (counted: the caching allocator
  need not reuse their blocks).
- with the plugin's decode prefetch (``SGLANG_NSA_FUSE_LOGITS_RECALL_DECODE=1``), its
  staging buffer, host-id map and thresholds, also allocated by the coordinator.

On the host (``host_bytes``): HiSparse's pinned pool, ``(S x R + 64) x row x L`` per rank,
once per GPU of a node.

What there is (``Budget``): sglang's static-fraction rule gives the KV pools
``mem_fraction_static x GPU memory - weights`` (sglang profiles the free memory after
loading, less ``(1 - mem_fraction_static)`` of the memory before; GPU memory stands in
for the latter, which is smaller by the CUDA context). The weights are estimated from the
checkpoint's config.json (``weight_bytes``). Since sglang only limits its own pools and
ECHO's metadata comes later, the plan fits when all four device totals fit that budget,
and the host pools of a node fit sglang's host-memory rule (available memory less its
10 GiB reserve, as HiCache's host pools are checked).

Pure Python: ``sglang_echo.sglang.args`` gathers the inputs from sglang's resolved view.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from sglang_echo.config import default_eviction_reserve, default_stage_rows

PAGE = 64  # DSA's page size (sglang forces 64)
SCALE_BLOCK = 128  # DSATokenToKVPool.quant_block_size: one fp32 scale per 128 values
HOST_RESERVE = 10 * 2**30  # sglang's HICACHE_HOST_MEMORY_RESERVE_BYTES
# req_to_token rows are context + 4 wide (get_req_to_token_extra_context_len without
# speculative decoding); req_to_host_pool adds one page.
REQ_EXTRA_CONTEXT = 4
# kernels/alloc.py's AllocWorkspace geometry (HIST_BINS, LANE_BLOCK, SLOT_BLOCK,
# LOOKBACK_LANE_BLOCK; copied so that this module stays free of torch and triton;
# tests/sglang/test_sizing.py builds the real workspace and compares).
ALLOC_HIST_BINS, ALLOC_LANE_BLOCK, ALLOC_SLOT_BLOCK = 256, 1024, 2048
ALLOC_LOOKBACK_LANE_BLOCK = 512
# sglang/decode_prefetch.py's PLUGIN_STAGE_CHUNKS (copied for the same reason; the test
# builds the plugin's prefetcher and compares).
PLUGIN_STAGE_CHUNKS = 1
GiB = 2**30


def ceil_to(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def gib(nbytes: float) -> str:
    """Bytes as the messages print them."""
    return f"{nbytes / GiB:.2f} GiB"


# ------------------------------------------------------------------------ the plan's sizes
@dataclass(frozen=True)
class EchoSizes:
    """What ECHO's plan sizes for one attention-DP rank (args.plan_echo's arithmetic)."""

    dev_cache_size: int  # N_G
    host_tokens: int  # T
    top_k: int
    prefill_rows: int  # a local prefill's rows (ceil64 of the context), 0 on a PD decode node
    running: int | None = None  # requests per rank the user asked for; None: N_G // top-k

    @property
    def per_rank_running(self) -> int:
        """Running requests per rank: one decode step's selections must fit N_G."""
        return self.dev_cache_size // self.top_k if self.running is None else self.running

    @property
    def device_rows(self) -> int:
        """S = ceil64(N_G + 1) + one 64-row newest page per running request + prefill rows."""
        return (
            ceil_to(self.dev_cache_size + 1, PAGE)
            + self.per_rank_running * PAGE
            + self.prefill_rows
        )

    @property
    def ratio(self) -> int:
        """R: sglang's host pool has S x R + 64 slots (it adds one page); ECHO keeps two
        pages (its sink and scratch rows; the coordinator holds the logical ids they cannot
        serve), so S x R - 64 slots hold tokens, at least T."""
        return max(1, math.ceil((self.host_tokens + PAGE) / self.device_rows))

    @property
    def host_slots(self) -> int:
        """sglang's host pool (and logical pool): S x R plus its padding page."""
        return self.device_rows * self.ratio + PAGE

    def valid(self) -> bool:
        running = self.per_rank_running
        return running >= 1 and running * self.top_k <= self.dev_cache_size


@dataclass(frozen=True)
class RankShape:
    """What the bytes depend on besides the plan, read from the model and sglang."""

    layers: int  # L: KV layers (the model's num_hidden_layers)
    row_bytes: int  # one token's MLA row in one layer: kv_row_bytes()
    index_row_bytes: int  # one token's index key + scale in one layer: index_row_bytes()
    context_len: int  # sglang's context length (the request tables' width)
    extra_req_slots: int = 0  # PD decode's pre-allocation slots (sglang's resolved value)
    eviction_reserve: int | None = None  # SGLANG_ECHO_EVICTION_RESERVE; None: its default
    decode_prefetch: bool = False  # SGLANG_NSA_FUSE_LOGITS_RECALL_DECODE=1: its staging


def kv_row_bytes(config: Mapping[str, Any], fp8: bool) -> int:
    """One token's MLA row: bf16 (kv_lora_rank + rope) values, or sglang's fp8 DSA layout
    (fp8 latent, one fp32 scale per 128 values, bf16 rope): 1152 / 656 B for DeepSeek-V3.2."""
    lora, rope = int(config["kv_lora_rank"]), int(config["qk_rope_head_dim"])
    if fp8:
        return lora + lora // SCALE_BLOCK * 4 + rope * 2
    return (lora + rope) * 2


def index_row_bytes(config: Mapping[str, Any]) -> int:
    """One token's indexer key: fp8 values plus one fp32 scale per 128 (132 B at dim 128)."""
    dim = int(config.get("index_head_dim", 128))
    return dim + dim // SCALE_BLOCK * 4


# --------------------------------------------------------------------------- GPU and host
@dataclass(frozen=True)
class DeviceBytes:
    """Bytes one GPU holds for the plan."""

    echo_rows: int  # HiSparse's device pool: ECHO's slots, newest pages, prefill rows
    index_keys: int  # sglang's index keys for every host-pool token
    echo_metadata: int  # ECHO's maps, priorities, free stacks, counters; its workspace
    request_tables: int  # HiSparse's request tables allocated after profiling
    decode_prefetch: int = 0  # the plugin's decode prefetch staging, when on

    @property
    def total(self) -> int:
        return (
            self.echo_rows
            + self.index_keys
            + self.echo_metadata
            + self.request_tables
            + self.decode_prefetch
        )

    def lines(self, sizes: EchoSizes, shape: RankShape) -> list[str]:
        """One line per total: what it is, its formula with the numbers, its bytes."""
        s, r, layers = sizes.device_rows, sizes.ratio, shape.layers
        pages = (s * r + PAGE + 1) // PAGE
        rows = [
            ("ECHO's device rows", f"(S + 64) x {shape.row_bytes} B x {layers} layers"),
            (
                "sglang's index keys",
                f"{pages} pages of S x R = {s * r} x 64 x {shape.index_row_bytes} B x {layers}",
            ),
            (
                "ECHO's metadata",
                f"maps of {sizes.host_slots} host + {sizes.dev_cache_size} slots x {layers}",
            ),
            (
                "request tables",
                f"{request_slots(sizes, shape)} slots x context {shape.context_len}",
            ),
        ]
        values = [self.echo_rows, self.index_keys, self.echo_metadata, self.request_tables]
        if self.decode_prefetch:
            per_request = default_stage_rows(shape.row_bytes)
            formula = f"{request_slots(sizes, shape)} slots x {per_request} rows + host map"
            rows.append(("decode prefetch", formula))
            values.append(self.decode_prefetch)
        return [
            f"{name:<20}{formula:<58}{gib(v):>11}"
            for (name, formula), v in zip(rows, values, strict=True)
        ]


def echo_metadata_bytes(
    dev_cache_size: int, host_slots: int, layers: int, eviction_reserve: int | None = None
) -> int:
    """ECHO's device tensors besides the rows: DeviceCache (offload/device_cache.py) over
    N_H = host_slots - 2 host ids and N_G slots, EchoManager's counters, the one
    AllocWorkspace (kernels/alloc.py, max lanes N_G) of the rank, and the ids the
    coordinator reserves. ``eviction_reserve``: SGLANG_ECHO_EVICTION_RESERVE, None for its
    default."""
    n = dev_cache_size
    reserve = default_eviction_reserve(n) if eviction_reserve is None else eviction_reserve
    per_layer = (
        4 * host_slots  # host_to_device int32 [N_H + 2]
        + 4 * (n + 2)  # device_to_host int32 [N_G + 2]
        + 8 * (n + 2)  # priority int64 [N_G + 2]
        + 4 * (n + 1)  # free_stack int32 [N_G + 1]
        + 4 + 8  # free_count int32, clock int64
        + 5 * 8  # hits, misses, evictions, append_evictions, recalled_rows int64
        + 2 * 8  # EchoManager: prefetched_rows, prefetch_hits int64
    )  # fmt: skip
    workspace = (
        4 * ALLOC_HIST_BINS  # hist int32
        + 4 * max(1, -(-n // ALLOC_LANE_BLOCK))  # lane_counts int32
        + 4 * 2 * -(-(n + 2) // ALLOC_SLOT_BLOCK)  # slot_counts int32
        + 2 * 8 * (n + 1)  # miss_ids, miss_slots int64 [N_G + 1]
        + 8 + 4  # miss_count int64, miss_bound int32
        + 4 * max(1, reserve)  # extras int32
        + 2 * (n + 2)  # buckets int16 [N_G + 2]
        + 4 * 2  # tickets int32 (the look-back resolve's, kernels/alloc_lookback.py)
        + 4 * 2 * max(1, -(-n // ALLOC_LOOKBACK_LANE_BLOCK))  # tile_words [2, look-back programs]
        + 8 * -(-(n + 2) // ALLOC_SLOT_BLOCK)  # slot_words int64
        + 2 * 8  # call_counts int64 [2]
        + 4 * max(1, n)  # lane_ref int32 [N_G]
    )  # fmt: skip
    coordinator = (
        8 * ceil_to(n + 1, PAGE)  # reserved_device_rows int64: ECHO's rows' ids
        + 8 * PAGE  # reserved_logical_ids int64: the page the host pool cannot serve
        + 8  # EchoManager.release_errors int64
    )
    return layers * per_layer + workspace + coordinator


def decode_prefetch_bytes(request_slots: int, host_slots: int, row_bytes: int, layers: int) -> int:
    """The plugin's decode prefetch (sglang/decode_prefetch.py's DecodePrefetcher, made by
    the coordinator after sglang profiled memory): staging rows and their int64 host ids
    (request slots x the default rows per request), the chunks' int32 counters, the int32
    host-id map over the host pool (N_H + 2 = host slots), and each layer's thresholds
    (float32 and bool per request slot, plus a scratch row)."""
    chunks = PLUGIN_STAGE_CHUNKS
    entries = request_slots * (default_stage_rows(row_bytes) // chunks * chunks)
    return (
        entries * (row_bytes + 8) + 4 * chunks + 4 * host_slots + layers * 5 * (request_slots + 1)
    )


def request_slots(sizes: EchoSizes, shape: RankShape) -> int:
    """sglang's request slots per rank: running + PD pre-allocation + the padding slot."""
    return sizes.per_rank_running + shape.extra_req_slots + 1


def request_table_bytes(sizes: EchoSizes, shape: RankShape) -> int:
    """HiSparse's tables (hisparse_coordinator.py), allocated after sglang profiled memory:
    req_to_host_pool int64 [slots, context + 4 + 64], top_k_device_locs_buffer int32
    [slots, top-k], ECHO's newest_row int64 [slots], and the per-request buffer tables
    ECHO frees at start-up (int64 [slots, B + 64], 2 x int32 [L, slots, B + 64], int16
    [L, slots, B], int32 [slots, top-k], int16 [B]; B = ceil64(top-k))."""
    slots = request_slots(sizes, shape)
    top_k, buf = sizes.top_k, ceil_to(sizes.top_k, PAGE)
    kept = slots * (
        8 * (shape.context_len + REQ_EXTRA_CONTEXT + PAGE) + 4 * top_k + 8  # + newest_row
    )
    freed = (
        slots * 8 * (buf + PAGE)
        + 2 * shape.layers * slots * 4 * (buf + PAGE)
        + shape.layers * slots * 2 * buf
        + slots * 4 * top_k
        + 2 * buf
    )
    return kept + freed


def device_bytes(sizes: EchoSizes, shape: RankShape) -> DeviceBytes:
    """Every byte one GPU holds for the plan (module docstring)."""
    s, layers = sizes.device_rows, shape.layers
    index_pages = (s * sizes.ratio + PAGE + 1) // PAGE  # IndexKeyCache's num_pages
    return DeviceBytes(
        echo_rows=(s + PAGE) * shape.row_bytes * layers,
        index_keys=index_pages * PAGE * shape.index_row_bytes * layers,
        echo_metadata=echo_metadata_bytes(
            sizes.dev_cache_size, sizes.host_slots, layers, shape.eviction_reserve
        ),
        request_tables=request_table_bytes(sizes, shape),
        decode_prefetch=(
            decode_prefetch_bytes(
                request_slots(sizes, shape), sizes.host_slots, shape.row_bytes, layers
            )
            if shape.decode_prefetch
            else 0
        ),
    )


@dataclass(frozen=True)
class HostBytes:
    per_rank: int  # one rank's pinned pool
    ranks_per_node: int  # GPUs of a node: each holds its own pool

    @property
    def per_node(self) -> int:
        return self.per_rank * self.ranks_per_node


def host_bytes(sizes: EchoSizes, shape: RankShape, ranks_per_node: int) -> HostBytes:
    """HiSparse's pinned host pool: (S x R + 64) slots x row x L per rank."""
    return HostBytes(sizes.host_slots * shape.row_bytes * shape.layers, ranks_per_node)


# ------------------------------------------------------------------------------ weights
@dataclass(frozen=True)
class Parallel:
    """The parallel layout that splits the weights (pipeline parallelism is refused)."""

    tp_size: int = 1
    attn_dp_size: int = 1
    nnodes: int = 1
    enable_dp_lm_head: bool = False
    moe_dense_tp_size: int | None = None

    @property
    def attn_tp_size(self) -> int:
        return max(1, self.tp_size // self.attn_dp_size)

    @property
    def ranks_per_node(self) -> int:
        return max(1, self.tp_size // max(1, self.nnodes))


@dataclass(frozen=True)
class WeightBytes:
    """One GPU's share of the weights, by part."""

    attention: int  # MLA + indexer (+ the absorbed bf16 copies of kv_b), norms
    embeddings: int  # input embedding + lm_head
    dense_mlp: int  # the first_k_dense_replace layers' MLPs
    shared_experts: int
    routed_experts: int
    routers: int  # MoE gates and their bias

    @property
    def total(self) -> int:
        return (
            self.attention
            + self.embeddings
            + self.dense_mlp
            + self.shared_experts
            + self.routed_experts
            + self.routers
        )


_INT_METHODS = ("awq", "awq_marlin", "gptq", "gptq_marlin", "moe_wna16")
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}


class UnknownWeights(ValueError):
    """The config does not say enough to estimate the weights' bytes."""


def _unconverted(quant: Mapping[str, Any], module: str) -> bool:
    names = [*(quant.get("modules_to_not_convert") or []), *(quant.get("ignored_layers") or [])]
    return any(name and name in module for name in names)


def matrix_bytes(
    quant: Mapping[str, Any] | None,
    module: str,
    rows: int,
    cols: int,
    *,
    expert: bool = False,
    dtype_bytes: int = 2,
) -> int:
    """Bytes of one ``[rows, cols]`` linear weight as the checkpoint stores it: fp8 = 1 B
    per value + an fp32 scale per weight block; 4-bit group quantization (AWQ/GPTQ, what
    --quantization moe_wna16 loads) = packed values + an fp16 scale and a packed zero per
    group of inputs; w4afp8 = 4-bit experts with fp32 group scales, fp8 elsewhere;
    unquantized, or a module the config leaves unconverted = the checkpoint's dtype."""
    method = str((quant or {}).get("quant_method", "")).lower()
    if not quant or _unconverted(quant, module):
        return rows * cols * dtype_bytes
    if method == "fp8" or (method == "w4afp8" and not expert):
        block = quant.get("weight_block_size") or [SCALE_BLOCK, SCALE_BLOCK]
        b0, b1 = int(block[0]), int(block[1])
        return rows * cols + 4 * (-(-rows // b0)) * (-(-cols // b1))
    if method == "w4afp8":
        group = int(quant.get("group_size", SCALE_BLOCK))
        return rows * cols // 2 + 4 * rows * (-(-cols // group))
    if method in _INT_METHODS:
        bits = int(quant.get("bits", quant.get("w_bit", 4)))
        group = int(quant.get("group_size", quant.get("q_group_size", SCALE_BLOCK)))
        groups = 1 if group <= 0 else -(-cols // group)
        return rows * cols * bits // 8 + groups * rows * (2 * 8 + bits) // 8
    raise UnknownWeights(f"quantization {method!r}")


def weight_bytes(
    config: Mapping[str, Any], parallel: Parallel, quantization: str | None = None
) -> WeightBytes:
    """One GPU's share of a DeepSeek-V3.2-style (MLA + DSA indexer + MoE) checkpoint,
    counted from config.json: every weight matrix's bytes (``matrix_bytes``), norms and
    gates in the checkpoint's dtype, each part divided as sglang loads it:

    - attention: q_b/q, kv_b, o and sglang's absorbed bf16 copies of kv_b (w_kc, w_vc)
      split by attention-TP (tp / attn_dp); q_a, kv_a, the indexer and norms replicated;
    - the input embedding by attention-TP under DP attention, else by TP; lm_head by TP
      (attention-TP with --enable-dp-lm-head);
    - dense MLPs by TP (replicated with --moe-dense-tp-size 1); shared and routed experts
      by TP (= EP x MoE-TP); gates and their bias replicated.

    Not counted: the MTP layer (loaded only for speculative decoding, which ECHO refuses),
    vocabulary padding, per-tensor scalars. ``quantization`` (``--quantization``) applies
    only when config.json has no quantization_config (online fp8). Raises UnknownWeights
    when a field or the quantization is unknown."""
    try:
        h = int(config["hidden_size"])
        vocab = int(config["vocab_size"])
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        kv_lora = int(config["kv_lora_rank"])
        nope, rope = int(config["qk_nope_head_dim"]), int(config["qk_rope_head_dim"])
        v_dim = int(config["v_head_dim"])
        q_lora = int(config.get("q_lora_rank") or 0)
        idx_heads = int(config.get("index_n_heads") or 0)
        idx_dim = int(config.get("index_head_dim") or 0)
        dense_inter = int(config["intermediate_size"])
        moe_inter = int(config.get("moe_intermediate_size") or 0)
        experts = int(config.get("n_routed_experts") or 0)
        shared = int(config.get("n_shared_experts") or 0)
        first_dense = int(config.get("first_k_dense_replace") or 0) if experts else layers
        freq = int(config.get("moe_layer_freq") or 1)
    except (KeyError, TypeError, ValueError) as exc:
        raise UnknownWeights(f"config.json lacks {exc}") from exc
    quant = config.get("quantization_config") or (
        {"quant_method": quantization} if quantization else None
    )
    dt = _DTYPE_BYTES.get(str(config.get("torch_dtype", "bfloat16")), 2)

    def mat(module: str, rows: int, cols: int, expert: bool = False) -> int:
        return matrix_bytes(quant, module, rows, cols, expert=expert, dtype_bytes=dt)

    parts = dict.fromkeys(
        ("attn_split", "attn_replicated", "dense", "shared", "routed", "routers"), 0
    )
    q_in = q_lora or h  # q_b reads the q_a latent; without q_lora, q_proj reads the hidden
    for i in range(layers):
        attn = f"model.layers.{i}.self_attn"
        parts["attn_split"] += (
            mat(f"{attn}.q_b_proj" if q_lora else f"{attn}.q_proj", heads * (nope + rope), q_in)
            + mat(f"{attn}.kv_b_proj", heads * (nope + v_dim), kv_lora)
            + mat(f"{attn}.o_proj", h, heads * v_dim)
            + 2 * heads * (nope + v_dim) * kv_lora  # w_kc, w_vc (bf16)
        )
        parts["attn_replicated"] += (
            mat(f"{attn}.kv_a_proj_with_mqa", kv_lora + rope, h)
            + dt * (kv_lora + 2 * h)  # kv_a_layernorm, input and post-attention norms
            + (mat(f"{attn}.q_a_proj", q_lora, h) + dt * q_lora if q_lora else 0)
        )
        if idx_heads and idx_dim:
            parts["attn_replicated"] += (
                mat(f"{attn}.indexer.wq_b", idx_heads * idx_dim, q_in)
                + mat(f"{attn}.indexer.wk", idx_dim, h)
                + dt * idx_heads * h  # weights_proj (unquantized)
                + dt * 2 * idx_dim  # k_norm weight and bias
            )
        mlp = f"model.layers.{i}.mlp"
        if i < first_dense or (i - first_dense) % freq:
            parts["dense"] += 2 * mat(mlp, dense_inter, h) + mat(mlp, h, dense_inter)
            continue
        routed = f"{mlp}.experts"
        parts["routed"] += experts * (
            2 * mat(routed, moe_inter, h, True) + mat(routed, h, moe_inter, True)
        )
        one = f"{mlp}.shared_experts"
        parts["shared"] += shared * (2 * mat(one, moe_inter, h) + mat(one, h, moe_inter))
        parts["routers"] += dt * experts * h + 4 * experts  # gate, e_score_correction_bias

    def share(nbytes: int, ways: int) -> int:
        return -(-nbytes // max(1, ways))

    tp, attn_tp = max(1, parallel.tp_size), parallel.attn_tp_size
    dense_tp = 1 if parallel.moe_dense_tp_size == 1 else tp
    table = dt * vocab * h
    return WeightBytes(
        attention=share(parts["attn_split"], attn_tp) + parts["attn_replicated"],
        embeddings=share(table, attn_tp if parallel.attn_dp_size > 1 else tp)
        + share(table, attn_tp if parallel.enable_dp_lm_head else tp)
        + dt * h,  # the final norm
        dense_mlp=share(parts["dense"], dense_tp),
        shared_experts=share(parts["shared"], tp),
        routed_experts=share(parts["routed"], tp),
        routers=parts["routers"],
    )


# ------------------------------------------------------------------------------- budget
@dataclass(frozen=True)
class Budget:
    """What one GPU and one node have for the plan."""

    gpu_memory: int  # bytes of one GPU (sglang's get_device_memory_capacity)
    mem_fraction_static: float
    weights: WeightBytes
    ranks_per_node: int
    host_available: int | None = None  # the node's available memory; None: not checked
    host_reserve: int = HOST_RESERVE

    @property
    def static_bytes(self) -> int:
        return int(self.gpu_memory * self.mem_fraction_static)

    @property
    def kv_bytes(self) -> int:
        """sglang's static-fraction rule: what is left for KV after the weights."""
        return self.static_bytes - self.weights.total

    @property
    def host_limit(self) -> int | None:
        if self.host_available is None:
            return None
        return self.host_available - self.host_reserve


@dataclass(frozen=True)
class Sizing:
    """The plan's totals against the budget, and, when it does not fit, the largest
    --max-total-tokens (at this N_G) and NSA_DEV_CACHE_SIZE (at this T) that do."""

    sizes: EchoSizes
    shape: RankShape
    budget: Budget
    device: DeviceBytes
    host: HostBytes
    largest_host_tokens: int | None = None
    largest_dev_cache: int | None = None

    @property
    def fits_device(self) -> bool:
        return self.device.total <= self.budget.kv_bytes

    @property
    def fits_host(self) -> bool:
        limit = self.budget.host_limit
        return limit is None or self.host.per_node <= limit

    @property
    def fits(self) -> bool:
        return self.fits_device and self.fits_host

    def summary(self) -> str:
        """Every total, for the start-up log, the error message and README's sizing."""
        b, s, shape = self.budget, self.sizes, self.shape
        w = b.weights
        fit = "<=" if self.fits_device else ">"
        lines = [
            f"per GPU: N_G {s.dev_cache_size}, T {s.host_tokens}, {s.per_rank_running} "
            f"running -> S = {s.device_rows} device rows, R = {s.ratio}",
            *self.device.lines(s, shape),
            f"GPU total {gib(self.device.total)} {fit} KV budget {gib(b.kv_bytes)} = "
            f"{b.mem_fraction_static} x {gib(b.gpu_memory)} - weights {gib(w.total)}",
            f"weights from config.json: attention {gib(w.attention)}, embeddings "
            f"{gib(w.embeddings)}, dense MLPs {gib(w.dense_mlp)},",
            f"  shared experts {gib(w.shared_experts)}, routed experts "
            f"{gib(w.routed_experts)}, routers {gib(w.routers)}",
            f"pinned host pool (S x R + 64) x {shape.row_bytes} B x {shape.layers} layers = "
            f"{gib(self.host.per_rank)} x {self.host.ranks_per_node} ranks per node = "
            f"{gib(self.host.per_node)}",
        ]
        if b.host_limit is not None:
            lines.append(
                f"  {'<=' if self.fits_host else '>'} {gib(b.host_limit)}: available host "
                f"memory {gib(b.host_available or 0)} - sglang's reserve {gib(b.host_reserve)}"
            )
        return "\n".join(f"    {line}" for line in lines)

    def message(self) -> str:
        """Why the plan does not fit, every total, and the largest values that do."""
        where = []
        if not self.fits_device:
            where.append(f"the GPU ({gib(self.device.total)} > {gib(self.budget.kv_bytes)})")
        if not self.fits_host:
            where.append(
                f"the host ({gib(self.host.per_node)} > {gib(self.budget.host_limit or 0)})"
            )
        s = self.sizes
        if self.largest_host_tokens is None:
            by_t = f"no --max-total-tokens fits with NSA_DEV_CACHE_SIZE={s.dev_cache_size}"
        else:
            by_t = (
                f"--max-total-tokens {self.largest_host_tokens} (with "
                f"NSA_DEV_CACHE_SIZE={s.dev_cache_size})"
            )
        if self.largest_dev_cache is None:
            by_n = f"no NSA_DEV_CACHE_SIZE fits with --max-total-tokens {s.host_tokens}"
        else:
            by_n = (
                f"NSA_DEV_CACHE_SIZE={self.largest_dev_cache} (with --max-total-tokens "
                f"{s.host_tokens})"
            )
        other = (
            "raise --mem-fraction-static or spread the weights over more GPUs"
            if not self.fits_device
            else "free host memory"
        )
        b = self.budget
        if b.kv_bytes <= 0:  # nothing any ECHO setting could change
            return (
                f"the weights alone ({gib(b.weights.total)} per GPU) fill sglang's static "
                f"share of the GPU ({b.mem_fraction_static} x {gib(b.gpu_memory)} = "
                f"{gib(b.static_bytes)}): no KV pool fits; use GPUs with more memory, more "
                "GPUs for the weights, or a smaller checkpoint.\n" + self.summary()
            )
        return (
            f"ECHO's pools do not fit {' and '.join(where)}:\n{self.summary()}\n"
            f"    largest that fit: {by_t};\n      or {by_n};\n      or {other}."
        )


def totals(sizes: EchoSizes, shape: RankShape, budget: Budget) -> Sizing:
    """The plan's totals against the budget (no search)."""
    return Sizing(
        sizes=sizes,
        shape=shape,
        budget=budget,
        device=device_bytes(sizes, shape),
        host=host_bytes(sizes, shape, budget.ranks_per_node),
    )


def fits(sizes: EchoSizes, shape: RankShape, budget: Budget) -> bool:
    return sizes.valid() and totals(sizes, shape, budget).fits


def largest_host_tokens(sizes: EchoSizes, shape: RankShape, budget: Budget) -> int | None:
    """The largest T that fits at this N_G (every total grows with T: binary search)."""
    if not fits(replace(sizes, host_tokens=1), shape, budget):
        return None
    low, high = 1, max(1, sizes.host_tokens)
    if fits(replace(sizes, host_tokens=high), shape, budget):
        return high
    while high - low > 1:  # fits(low), not fits(high)
        mid = (low + high) // 2
        if fits(replace(sizes, host_tokens=mid), shape, budget):
            low = mid
        else:
            high = mid
    return low


def largest_dev_cache(sizes: EchoSizes, shape: RankShape, budget: Budget) -> int | None:
    """The largest N_G <= the plan's that fits at this T.

    The totals are not monotone in N_G (S x R, the host pool, can shrink when S grows),
    but S is constant between consecutive multiples of 64 and of top-k (where the default
    running count changes), and there only the metadata grows with N_G. So: walk those
    intervals from the top; in the first one whose bottom fits, binary-search the top."""
    lowest = sizes.top_k * (sizes.running or 1)
    top = sizes.dev_cache_size
    while top >= lowest:
        # S is constant on [bottom, top]: N // 64 (so ceil64(N + 1)) and, by default, the
        # running count N // top-k do not change there.
        bottom = max(lowest, top // PAGE * PAGE)
        if sizes.running is None:
            bottom = max(bottom, top // sizes.top_k * sizes.top_k)
        if fits(replace(sizes, dev_cache_size=bottom), shape, budget):
            low, high = bottom, top
            while low < high:
                mid = (low + high + 1) // 2
                if fits(replace(sizes, dev_cache_size=mid), shape, budget):
                    low = mid
                else:
                    high = mid - 1
            return low
        top = bottom - 1
    return None


def check(sizes: EchoSizes, shape: RankShape, budget: Budget) -> Sizing:
    """The plan's totals, with the largest fitting values when it does not fit."""
    result = totals(sizes, shape, budget)
    if result.fits:
        return result
    return replace(
        result,
        largest_host_tokens=largest_host_tokens(sizes, shape, budget),
        largest_dev_cache=largest_dev_cache(sizes, shape, budget),
    )
