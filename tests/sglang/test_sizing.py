"""Start-up sizing (issue 31, "start or say why"): every byte ECHO's plan puts on a GPU and
in pinned host memory, against what sglang will have, decided at argument resolution.

Each total is computed here independently of sizing.py, at DeepSeek-V3.2's real sizes
(61 layers, N_G 260K, T 2M host tokens, fp8 and bf16 rows): sglang's own pool classes
and ECHO's own DeviceCache / AllocWorkspace built on the meta device (their real tensors,
no memory), HiSparse's request tables from the shapes hisparse_coordinator.py allocates,
the weights from the checkpoint's tensors listed one by one, and from a small checkpoint
written here as safetensors shards with its model.safetensors.index.json (issue 50).
Closed forms of the same totals (checked against those classes) search every N_G and T
exhaustively for the largest values that fit; every fraction for the smallest that does.

The launcher tests resolve README's launch lines, and README-like lines that do not fit,
through sglang 0.5.23's real ServerArgs resolution (dry_parse.py, in a subprocess: this
file run as a script), stubbing only what this CPU machine lacks: the GPU's memory (an
H200's or H20's, as nvidia-smi reports it), the node's available memory and the device
capability. Each GPU refusal is launched again at the --mem-fraction-static and
--cuda-graph-max-bs-decode it names (sglang's own default-fraction rule decides the
latter) and one step past: the first starts, the second is refused. README's sizing block
must equal what the launcher logs for its lines. The budget there is an estimate (a stated
start-up overhead); test_sizing_measured.py checks the exact one, against sglang's own
memory profile.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import subprocess
import sys
from dataclasses import replace
from functools import cache
from pathlib import Path

import plugin_testenv  # first: sets the process up before sglang loads
import pytest
import torch

plugin_testenv.require_sglang()

import numpy as np  # noqa: E402

from sglang_echo.config import default_eviction_reserve  # noqa: E402
from sglang_echo.sglang import sizing, sizing_budget, sizing_weights  # noqa: E402

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
README = ROOT / "README.md"
LAYERS, TOP_K, PAGE, N_G, T = 61, 2048, 64, 260_000, 2_000_000
GiB = 2**30
FP8_ROW, BF16_ROW, KEY_ROW = 656, 1152, 132
# deepseek-ai/DeepSeek-V3.2's config.json (as published; the evidence generator reads it too).
DSV32_CONFIG = json.loads((ROOT / "benchmark/configs/deepseek-v3.2.json").read_text())
# The W4 checkpoint README names (the ECHO artifact's deployment, as the project's design
# notes describe it: 4-bit routed experts; MLA and indexer projections, shared experts and
# dense layers in bf16), as an AWQ config that --quantization moe_wna16 loads.
W4_CONFIG = {
    **DSV32_CONFIG,
    "quantization_config": {
        "quant_method": "awq",
        "bits": 4,
        "group_size": 128,
        "version": "gemm",
        "zero_point": True,
        "modules_to_not_convert": [
            "self_attn",
            "shared_experts",
            "model.layers.0.",
            "model.layers.1.",
            "model.layers.2.",
        ],
    },
}
MODELS = {"deepseek-ai/DeepSeek-V3.2": "dsv32", "/path/to/DeepSeek-V3.2-W4": "w4"}
CONFIGS = {"dsv32": DSV32_CONFIG, "w4": W4_CONFIG}
GPU_MIB = {"H200": 143_771, "H20": 97_871}  # nvidia-smi's memory.total
GPU_OF = {"dsv32": "H200", "w4": "H20"}  # the GPUs README names for each checkpoint
NODE_MEMORY = 2 * 2**40  # a node's available memory in the launcher tests (a DGX H200's)
HOST_RESERVE = 10 * GiB  # sglang's HICACHE_HOST_MEMORY_RESERVE_BYTES


# ------------------------------------------------------------- independent computation
def plan_rows(n_g: int, t: int, prefill: int = 0, running: int | None = None):
    """(S, R, running) as docs/PLUGIN.md states the plan."""
    run = n_g // TOP_K if running is None else running
    s = math.ceil((n_g + 1) / PAGE) * PAGE + PAGE * run + prefill
    return s, max(1, math.ceil((t + PAGE) / s)), run


@cache
def sglang_pools(s: int, r: int, fp8: bool) -> tuple[int, int, int]:
    """(device rows, index keys, host pool) bytes of sglang's own HiSparse DSA device pool
    (built on the meta device) and MLA host pool (sized, not allocated) for S rows and
    ratio R."""
    from sglang.srt.mem_cache.hisparse_memory_pool import HiSparseDSATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(attn_dcp_size=1, attn_dcp_rank=0)
    pool = HiSparseDSATokenToKVPool(
        size=s,
        page_size=PAGE,
        kv_lora_rank=512,
        dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16,
        qk_rope_head_dim=64,
        layer_num=LAYERS,
        device="meta",
        index_head_dim=128,
        enable_memory_saver=False,
        kv_cache_dim=FP8_ROW if fp8 else 576,
        host_to_device_ratio=r,
    )

    class SizedHost(MLATokenToKVPoolHost):
        def _allocate_host_buffer(self) -> None:
            self.kv_buffer = None

        def _initialize_transfer_views(self) -> None:
            return None

    host = SizedHost(
        buffer_info=pool.get_device_pool_infos()[0].buffer_info,
        host_to_device_ratio=r,
        host_size=0,
        page_size=PAGE,
        layout="layer_first",
        override_kv_cache_dim=pool.kv_cache_dim,
        device_capacity_tokens=pool.size,
        start_layer=0,
        end_layer=LAYERS,
        target_layer_num=LAYERS,
    )
    rows = sum(b.nbytes for b in pool.kv_buffer)
    keys = sum(b.nbytes for b in pool.index_k_with_scale_buffer)
    return rows, keys, host.size * host.size_per_token


@cache
def echo_tensors(n_g: int, host_slots: int) -> int:
    """Bytes of ECHO's device tensors besides the rows, as the plugin builds them: the
    DeviceCache of ExternalRowsCache (rows borrowed from sglang: zero bytes here), its
    AllocWorkspace, EchoManager's counters (2 x int64 per layer + 1), and the coordinator's
    reserved ids (int64: its N_G + 1 rows, page-rounded, and one logical page)."""
    from sglang_echo.kernels.alloc import AllocWorkspace
    from sglang_echo.offload.device_cache import DeviceCache

    cache_ = DeviceCache(
        LAYERS, n_g, host_slots - 2, 0, torch.uint8, "meta", default_eviction_reserve(n_g)
    )
    workspace = AllocWorkspace(cache_, max_lanes=n_g)

    def tensor_bytes(obj) -> int:
        return sum(v.nbytes for v in vars(obj).values() if isinstance(v, torch.Tensor))

    reserved = 8 * math.ceil((n_g + 1) / PAGE) * PAGE + 8 * PAGE
    return tensor_bytes(cache_) + tensor_bytes(workspace) + 8 * (2 * LAYERS + 1) + reserved


def request_tables(slots: int, context: int) -> int:
    """HiSparseCoordinator.__init__'s device tables for ``slots`` request slots, those ECHO
    keeps and those it frees (buffer B = 2048 + one page)."""
    b = 2048
    shapes = [
        ((slots, context + 4 + PAGE), 8),  # req_to_host_pool int64
        ((slots, TOP_K), 4),  # top_k_device_locs_buffer int32
        ((slots, PAGE), 8),  # ECHO's ring_rows int64
        ((slots,), 8),  # ECHO's ring_start int64
        ((slots, b + PAGE), 8),  # req_to_device_buffer int64 (freed)
        ((LAYERS, slots, b + PAGE), 4),  # req_device_buffer_tokens int32 (freed)
        ((LAYERS, slots, b + PAGE), 4),  # req_device_buffer_token_locs int32 (freed)
        ((LAYERS, slots, b), 2),  # lru_slots int16 (freed)
        ((b,), 2),  # _lru_init int16 (freed)
        ((slots, TOP_K), 4),  # raw_indices_buffer int32 (freed)
    ]
    return sum(math.prod(shape) * size for shape, size in shapes)


def device_totals(
    n_g: int, t: int, fp8: bool, context: int, prefill: int = 0, extra: int = 0
) -> dict[str, int]:
    s, r, run = plan_rows(n_g, t, prefill)
    rows, keys, host = sglang_pools(s, r, fp8)
    return {
        "rows": rows,
        "keys": keys,
        "metadata": echo_tensors(n_g, s * r + PAGE),
        "tables": request_tables(run + extra + 1, context),
        "host": host,
    }


def checkpoint_tensors(config: dict):
    """(part, bytes) of every weight tensor of the main model (no MTP layer) as the
    checkpoint stores it, plus the absorbed bf16 copies of kv_b (w_kc, w_vc) sglang makes.
    Linear weights are [out, in]: fp8 ones with fp32 block scales ``weight_scale_inv``
    [ceil(out / 128), ceil(in / 128)]; AWQ ones as qweight int32 [in, out / 8], qzeros
    int32 [in / 128, out / 8], scales fp16 [in / 128, out]."""
    quant = config["quantization_config"]
    awq = quant["quant_method"] == "awq"

    def linear(name: str, out: int, inp: int):
        if awq and any(m in name for m in quant["modules_to_not_convert"]):
            return 2 * out * inp
        if awq:
            return 4 * inp * out // 8 + 4 * (inp // 128) * out // 8 + 2 * (inp // 128) * out
        return out * inp + 4 * math.ceil(out / 128) * math.ceil(inp / 128)

    h, heads = 7168, 128
    for i in range(61):
        a = f"model.layers.{i}.self_attn"
        yield "attn_split", linear(f"{a}.q_b_proj", heads * 192, 1536)
        yield "attn_split", linear(f"{a}.kv_b_proj", heads * 256, 512)
        yield "attn_split", linear(f"{a}.o_proj", h, heads * 128)
        yield "attn_split", 2 * (heads * 128 * 512) * 2  # w_kc [128, 128, 512], w_vc bf16
        yield "attn_replicated", linear(f"{a}.q_a_proj", 1536, h)
        yield "attn_replicated", 2 * 1536  # q_a_layernorm
        yield "attn_replicated", linear(f"{a}.kv_a_proj_with_mqa", 576, h)
        yield "attn_replicated", 2 * 512  # kv_a_layernorm
        yield "attn_replicated", linear(f"{a}.indexer.wq_b", 64 * 128, 1536)
        yield "attn_replicated", linear(f"{a}.indexer.wk", 128, h)
        yield "attn_replicated", 2 * 64 * h  # indexer.weights_proj (bf16)
        yield "attn_replicated", 2 * 128 * 2  # indexer.k_norm weight and bias
        yield "attn_replicated", 2 * h * 2  # input_layernorm, post_attention_layernorm
        m = f"model.layers.{i}.mlp"
        if i < 3:
            for proj, out, inp in (("gate", 18432, h), ("up", 18432, h), ("down", h, 18432)):
                yield "dense", linear(f"{m}.{proj}_proj", out, inp)
            continue
        for e in [*range(256), "shared"]:
            part, name = (
                ("shared", f"{m}.shared_experts")
                if e == "shared"
                else ("routed", f"{m}.experts.{e}")
            )
            for proj, out, inp in (("gate", 2048, h), ("up", 2048, h), ("down", h, 2048)):
                yield part, linear(f"{name}.{proj}_proj", out, inp)
        yield "routers", 2 * 256 * h + 4 * 256  # mlp.gate.weight, e_score_correction_bias
    yield "embed", 2 * 129280 * h
    yield "lm_head", 2 * 129280 * h
    yield "norm", 2 * h


def weights_per_gpu(config: dict, tp: int, attn_dp: int) -> int:
    parts: dict[str, int] = {}
    for part, nbytes in checkpoint_tensors(config):
        parts[part] = parts.get(part, 0) + nbytes
    attn_tp = tp // attn_dp
    ways = {
        "attn_split": attn_tp,
        "embed": attn_tp if attn_dp > 1 else tp,
        "lm_head": tp,
        "dense": tp,
        "shared": tp,
        "routed": tp,
    }
    return sum(-(-nbytes // ways.get(part, 1)) for part, nbytes in parts.items())


def closed_form(n_g, t, row: int, context: int, prefill: int = 0, extra: int = 0):
    """Every total as numpy arrays over ``n_g`` or ``t`` (int64): the same bytes as
    device_totals (test_closed_form_is_the_real_allocation checks it), for exhaustive
    searches."""
    n_g = np.asarray(n_g, dtype=np.int64)
    t = np.asarray(t, dtype=np.int64)
    run = n_g // TOP_K
    s = (n_g + PAGE) // PAGE * PAGE + PAGE * run + prefill  # ceil64(N_G + 1)
    r = np.maximum(1, (t + PAGE + s - 1) // s)
    slots = s * r + PAGE
    reserve = np.minimum(np.minimum(8192, (n_g + 31) // 32), n_g // 2)
    metadata = LAYERS * (4 * slots + 12 * (n_g + 2) + 4 * (n_g + 1) + 12 + 40 + 16) + (
        4 * 256
        + 4 * np.maximum(1, (n_g + 1023) // 1024)
        + 8 * ((n_g + 2 + 2047) // 2048)
        + 16 * (n_g + 1)
        + 12
        + 4 * np.maximum(1, reserve)
        + 2 * (n_g + 2)
        + 8  # the look-back resolve's tickets
        + 8 * np.maximum(1, (n_g + 511) // 512)  # its lane tiles' words (512 lanes each)
        + 8 * ((n_g + 2 + 2047) // 2048)  # its slot tiles' words
        + 16  # call_counts
        + 4 * np.maximum(1, n_g)  # lane_ref
        + 8
        + 8 * ((n_g + PAGE) // PAGE * PAGE + PAGE)
    )
    device = (
        (s + PAGE) * row * LAYERS
        + (s * r + PAGE + 1) // PAGE * PAGE * KEY_ROW * LAYERS
        + metadata
        + np.vectorize(lambda k: request_tables(int(k) + extra + 1, context))(run)
    )
    return device, slots * row * LAYERS


def largest_fitting(row, context, budget, host_limit, prefill=0, extra=0, n_g=N_G, t=T):
    """The largest T (at N_G) and N_G (at T) whose totals fit, by trying every value."""
    ts = np.arange(1, t + 1)
    dev, host = closed_form(n_g, ts, row, context, prefill, extra)
    ok = (dev <= budget) & (host * 8 <= host_limit)
    best_t = int(ts[ok].max()) if ok.any() else None
    ns = np.arange(TOP_K, n_g + 1)
    dev, host = closed_form(ns, t, row, context, prefill, extra)
    ok = (dev <= budget) & (host * 8 <= host_limit)
    best_n = int(ns[ok].max()) if ok.any() else None
    return best_t, best_n


# ------------------------------------------------------------------------ the arithmetic
@pytest.mark.parametrize("n_g, t", [(2048, 1000), (N_G, T), (N_G, 4_321_987)])
def test_metadata_is_echos_tensors(n_g, t):
    s, r, _ = plan_rows(n_g, t)
    assert sizing.echo_metadata_bytes(n_g, s * r + PAGE, LAYERS) == echo_tensors(n_g, s * r + PAGE)


@pytest.mark.parametrize("row", [FP8_ROW, BF16_ROW], ids=["fp8", "bf16"])
def test_decode_prefetch_is_the_plugins_prefetcher(row):
    """With SGLANG_NSA_FUSE_LOGITS_RECALL_DECODE=1 the coordinator builds the plugin's
    DecodePrefetcher after sglang profiled memory: the sizing counts its tensors."""
    from sglang_echo.offload.decode_prefetcher import DecodePrefetcher
    from sglang_echo.offload.device_cache import DeviceCache
    from sglang_echo.offload.host_pool import HostKVPool
    from sglang_echo.offload.manager import EchoManager
    from sglang_echo.sglang.decode_prefetch import PLUGIN_STAGE_CHUNKS

    assert sizing.PLUGIN_STAGE_CHUNKS == PLUGIN_STAGE_CHUNKS
    layers, host_tokens, slots = 3, 100, 5
    host = HostKVPool(layers, host_tokens, row, torch.uint8, pin=False)
    cache_ = DeviceCache(layers, 64, host_tokens, row, torch.uint8, "cpu")
    manager = EchoManager(host, cache_, use_kernels=False)
    p = DecodePrefetcher(manager, slots, chunks=PLUGIN_STAGE_CHUNKS)
    assert sizing.decode_prefetch_bytes(slots, host_tokens + 2, row, layers) == p.nbytes
    sizes = sizing.EchoSizes(N_G, T, TOP_K, 0)
    off = sizing.RankShape(LAYERS, row, KEY_ROW, 163840)
    on = sizing.RankShape(LAYERS, row, KEY_ROW, 163840, decode_prefetch=True)
    extra = sizing.device_bytes(sizes, on).total - sizing.device_bytes(sizes, off).total
    assert extra == sizing.decode_prefetch_bytes(
        sizing.request_slots(sizes, on), sizes.host_slots, row, LAYERS
    )
    assert any(
        "decode prefetch" in line for line in sizing.device_bytes(sizes, on).lines(sizes, on)
    )


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
@pytest.mark.parametrize("node", ["pd_decode", "server"])
def test_totals_at_real_sizes(fp8, node):
    """N_G 260K, T 2M, 61 layers: every total equals the real allocation's bytes."""
    prefill, context, extra = (0, 163840, 0) if node == "pd_decode" else (131072, 131072, 0)
    sizes = sizing.EchoSizes(N_G, T, TOP_K, prefill)
    shape = sizing.RankShape(LAYERS, FP8_ROW if fp8 else BF16_ROW, KEY_ROW, context, extra)
    got = sizing.device_bytes(sizes, shape)
    want = device_totals(N_G, T, fp8, context, prefill, extra)
    assert (got.echo_rows, got.index_keys) == (want["rows"], want["keys"])
    assert (got.echo_metadata, got.request_tables) == (want["metadata"], want["tables"])
    assert sizing.host_bytes(sizes, shape, 8).per_node == 8 * want["host"]
    dev, host = closed_form(N_G, T, shape.row_bytes, context, prefill, extra)
    assert int(dev) == got.total and int(host) == want["host"]
    # The row sizes come from the model's config (sglang's fp8 DSA layout, bf16 MLA).
    assert sizing.kv_row_bytes(DSV32_CONFIG, fp8) == shape.row_bytes
    assert sizing.index_row_bytes(DSV32_CONFIG) == KEY_ROW


@pytest.mark.parametrize(
    "model, tp, attn_dp",
    [("dsv32", 8, 8), ("dsv32", 8, 1), ("w4", 8, 8)],
    ids=["fp8-dp-attention", "fp8-tp8", "w4-dp-attention"],
)
def test_weights_are_the_checkpoint_tensors(model, tp, attn_dp):
    config = CONFIGS[model]
    got = sizing_weights.weight_bytes(
        config, sizing_weights.Parallel(tp_size=tp, attn_dp_size=attn_dp)
    )
    assert got.total == weights_per_gpu(config, tp, attn_dp)


# A DeepSeek-V3.2-shaped checkpoint small enough to write (test_plugin_args' config:
# 4 layers, the first dense, 8 routed experts), with its MTP layer, as safetensors shards.
def small_checkpoint_tensors(config: dict):
    """(part, name, shape, dtype) of every tensor of the checkpoint, the MTP layer's with
    part None, named as DeepSeek-V3.2's checkpoints name them."""
    h, heads, layers = config["hidden_size"], config["num_attention_heads"], 4
    q_lora, kv_lora = config["q_lora_rank"], config["kv_lora_rank"]
    nope, rope, v = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    idx_heads, idx_dim = config["index_n_heads"], config["index_head_dim"]
    experts, moe, vocab = config["n_routed_experts"], config["moe_intermediate_size"], config["vocab_size"]  # fmt: skip
    bf16, fp32 = torch.bfloat16, torch.float32
    yield "embed", "model.embed_tokens.weight", (vocab, h), bf16
    yield "lm_head", "lm_head.weight", (vocab, h), bf16
    yield "norm", "model.norm.weight", (h,), bf16
    for i in range(layers + 1):  # layer 4: the MTP layer
        mtp = i == layers

        def part(name: str, mtp: bool = mtp) -> str | None:
            return None if mtp else name

        a = f"model.layers.{i}.self_attn"
        for name, shape, which in (
            ("q_a_proj.weight", (q_lora, h), "attn_replicated"),
            ("q_a_layernorm.weight", (q_lora,), "attn_replicated"),
            ("q_b_proj.weight", (heads * (nope + rope), q_lora), "attn_split"),
            ("kv_a_proj_with_mqa.weight", (kv_lora + rope, h), "attn_replicated"),
            ("kv_a_layernorm.weight", (kv_lora,), "attn_replicated"),
            ("kv_b_proj.weight", (heads * (nope + v), kv_lora), "attn_split"),
            ("o_proj.weight", (h, heads * v), "attn_split"),
            ("indexer.wq_b.weight", (idx_heads * idx_dim, q_lora), "attn_replicated"),
            ("indexer.wk.weight", (idx_dim, h), "attn_replicated"),
            ("indexer.weights_proj.weight", (idx_heads, h), "attn_replicated"),
            ("indexer.k_norm.weight", (idx_dim,), "attn_replicated"),
            ("indexer.k_norm.bias", (idx_dim,), "attn_replicated"),
        ):
            yield part(which), f"{a}.{name}", shape, bf16
        for norm in ("input_layernorm", "post_attention_layernorm"):
            yield part("attn_replicated"), f"model.layers.{i}.{norm}.weight", (h,), bf16
        m = f"model.layers.{i}.mlp"
        if i == 0:
            inter = config["intermediate_size"]
            for proj, shape in (("gate", (inter, h)), ("up", (inter, h)), ("down", (h, inter))):
                yield "dense", f"{m}.{proj}_proj.weight", shape, bf16
            continue
        for e in range(experts):
            for proj, shape in (("gate", (moe, h)), ("up", (moe, h)), ("down", (h, moe))):
                yield part("routed"), f"{m}.experts.{e}.{proj}_proj.weight", shape, bf16
        shared = moe * config["n_shared_experts"]
        for proj, shape in (("gate", (shared, h)), ("up", (shared, h)), ("down", (h, shared))):
            yield part("shared"), f"{m}.shared_experts.{proj}_proj.weight", shape, bf16
        yield part("routers"), f"{m}.gate.weight", (experts, h), bf16
        yield part("routers"), f"{m}.gate.e_score_correction_bias", (experts,), fp32
    for name, shape in (("embed_tokens.weight", (vocab, h)), ("enorm.weight", (h,)),
                        ("hnorm.weight", (h,)), ("eh_proj.weight", (h, 2 * h)),
                        ("shared_head.norm.weight", (h,)), ("shared_head.head.weight", (vocab, h))):  # fmt: skip
        yield None, f"model.layers.{layers}.{name}", shape, bf16


def write_small_checkpoint(folder: Path, config: dict) -> dict:
    """The checkpoint in three shards and its model.safetensors.index.json; returns the
    index written."""
    from safetensors.torch import save_file

    tensors = {
        name: torch.zeros(shape, dtype=dtype)
        for _, name, shape, dtype in small_checkpoint_tensors(config)
    }
    names = sorted(tensors)
    weight_map = {}
    for k in range(3):
        shard = f"model-0000{k + 1}-of-00003.safetensors"
        part = {n: tensors[n] for n in names[k::3]}
        save_file(part, str(folder / shard))
        weight_map.update(dict.fromkeys(part, shard))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / sizing_weights.INDEX_FILE).write_text(json.dumps(index))
    (folder / "config.json").write_text(json.dumps(config))
    return index


@pytest.mark.parametrize(
    "tp, attn_dp, dense_tp",
    [(8, 8, None), (8, 1, None), (4, 2, 1)],
    ids=["dp-attention", "tp8", "tp4-dp2-dense-replicated"],
)
def test_weights_from_the_checkpoint_index(tmp_path, tp, attn_dp, dense_tp):
    """The weights read through model.safetensors.index.json and its shards' headers: each
    part's tensors divided as sglang loads them, the MTP layer left out, sglang's absorbed
    kv_b copies added; the same bytes as config.json's estimate for a checkpoint holding
    exactly the config's tensors."""
    from test_plugin_args import MODEL_CONFIG

    config = {**MODEL_CONFIG, "num_nextn_predict_layers": 1}
    index = write_small_checkpoint(tmp_path, config)
    parallel = sizing_weights.Parallel(tp_size=tp, attn_dp_size=attn_dp, moe_dense_tp_size=dense_tp)
    got = sizing_weights.checkpoint_weight_bytes(tmp_path, config, parallel)
    assert got is not None and got.source == "the checkpoint's model.safetensors.index.json"

    parts: dict[str, int] = {}
    mtp = 0
    for part, _, shape, dtype in small_checkpoint_tensors(config):
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if part is None:
            mtp += nbytes
        else:
            parts[part] = parts.get(part, 0) + nbytes
    assert mtp > 0 and sum(parts.values()) + mtp == index["metadata"]["total_size"]
    heads, kv_lora = config["num_attention_heads"], config["kv_lora_rank"]
    nope, v = config["qk_nope_head_dim"], config["v_head_dim"]
    # sglang's bf16 w_kc [heads, nope, kv_lora] and w_vc [heads, kv_lora, v], each layer
    parts["attn_split"] += config["num_hidden_layers"] * 2 * heads * kv_lora * (nope + v)
    attn_tp = tp // attn_dp
    ways = {
        "attn_split": attn_tp,
        "embed": attn_tp if attn_dp > 1 else tp,
        "lm_head": tp,
        "dense": 1 if dense_tp == 1 else tp,
        "shared": tp,
        "routed": tp,
    }
    want = sum(-(-nbytes // ways.get(part, 1)) for part, nbytes in parts.items())
    assert got.total == want
    assert got.routed_experts == -(-parts["routed"] // tp)
    assert got.total == sizing_weights.weight_bytes(config, parallel).total  # the two paths agree


def test_index_weights_fall_back_to_config(tmp_path, caplog):
    """Without an index, with a shard missing, with an index that does not add up, or
    with online quantization (stored bytes are not loaded bytes): config.json's estimate,
    through the launcher's own choice (args_sizing.weights_of)."""
    from test_plugin_args import MODEL_CONFIG

    from sglang_echo.sglang.args_sizing import weights_of

    config = {**MODEL_CONFIG, "num_nextn_predict_layers": 1}
    parallel = sizing_weights.Parallel(8, 8)
    estimate = sizing_weights.weight_bytes(config, parallel)
    assert weights_of(str(tmp_path), config, parallel, None) == estimate  # no index
    assert weights_of("org/hub-name", config, parallel, None) == estimate  # not a folder
    index = write_small_checkpoint(tmp_path, config)
    from_index = weights_of(str(tmp_path), config, parallel, None)
    assert from_index.source != estimate.source and from_index.total == estimate.total
    online = weights_of(str(tmp_path), config, parallel, "fp8")
    assert online == sizing_weights.weight_bytes(config, parallel, "fp8") and online != from_index
    index["metadata"]["total_size"] += 1
    (tmp_path / sizing_weights.INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(sizing_weights.UnknownWeights, match="total_size"):
        sizing_weights.checkpoint_weight_bytes(tmp_path, config, parallel)
    assert weights_of(str(tmp_path), config, parallel, None) == estimate
    assert "estimating the weights from config.json" in caplog.text
    index["metadata"]["total_size"] -= 1
    (tmp_path / sizing_weights.INDEX_FILE).write_text(json.dumps(index))
    (tmp_path / "model-00002-of-00003.safetensors").unlink()
    assert sizing_weights.checkpoint_weight_bytes(tmp_path, config, parallel) is None
    assert weights_of(str(tmp_path), config, parallel, None) == estimate


def test_index_of_other_names_is_not_split(tmp_path):
    """A checkpoint whose tensors are not named as DeepSeek-V3.2's (here its own tensors
    under another prefix) is not split by guessed parts: config.json's estimate instead;
    a small tensor of no known part is counted whole on every GPU."""
    from safetensors.torch import save_file
    from test_plugin_args import MODEL_CONFIG

    config = {**MODEL_CONFIG, "num_nextn_predict_layers": 1}
    parallel = sizing_weights.Parallel(8, 8)
    index = write_small_checkpoint(tmp_path, config)
    known = sizing_weights.checkpoint_weight_bytes(tmp_path, config, parallel)
    extra = torch.zeros(16, dtype=torch.float32)  # 64 B, e.g. a rotary buffer
    save_file({"rotary.inv_freq": extra}, str(tmp_path / "extra.safetensors"))
    index["weight_map"]["rotary.inv_freq"] = "extra.safetensors"
    index["metadata"]["total_size"] += 64
    (tmp_path / sizing_weights.INDEX_FILE).write_text(json.dumps(index))
    with_extra = sizing_weights.checkpoint_weight_bytes(tmp_path, config, parallel)
    assert with_extra.other == 64 and with_extra.total == known.total + 64
    renamed = {
        f"transformer.{name}": torch.zeros(shape, dtype=dtype)
        for _, name, shape, dtype in small_checkpoint_tensors(config)
    }
    other = tmp_path / "other"
    other.mkdir()
    save_file(renamed, str(other / "model.safetensors"))
    total = sum(t.numel() * t.element_size() for t in renamed.values())
    (other / sizing_weights.INDEX_FILE).write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict.fromkeys(renamed, "model.safetensors")}
    ))  # fmt: skip
    assert sizing_weights.checkpoint_weight_bytes(other, config, parallel) is None


def test_weights_count_the_published_parameters():
    """Unquantized, on one GPU, less the absorbed copies: DeepSeek-V3's 671B parameters
    (main model, MTP excluded) plus V3.2's indexers (61 x 14M), at 2 bytes each."""
    bf16 = {k: v for k, v in DSV32_CONFIG.items() if k != "quantization_config"}
    params = (
        sizing_weights.weight_bytes(bf16, sizing_weights.Parallel()).total
        - 61 * 4 * 128 * 128 * 512
    ) / 2
    assert 671.5e9 < params < 672.0e9


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
def test_refusal_names_the_largest_values_that_fit(fp8):
    """A budget too small for N_G 260K and T 2M: the sizing refuses, and its largest T and
    N_G are those that an exhaustive search over every value finds."""
    row = FP8_ROW if fp8 else BF16_ROW
    sizes = sizing.EchoSizes(N_G, T, TOP_K, 0)
    shape = sizing.RankShape(LAYERS, row, KEY_ROW, 163840)
    weights = sizing_weights.weight_bytes(DSV32_CONFIG, sizing_weights.Parallel(8, 8))
    budget = sizing_budget.Budget(150 * GiB, 0.78, weights, 8, host_available=NODE_MEMORY)
    result = sizing.check(sizes, shape, budget)
    want = device_totals(N_G, T, fp8, 163840)
    device = sum(v for k, v in want.items() if k != "host")
    assert not result.fits
    assert result.device.total == device
    # sglang's rule over what its profile will see: the GPU less the start-up overhead
    kv = int((150 * GiB - sizing_budget.STARTUP_OVERHEAD) * 0.78) - weights.total
    assert result.device.total > budget.kv_bytes == kv
    assert (result.largest_host_tokens, result.largest_dev_cache) == largest_fitting(
        row, 163840, budget.kv_bytes, NODE_MEMORY - HOST_RESERVE
    )
    message = result.message()
    assert f"--max-total-tokens {result.largest_host_tokens} " in message
    assert f"NSA_DEV_CACHE_SIZE={result.largest_dev_cache} " in message
    for key in ("rows", "keys", "metadata", "tables"):
        assert sizing_weights.gib(want[key]) in message, key
    # the smallest fraction (0.001 steps) whose budget holds the totals, and no smaller
    best = smallest_fitting_fraction(device, 150 * GiB, weights.total)
    assert result.smallest_fraction == best
    assert f"--mem-fraction-static {best} (the smallest that fits" in message
    assert "--cuda-graph-max-bs-decode" not in message  # no graphs given: not named
    assert sizing_weights.gib(sizing_budget.STARTUP_OVERHEAD) in message


def smallest_fitting_fraction(device: int, gpu: int, weights: int) -> float | None:
    """The smallest fraction k / 1000 below 1 whose estimated budget holds ``device``,
    by trying every k."""
    for k in range(1, 1000):
        if int((gpu - sizing_budget.STARTUP_OVERHEAD) * (k / 1000)) - weights >= device:
            return k / 1000
    return None


def test_graph_advice_is_the_largest_batch_whose_default_fraction_fits():
    """With sglang's default fraction as a function of the decode graphs' max batch (here
    a made-up decreasing rule), the refusal names the largest batch below the launch's
    whose fraction holds the totals: trying every batch finds the same."""
    sizes = sizing.EchoSizes(N_G, T, TOP_K, 0)
    shape = sizing.RankShape(LAYERS, FP8_ROW, KEY_ROW, 163840)
    weights = sizing_weights.weight_bytes(DSV32_CONFIG, sizing_weights.Parallel(8, 8))

    def fraction_at(bs: int) -> float:
        return round(0.95 - bs * 0.0003, 3)

    budget = sizing_budget.Budget(140 * GiB, fraction_at(512), weights, 8)
    result = sizing.check(sizes, shape, budget, sizing_budget.Graphs(512, fraction_at))
    device = result.device.total
    fits_at = [
        bs
        for bs in range(1, 512)
        if int((140 * GiB - sizing_budget.STARTUP_OVERHEAD) * fraction_at(bs)) - weights.total
        >= device
    ]
    assert not result.fits and fits_at and max(fits_at) < 511
    assert result.largest_graph_bs == max(fits_at)
    bs = result.largest_graph_bs
    assert (
        f"--cuda-graph-max-bs-decode {bs} (sglang's default --mem-fraction-static is then "
        f"{fraction_at(bs)}, {fraction_at(512)} at 512)"
    ) in result.message()
    tight = sizing.check(sizes, shape, replace(budget, gpu_memory=100 * GiB),
                         sizing_budget.Graphs(512, fraction_at))  # fmt: skip
    assert tight.largest_graph_bs is None
    assert "no --cuda-graph-max-bs-decode fits" in tight.message()


def test_host_refusal_counts_every_rank_of_a_node():
    sizes = sizing.EchoSizes(N_G, T, TOP_K, 0)
    shape = sizing.RankShape(LAYERS, FP8_ROW, KEY_ROW, 163840)
    weights = sizing_weights.weight_bytes(DSV32_CONFIG, sizing_weights.Parallel(8, 8))
    budget = sizing_budget.Budget(400 * GiB, 0.9, weights, 8, host_available=300 * GiB)
    result = sizing.check(sizes, shape, budget)
    host = device_totals(N_G, T, True, 163840)["host"]
    assert result.fits_device and not result.fits_host
    assert result.host.per_node == 8 * host
    assert (
        f"the host ({sizing_weights.gib(8 * host)} > {sizing_weights.gib(290 * GiB)})"
        in result.message()
    )
    best_t, _ = largest_fitting(FP8_ROW, 163840, budget.kv_bytes, 290 * GiB)
    assert result.largest_host_tokens == best_t
    assert "no NSA_DEV_CACHE_SIZE fits" in result.message()  # the host pool follows T


# --------------------------------------------------------------------------- the launcher
def readme_launch_lines() -> list[tuple[dict, list[str]]]:
    """(env, sglang argv) of each launch line in README's plugin section, in order."""
    text = README.read_text()
    section = text.split("## SGLang plugin: launch lines", 1)[1].split("\n## ", 1)[0]
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", section, re.S):
        words = shlex.split(block.replace("\\\n", " "))
        env = {}
        while re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
            key, value = words.pop(0).split("=", 1)
            env[key] = value
        assert words[:3] == ["python", "-m", "sglang.launch_server"], words
        lines.append((env, words[3:]))
    return lines


def readme_sizing_block() -> list[list[str]]:
    """README's sizing block: per launch line, its indented lines."""
    text = README.read_text()
    block = text.split("<!-- sizing:begin", 1)[1].split("<!-- sizing:end -->", 1)[0]
    body = block.split("```text\n", 1)[1].split("```", 1)[0]
    sections: list[list[str]] = []
    for line in body.splitlines():
        if line.startswith("    "):
            sections[-1].append(line)
        else:
            sections.append([])
    return sections


def case(model: str, argv: list[str], env: dict, node_memory: int = NODE_MEMORY) -> dict:
    """One launch as the driver resolves it: the model's config folder, the GPU README names."""
    return {"model": model, "argv": argv, "env": env, "node_memory": node_memory}


def with_flag(argv: list[str], flag: str, value: str) -> list[str]:
    out = list(argv)
    if flag in out:
        out[out.index(flag) + 1] = value
    else:
        out += [flag, value]
    return out


def readme_cases() -> dict[str, dict]:
    cases = {}
    for i, (env, argv) in enumerate(readme_launch_lines()):
        model = MODELS[argv[argv.index("--model-path") + 1]]
        cases[f"readme_{i}"] = case(model, argv, env)
    return cases


def without_flag(argv: list[str], flag: str) -> list[str]:
    i = argv.index(flag)
    return argv[:i] + argv[i + 2 :]


def refusal_cases(readme: dict[str, dict]) -> dict[str, dict]:
    """README-like lines: the PD lines with sglang's default decode graphs (fp8 and bf16
    rows on the H200, the W4 checkpoint on the H20), the W4 line at the artifact's T 1.8M,
    the PD line on a node with too little memory, the non-PD line with bf16 rows at its fp8
    sizes and sglang's default decode graphs; and two that fit with bf16 rows (the PD line, and the non-PD line at N_G 130K and
    T 1M, launch_lines' bf16 server sizes)."""
    pd, w4, server = (readme[k] for k in ("readme_0", "readme_1", "readme_2"))
    graphs = "--cuda-graph-max-bs-decode"
    pd_default = without_flag(pd["argv"], graphs)
    return {
        "pd_fp8_default_graphs": {**pd, "argv": pd_default},
        "pd_bf16_default_graphs": {
            **pd,
            "argv": with_flag(pd_default, "--kv-cache-dtype", "bfloat16"),
        },
        "w4_default_graphs": {**w4, "argv": without_flag(w4["argv"], graphs)},
        "w4_1800K": {**w4, "argv": with_flag(w4["argv"], "--max-total-tokens", "1800000")},
        "pd_small_node": {**pd, "node_memory": 256 * GiB},
        "pd_bf16": {**pd, "argv": with_flag(pd["argv"], "--kv-cache-dtype", "bfloat16")},
        "server_bf16_big": {  # with sglang's default decode graphs: the advice names a batch
            **server,
            "argv": with_flag(without_flag(server["argv"], graphs), "--kv-cache-dtype", "bfloat16"),
        },
        # launch_lines' bf16 server sizes: N_G 130K, T 1M.
        "server_bf16": {
            **server,
            "env": {**server["env"], "NSA_DEV_CACHE_SIZE": "130_000"},
            "argv": with_flag(
                with_flag(server["argv"], "--kv-cache-dtype", "bfloat16"),
                "--max-total-tokens",
                "1000000",
            ),
        },
    }


REFUSED = {
    "pd_fp8_default_graphs": "the GPU",
    "pd_bf16_default_graphs": "the GPU",
    "w4_default_graphs": "the GPU",
    "w4_1800K": "the GPU",
    "server_bf16_big": "the GPU",
    "pd_small_node": "the host",
}
ACCEPTED = ["pd_bf16", "server_bf16"]


def run_launches(tmp: Path, cases: dict[str, dict], file: str = "cases.json") -> dict[str, dict]:
    """Resolve ``cases`` through the launcher (the driver below, in one fresh process with
    the plugin loaded); each result merged with its case."""
    for name, config in CONFIGS.items():
        (tmp / name).mkdir(exist_ok=True)
        (tmp / name / "config.json").write_text(json.dumps(config))
    runs = []
    for name, c in cases.items():
        argv = with_flag(c["argv"], "--model-path", str(tmp / c["model"]))
        argv += ["--device", "cuda", "--skip-tokenizer-init"]
        gpu = GPU_OF[c["model"]]
        runs.append(
            {"name": name, "argv": argv, "env": c["env"], "gpu_mib": GPU_MIB[gpu],
             "node_memory": c["node_memory"]}
        )  # fmt: skip
    path = tmp / file
    path.write_text(json.dumps(runs))
    env = {**os.environ, "NSA_KV_OFFLOAD": "1", "HF_HUB_OFFLINE": "1"}
    for key in ("SGLANG_PLUGINS", "NSA_DEV_CACHE_SIZE", "SGLANG_ECHO_EVICTION_RESERVE"):
        env.pop(key, None)
    proc = subprocess.run(
        [sys.executable, __file__, str(path)], env=env, capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("HOOKS "):
            out["_hooks"] = json.loads(line[6:])
        if line.startswith("CASE "):
            result = json.loads(line[5:])
            out[result["name"]] = {**result, **cases[result["name"]]}
    assert set(out) == {*cases, "_hooks"}
    return out


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> dict[str, dict]:
    cases = readme_cases()
    cases.update(refusal_cases(cases))
    return run_launches(tmp_path_factory.mktemp("sizing"), cases)


def named(error: str, pattern: str) -> str | None:
    found = re.search(pattern, error)
    return None if found is None else found[1]


FRACTION_NAMED = r"--mem-fraction-static ([\d.]+) \(the smallest that fits"
GRAPHS_NAMED = r"--cuda-graph-max-bs-decode (\d+) \(sglang's default"


@pytest.fixture(scope="module")
def boundaries(launches, tmp_path_factory) -> dict[str, dict]:
    """Each GPU refusal relaunched at the --mem-fraction-static and
    --cuda-graph-max-bs-decode it names, and one step past each (0.001 lower, one batch
    more): the first must start, the second be refused."""
    cases = {}
    for name, where in REFUSED.items():
        result = launches[name]
        if where != "the GPU":
            continue
        launch = case(result["model"], result["argv"], result["env"], result["node_memory"])
        fraction = named(result["error"], FRACTION_NAMED)
        if fraction is not None:
            below = f"{float(fraction) - 0.001:.3f}"
            for key, value in (("fraction", fraction), ("fraction_below", below)):
                argv = with_flag(result["argv"], "--mem-fraction-static", value)
                cases[f"{name}:{key}"] = {**launch, "argv": argv}
        graphs = named(result["error"], GRAPHS_NAMED)
        if graphs is not None:
            for key, value in (("graphs", int(graphs)), ("graphs_above", int(graphs) + 1)):
                argv = with_flag(result["argv"], "--cuda-graph-max-bs-decode", str(value))
                cases[f"{name}:{key}"] = {**launch, "argv": argv}
    return run_launches(tmp_path_factory.mktemp("boundaries"), cases)


def flag(argv: list[str], name: str, default=None):
    return argv[argv.index(name) + 1] if name in argv else default


def independent(result: dict) -> tuple[dict[str, int], int, int, dict]:
    """The launch's totals, KV budget and node host limit, computed here from its command
    line and sglang's --mem-fraction-static (resolved, or as the refusal states it)."""
    argv = result["argv"]
    fp8 = flag(argv, "--kv-cache-dtype", "auto") == "fp8_e4m3"  # auto: bf16 here
    pd = flag(argv, "--disaggregation-mode") == "decode"
    context = int(flag(argv, "--context-length", 163840))
    prefill = 0 if pd else math.ceil(context / PAGE) * PAGE
    n_g = int(result["env"]["NSA_DEV_CACHE_SIZE"].replace("_", ""))
    t = int(flag(argv, "--max-total-tokens"))
    tp = int(flag(argv, "--tp-size", flag(argv, "--tp", 1)))
    attn_dp = int(flag(argv, "--dp-size", 1)) if "--enable-dp-attention" in argv else 1
    # sglang's PD pre-allocation slots: twice the per-rank batch at 32 or fewer, else none
    extra = 2 * (n_g // TOP_K) if pd and n_g // TOP_K <= 32 else 0
    if result["error"] is None:
        fields = result["fields"]
        config = json.loads(fields["hisparse_config"])
        assert (config["echo_dev_cache"], config["echo_host_tokens"]) == (n_g, t)
        assert fields["kv_cache_dtype"] == ("fp8_e4m3" if fp8 else "bfloat16")
        assert (fields["tp_size"], fields["attn_dp_size"]) == (tp, attn_dp)
        assert (fields["disaggregation_decode_extra_slots"] or 0) == extra
        fraction = fields["mem_fraction_static"]
    else:
        fraction = float(re.search(r"= ([\d.]+) x \([\d.]+ GiB - start-up", result["error"])[1])
    totals = device_totals(n_g, t, fp8, context, prefill, extra)
    gpu = GPU_MIB[GPU_OF[result["model"]]] * 2**20
    weights = weights_per_gpu(CONFIGS[result["model"]], tp, attn_dp)
    # sglang's rule over what its profile will see (the GPU less the stated overhead)
    budget = int((gpu - sizing_budget.STARTUP_OVERHEAD) * fraction) - weights
    params = dict(row=FP8_ROW if fp8 else BF16_ROW, context=context, prefill=prefill, extra=extra)
    return totals, budget, result["node_memory"] - HOST_RESERVE, {**params, "n_g": n_g, "t": t}


def test_readme_lines_fit_the_gpus_they_name(launches):
    readme = {k: v for k, v in launches.items() if k.startswith("readme_")}
    assert [v["model"] for v in readme.values()] == ["dsv32", "w4", "dsv32"]
    for name, result in readme.items():
        assert result["error"] is None, (name, result["error"])
        totals, budget, host_limit, _ = independent(result)
        device = sum(v for k, v in totals.items() if k != "host")
        assert device <= budget, name
        assert 8 * totals["host"] <= host_limit, name
        assert (
            f"GPU total {sizing_weights.gib(device)} <= KV budget {sizing_weights.gib(budget)}"
            in result["log"]
        )


def logged_sizing_block(launches) -> list[list[str]]:
    """What the launcher logs for README's lines, less the weights' parts and the node's
    available memory (which depends on the machine)."""
    left_out = ("available host memory", "weights from ", "  shared experts")
    return [
        [ln for ln in r["log"].splitlines()[1:] if not any(x in ln for x in left_out)]
        for k, r in launches.items()
        if k.startswith("readme_")
    ]


def test_readme_sizing_block_is_the_launchers_log(launches):
    assert readme_sizing_block() == logged_sizing_block(launches)


@pytest.mark.parametrize("name", list(REFUSED))
def test_launcher_refuses_what_does_not_fit(launches, name):
    result = launches[name]
    error = result["error"] or ""
    assert error.startswith("ConfigError: sglang-echo"), error
    totals, budget, host_limit, params = independent(result)
    device = sum(v for k, v in totals.items() if k != "host")
    if REFUSED[name] == "the GPU":
        assert f"the GPU ({sizing_weights.gib(device)} > {sizing_weights.gib(budget)})" in error
    else:
        assert (
            f"the host ({sizing_weights.gib(8 * totals['host'])} > {sizing_weights.gib(host_limit)})"
            in error
        )
    for key in ("rows", "keys", "metadata", "tables"):
        assert sizing_weights.gib(totals[key]) in error, key
    assert f"= {sizing_weights.gib(8 * totals['host'])}" in error  # the node's pinned pools
    best_t, best_n = largest_fitting(budget=budget, host_limit=host_limit, **params)
    if best_t is None:  # the weights leave too little for the device cache itself
        assert "no --max-total-tokens fits" in error
    else:
        assert f"--max-total-tokens {best_t} (with" in error
    if best_n is None:
        assert "no NSA_DEV_CACHE_SIZE fits" in error
    else:
        assert f"NSA_DEV_CACHE_SIZE={best_n} (with" in error
    if REFUSED[name] != "the GPU":
        assert "--mem-fraction-static" not in error  # no fraction makes host memory
        return
    gpu = GPU_MIB[GPU_OF[result["model"]]] * 2**20
    argv = result["argv"]
    tp = int(flag(argv, "--tp-size", flag(argv, "--tp", 1)))
    attn_dp = int(flag(argv, "--dp-size", 1)) if "--enable-dp-attention" in argv else 1
    weights = weights_per_gpu(CONFIGS[result["model"]], tp, attn_dp)
    best_f = smallest_fitting_fraction(device, gpu, weights)
    assert named(error, FRACTION_NAMED) == (None if best_f is None else str(best_f))
    # sglang's default fraction moves with the decode graphs: each PD refusal says how far.
    # (On the non-PD server with DP attention the plugin's probe of sglang's rule,
    # args_sizing.graph_fractions, does not reproduce the launch's own fraction, so it gives no
    # graph advice rather than a wrong one; why it differs there is not yet known.)
    if "--disaggregation-mode" in argv:
        assert "--cuda-graph-max-bs-decode" in error
    assert sizing_weights.gib(sizing_budget.STARTUP_OVERHEAD) in error and "is an estimate" in error


def test_launcher_hooks_the_profile(launches):
    """Loading the plugin applies the exact check's hook (install registers it; the late
    resolution step refuses to start where it did not apply)."""
    assert launches["_hooks"]["profile_hooked"], launches["_hooks"]
    from sglang_echo.sglang import guards

    assert guards.hooks_problem({guards.PROFILE_TARGET}) is None
    assert guards.PROFILE_TARGET in (guards.hooks_problem(set()) or "")


@pytest.mark.parametrize("name", [n for n, w in REFUSED.items() if w == "the GPU"])
def test_named_fraction_and_graphs_are_the_boundary(launches, boundaries, name):
    """At the --mem-fraction-static a GPU refusal names, the launch starts; 0.001 lower it
    is refused. At the --cuda-graph-max-bs-decode it names (sglang's default fraction
    then), it starts; one batch more, refused (the real launcher, both times)."""
    error = launches[name]["error"]
    checked = 0
    for key, starts in (
        ("fraction", True),
        ("fraction_below", False),
        ("graphs", True),
        ("graphs_above", False),
    ):
        result = boundaries.get(f"{name}:{key}")
        if result is None:
            continue
        checked += 1
        if starts:
            assert result["error"] is None, (key, result["error"])
            totals, budget, _, _ = independent(result)
            assert sum(v for k, v in totals.items() if k != "host") <= budget, key
        else:
            assert "ECHO's pools do not fit the GPU" in (result["error"] or ""), key
    assert checked >= 2 or "no --mem-fraction-static below 1 fits" in error
    if named(error, GRAPHS_NAMED) is None and "--disaggregation-mode" in launches[name]["argv"]:
        assert "no --cuda-graph-max-bs-decode fits" in error


@pytest.mark.parametrize("name", ACCEPTED)
def test_launcher_accepts_bf16_rows_that_fit(launches, name):
    result = launches[name]
    assert result["error"] is None, result["error"]
    assert result["fields"]["kv_cache_dtype"] == "bfloat16"
    totals, budget, _, _ = independent(result)
    assert sum(v for k, v in totals.items() if k != "host") <= budget


# ------------------------------------------------------------------ the launcher (driver)
def _driver(cases_path: str) -> None:
    """Resolve each case as the launcher does (dry_parse.run_case), with the GPU's and the
    node's memory stubbed; print the resolved fields or the error, and the sizing log."""
    import logging

    import dry_parse  # stubs the device-capability query
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_echo.sglang.guards import PROFILE_TARGET

    hooked = {"profile_hooked": PROFILE_TARGET in HookRegistry._patched}
    print("HOOKS " + json.dumps(hooked), flush=True)
    import sglang.srt.arg_groups.memory_hook as memory_hook
    import sglang.srt.layers.quantization.moe_wna16 as moe_wna16
    from sglang.srt.mem_cache import host_memory
    from sglang.srt.utils import common

    machine = {}
    gpu = lambda device=None: machine["gpu_mib"]  # noqa: E731
    common.get_device_memory_capacity = gpu
    memory_hook.get_device_memory_capacity = gpu
    host_memory.available_host_memory_bytes = lambda **kwargs: machine["node_memory"]
    moe_wna16.get_device_capability = lambda *args, **kwargs: (9, 0)  # an H20's sm90

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    log = logging.getLogger("sglang_echo.sglang.args_sizing")
    log.setLevel(logging.INFO)
    log.addHandler(Keep())
    names = ("hisparse_config", "kv_cache_dtype", "disaggregation_mode", "context_length",
             "disaggregation_decode_extra_slots", "tp_size", "attn_dp_size",
             "mem_fraction_static")  # fmt: skip
    for c in json.loads(Path(cases_path).read_text()):
        machine.update(gpu_mib=c["gpu_mib"], node_memory=c["node_memory"])
        records.clear()
        result = dry_parse.run_case(c)
        fields = {
            n: eval(result["fields"][n], {}) for n in names if "fields" in result
        }  # values were written with repr()
        out = {
            "name": c["name"],
            "error": result.get("error"),
            "fields": fields,
            "log": "\n".join(r for r in records if "pools fit" in r),
        }
        print("CASE " + json.dumps(out), flush=True)


if __name__ == "__main__":
    _driver(sys.argv[1])
