"""The end-to-end study on one GPU (issue 14): a fake-transfer PD decode node holding
100K-110K-token requests, ECHO vs no-offload, at DeepSeek-V3.2's per-layer dimensions.

    PYTHONUNBUFFERED=1 python3 benchmark/e2e_study.py --out DIR      # the H200 run
    python benchmark/e2e_study.py --smoke --out DIR                  # tiny, on the CPU

benchmark/results/e2e_study.json (+ .log) came from the stage ``study`` of
``benchmark/device_session.sh`` (``--repeats 2 --deadline-s 150``) on one H200, and
e2e_study_fp8.json from its stage ``study_fp8`` (``--kv-cache-dtype fp8_e4m3``); each record
holds its command, and benchmark/results/PROVENANCE.md names the code.

The model (sglang_echo/study/worker.py) is random, built in memory: DeepSeek-V3.2's real
attention and indexer dimensions (hidden 7168, 128 heads, q_lora 1536, kv_lora 512, rope
64, v_head 128, indexer 64 x 128 fp8, top-k 2048), bf16 KV, and in every layer one DP
worker's share of the 4-bit MoE at equal bytes (study/moe.py: 32 local experts touched by
a global batch of 8 x b tokens). Requests are admitted by the decode node
(study/decode_node.py) as their engine's capacity rules allow (no-offload: pool //
context; ECHO: min(N_G // top-k, host pool // context)), with synthetic prompt KV
(study/synthetic_kv.py) whose top-k locality is set by one knob (study/locality.py;
every result carries ``locality_source``). Decode steps run from CUDA graphs after a
warm-up; per-step device time is measured with CUDA events (medians), host time with
the wall clock; output tokens/s = batch / device step time.

Settings: the paper's (no-offload pool 380K tokens vs NSA_DEV_CACHE_SIZE 260K with a host
pool of 1.8M; then both at 200K and at 110K), equal HBM at 380K (every byte of KV state
counted: ECHO's device rows and metadata, the index keys and host->device map of every
host token), and batch 1-4 without pressure.

Noise: one H200's step times drift ~15% from run to run, so a ratio of two measurements
taken minutes apart says little. Each ratio's phases are measured ``--repeats`` times in
one run, ECHO and its no-offload baseline interleaved (baseline, ECHO, baseline, ECHO: the
engines of such a block live together), and the metrics take each side's median; the
spread (``ratio_min``/``ratio_max`` over every pair, ``details.repeats``) comes with them.

Depth: the measured steps have L layers (8). ``estimate_61_layers`` is an estimate, not a
measurement: the step's fixed part (embedding, final norm, the 4096-entry LM head,
sampling) is timed alone at each batch, the rest of the step is L identical layers, and
a 61-layer step is the fixed part plus 61 such layers (DeepSeek-V3.2's 3 dense-FFN layers
counted as MoE layers); on a GPU also with a timed 129,280-entry LM head. The record
(<out>/e2e_study.json) is rewritten after every phase, so a timeout still leaves data.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

from sglang_echo.config import EchoConfig
from sglang_echo.kernels.topk_flashinfer import describe_topk
from sglang_echo.model.kv_cache import PlainKVCache
from sglang_echo.offload.hisparse_cache import DEFAULT_DEVICE_BUFFER_SIZE, HiSparseKVCache
from sglang_echo.runtime.kv_factory import echo_cache_for_model
from sglang_echo.runtime.step_runner import StepRunner
from sglang_echo.study.decode_node import DecodeNode
from sglang_echo.study.locality import Locality
from sglang_echo.study.moe import LocalRoutedMoE, bytes_table
from sglang_echo.study.synthetic_kv import SyntheticKV
from sglang_echo.study.worker import (
    DSV32_DIMS,
    DSV32_MOE,
    SMOKE_DIMS,
    SMOKE_MOE,
    build_worker,
    study_config,
)

T0 = time.perf_counter()
# Per-token bytes of ECHO state per layer besides the MLA rows: device_to_host (int32),
# priority (int64) and the free stack (int32) per slot; host_to_device (int32) per host
# token (offload/device_cache.py).
SLOT_META_BYTES = 4 + 8 + 4
HOST_META_BYTES = 4
# DeepSeek-V3.2's depth and vocabulary, for the 61-layer estimate.
DSV32_LAYERS = 61
DSV32_VOCAB = 129_280
# Repeats of each baseline/ECHO pair when --repeats is not given: two on the GPU (the
# noise there is ~15% run to run), two in the smoke run too so its record has spreads.
GPU_REPEATS = 2
SMOKE_REPEATS = 2
# The lossless checks compare every request of a batch, each over at least this many greedy
# tokens (the GPU study decodes 1 + --warmup + --steps = 41 per request); the smoke run,
# which decodes 6, compares what it decodes.
MIN_TOKENS_COMPARED = 32


def log(msg: str) -> None:
    stamp = time.strftime("%H:%M:%S")
    print(f"[{stamp} +{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


# --------------------------------------------------------------------------- plan
@dataclass
class Plan:
    """Sizes of one run: the GPU study or its CPU smoke miniature."""

    dims: dict
    moe: dict
    layers: int
    vocab: int
    ctx_min: int
    ctx_max: int
    paper_pool: int  # no-offload pool of the paper's all-HBM setting (380K)
    paper_dev_cache: int  # NSA_DEV_CACHE_SIZE of that setting (260K)
    host_pool: int  # 1.8M
    same_pools: list[int]  # both backends at these sizes (200K, 110K)
    equal_hbm_batches: list[int]  # ECHO batch targets sized into the 380K pool's bytes
    low_load_batches: list[int]
    dtype: torch.dtype = torch.bfloat16
    indexer_mode: str = "fp8_hadamard"
    moe_batches: list[int] = field(default_factory=list)
    kv_cache_dtype: str = "auto"  # or fp8_e4m3: 656-byte KV rows (kernels/fp8_kv.py)


def gpu_plan(layers: int) -> Plan:
    return Plan(
        dims=DSV32_DIMS,
        moe=DSV32_MOE,
        layers=layers,
        vocab=4096,
        ctx_min=100_000,
        ctx_max=108_000,
        paper_pool=380_000,
        paper_dev_cache=260_000,
        host_pool=1_800_000,
        same_pools=[200_000, 110_000],
        equal_hbm_batches=[24],
        low_load_batches=[1, 2, 3, 4],
        moe_batches=[1, 2, 3, 4, 8, 16, 24, 32, 64],
    )


def smoke_plan() -> Plan:
    return Plan(
        dims=SMOKE_DIMS,
        moe=SMOKE_MOE,
        layers=2,
        vocab=64,
        ctx_min=200,
        ctx_max=240,
        paper_pool=820,
        paper_dev_cache=160,
        host_pool=3600,
        same_pools=[400, 280],
        equal_hbm_batches=[6],
        low_load_batches=[1, 2],
        dtype=torch.float32,
    )


def prompt_len(plan: Plan, seed: int) -> int:
    return random.Random(seed).randrange(plan.ctx_min, plan.ctx_max + 1)


# ------------------------------------------------------------------ accounting
def row_bytes(cfg, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> tuple[int, int]:
    """(MLA row bytes as stored, index-key row bytes) per token per layer."""
    width, stored = cfg.kv_storage(dtype, kv_cache_dtype)
    kv = width * torch.empty((), dtype=stored).element_size()
    idx_dtype = cfg.index_row_dtype(dtype)
    idx = cfg.index_row_dim * torch.empty((), dtype=idx_dtype).element_size()
    return kv, idx


def equal_hbm_split(cfg, plan: Plan, pool: int, batch: int, max_new: int) -> tuple[int, int]:
    """(N_G, host tokens) for ECHO in the device bytes of a ``pool``-token no-offload pool:
    the host pool holds ``batch`` requests of the longest budget; the remaining bytes buy
    device slots (row + metadata). Per layer: pool x (kv + idx) = N_G x (kv + slot meta)
    + H x (idx + host meta)."""
    kv, idx = row_bytes(cfg, plan.dtype, plan.kv_cache_dtype)
    host = batch * (plan.ctx_max + max_new)
    budget = pool * (kv + idx) - host * (idx + HOST_META_BYTES)
    return budget // (kv + SLOT_META_BYTES), host


def kv_device_bytes(kv_cache) -> int:
    """Every device byte of KV state the backend holds (all layers)."""
    if isinstance(kv_cache, PlainKVCache):
        return kv_cache.nbytes
    if isinstance(kv_cache, HiSparseKVCache):
        maps = (kv_cache.host_to_slot, kv_cache.slot_to_host, kv_cache.stamp, kv_cache.owner)
        return kv_cache.rows.nbytes + kv_cache.index.nbytes + sum(t.nbytes for t in maps)
    total = kv_cache.cache.nbytes + kv_cache.index.nbytes
    ws = getattr(kv_cache.manager, "_workspace", None)
    if ws is not None:
        total += sum(t.nbytes for t in vars(ws).values() if isinstance(t, torch.Tensor))
    return total


# ---------------------------------------------------------------------- timing
class EventTimer:
    """Wraps the runner's CUDA-graph decode call: device time by events around it, and
    the host clock at its entry and exit (the rest of a step is host work)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.entered = self.left = 0.0

    def __call__(self, batch):
        self.entered = time.perf_counter()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = self.inner(batch)
        end.record()
        self.events.append((start, end))
        self.left = time.perf_counter()
        return out


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def graph_us(fn, reps: int = 20, chain: int = 10) -> float:
    """Median device time of ``fn`` replayed from a CUDA graph (benchmark/kernels/common.py
    does the same; kept here so this script runs alone)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(chain):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / chain)
    del graph
    return statistics.median(times)


# ---------------------------------------------------------------- breakdown
# Kernel name -> part of the step (Triton kernels are named by their function).
CATEGORY_RULES = (
    ("indexer_logits", ("fp8_index_logits", "fp8_logits")),
    ("topk", ("topk", "_hist_kernel", "_collect_kernel")),
    ("cache_mgmt", ("_lookup_kernel", "_rank_kernel", "_assign_kernel", "_finish_kernel")),
    ("recall", ("recall",)),
    ("sparse_mla", ("sparse_mla", "_combine_kernel")),
    ("moe_grouped_gemm", ("grouped", "group")),
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "gemv", "matmul")),
)
AMBIGUOUS = ("_count_kernel",)  # in both the top-k and the allocation kernels


def categorize(names: list[str]) -> list[str]:
    """Category per kernel, in launch order; an ambiguous name takes the category of the
    nearest earlier top-k or cache-management kernel (they run in separate phases)."""
    out, last = [], "topk"
    for name in names:
        low = name.lower()
        cat = "other"
        if any(a in name for a in AMBIGUOUS):
            cat = last
        else:
            for label, keys in CATEGORY_RULES:
                if any(k in low for k in keys):
                    cat = label
                    break
        if cat in ("topk", "cache_mgmt"):
            last = cat
        out.append(cat)
    return out


def first_difference(a: list[list[int]], b: list[list[int]]) -> list[int] | None:
    """[request, token] of the first greedy token where two runs' outputs differ (None:
    none in their common length), to tell a near tie at one token from a broken cache."""
    for req, (x, y) in enumerate(zip(a, b, strict=False)):
        for tok, (u, v) in enumerate(zip(x, y, strict=False)):
            if u != v:
                return [req, tok]
    return None


def outputs_agree(
    a: list[list[int]], b: list[list[int]], min_tokens: int = MIN_TOKENS_COMPARED
) -> bool:
    """Same requests (every request both runs held, in admission order), each with at least
    ``min_tokens`` tokens in common, equal over their common length. A profiled run decodes
    its profiler's steps on top of the measured ones (the b1 low-load phase's first run: 44
    tokens against its repeats' 41), so a longer output whose common part matches is
    agreement; a request with fewer than ``min_tokens`` tokens to compare is not (one
    token proves little)."""
    return (
        len(a) == len(b) > 0
        and all(min(len(x), len(y)) >= min_tokens for x, y in zip(a, b, strict=True))
        and first_difference(a, b) is None
    )


def tokens_in_common(a: list[list[int]], b: list[list[int]]) -> int:
    """Tokens two runs' outputs share positions for (what ``outputs_agree`` compared)."""
    return sum(min(len(x), len(y)) for x, y in zip(a, b, strict=False))


def profile_breakdown(node: DecodeNode, steps: int) -> dict:
    """Device time per step by kernel category, from the profiler over ``steps`` graph-
    replayed decode steps."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            node.step()
        torch.cuda.synchronize()
    kernels = sorted(
        (e.time_range.start, e.time_range.elapsed_us(), e.name)
        for e in prof.events()
        if e.device_type == DeviceType.CUDA
    )
    cats = categorize([k[2] for k in kernels])
    per: dict[str, float] = {}
    for (_, us, _), cat in zip(kernels, cats, strict=True):
        per[cat] = per.get(cat, 0.0) + us
    total = sum(per.values())
    top: dict[str, float] = {}
    for _, us, name in kernels:
        top[name] = top.get(name, 0.0) + us
    heavy = sorted(top.items(), key=lambda kv: -kv[1])[:12]
    return {
        "ms_per_step": {k: round(v / steps / 1000, 4) for k, v in sorted(per.items())},
        "fraction": {k: round(v / total, 4) for k, v in sorted(per.items())} if total else {},
        "kernels": len(kernels) // max(1, steps),
        "top_kernels_ms_per_step": {n[:120]: round(us / steps / 1000, 4) for n, us in heavy},
    }


def profile_graph(fn, replays: int = 5) -> dict:
    """Device time per replay of ``fn``'s CUDA graph by kernel name (microseconds): where a
    component's time goes (e.g. the MoE's grouped GEMMs against its routing and gathers)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    per: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            per[e.name[:100]] = per.get(e.name[:100], 0.0) + e.time_range.elapsed_us()
    ranked = sorted(per.items(), key=lambda kv: -kv[1])
    return {name: round(us / replays, 2) for name, us in ranked}


# ------------------------------------------------------------------- engines
@dataclass
class Phase:
    label: str
    batch: int | None  # None: as many as the capacity rules admit
    locality: Locality
    profile: bool = False
    fill: bool = False  # ECHO: keep warming up until the device cache evicts (steady state)
    repeated: bool = True  # measured --repeats times (a ratio's input), else once
    repeat: int = 0  # which measurement of this phase (0 first)


def _nth(phase: Phase, r: int) -> Phase:
    """The r-th measurement of ``phase``: profiled only the first time (the profiler slows
    the steps and its breakdown needs one run)."""
    return replace(phase, repeat=r, profile=phase.profile and r == 0)


def _tag(phase: Phase) -> str:
    return phase.label + (f"#{phase.repeat}" if phase.repeat else "")


PRESSURE_SPARE = 8  # the pressure checks' spare rows: top-k / this (per request: HiSparse)


@dataclass
class Engine:
    label: str
    backend: str  # "no-offload" | "echo" | "hisparse"
    pool: int = 0  # no-offload pool tokens
    dev_cache: int = 0  # ECHO N_G; HiSparse-like: device slots (requests x buffer)
    host: int = 0  # host pool tokens (ECHO and HiSparse-like)
    max_batch: int = 256
    phases: list[Phase] = field(default_factory=list)
    # Baseline engines measured in this engine's block, each phase of theirs just before
    # this engine's phase of the same label, once per repeat (A B A B ...): both sides of
    # a ratio then see the same drift of the GPU's clocks and temperature.
    partners: list[str] = field(default_factory=list)
    buffer: int = 0  # HiSparse-like: rows per request and layer (0: --hisparse-buffer)


class Study:
    def __init__(self, args: argparse.Namespace, argv: list[str]) -> None:
        self.args = args
        self.argv = argv
        self.plan = smoke_plan() if args.smoke else gpu_plan(args.layers)
        self.plan.kv_cache_dtype = args.kv_cache_dtype
        if args.smoke and args.kv_cache_dtype == "fp8_e4m3":  # fp8 tiles are 128 wide
            self.plan.dims = {**self.plan.dims, "kv_lora_rank": 128}
        self.device = torch.device(
            "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
        )
        self.cuda = self.device.type == "cuda"
        self.max_new = args.warmup + args.fill_max + args.steps + args.profile_steps + 2
        # Tokens each compared request must have (parse_args holds the GPU study to 32).
        self.min_compared = min(MIN_TOKENS_COMPARED, 1 + args.warmup + args.steps)
        self.buffer_size = args.hisparse_buffer or (
            DEFAULT_DEVICE_BUFFER_SIZE if not args.smoke else 2 * smoke_plan().dims["index_topk"]
        )
        p = self.plan
        # The largest low-load batch the paper's no-offload pool holds (3 at 100K-108K).
        self.pressure_batch = max(
            b for b in p.low_load_batches if b * (p.ctx_max + self.max_new) <= p.paper_pool
        )
        self.cfg = study_config(
            p.dims, p.layers, p.vocab, p.ctx_max + self.max_new + 64, p.indexer_mode
        )
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.runs: list[dict] = []
        self.components: dict = {}
        self.errors: list[str] = []
        self.skipped: list[str] = []  # engines the plan cannot build, and why
        self.node: DecodeNode | None = None

    # ---------------------------------------------------------------- record
    def record(self, final: bool = False) -> dict:
        metrics = self.metrics()
        rec = {
            "name": "e2e_study",
            "device": torch.cuda.get_device_name() if self.cuda else "cpu",
            "date": time.strftime("%Y-%m-%d"),
            "command": "python3 benchmark/e2e_study.py " + shlex.join(self.argv),
            "metrics": metrics,
            "config": self.config(),
            "complete": final,
            "errors": self.errors,
            "skipped": self.skipped,
            "runs": self.runs,
            "components": self.components,
        }
        (self.out / "e2e_study.json").write_text(json.dumps(rec, indent=2) + "\n")
        return rec

    def config(self) -> dict:
        p, a = self.plan, self.args
        kv, idx = row_bytes(self.cfg, p.dtype, p.kv_cache_dtype)
        return {
            "smoke": a.smoke,
            "layers": p.layers,
            "dims": p.dims,
            "moe": p.moe,
            "vocab": p.vocab,
            "dtype": str(p.dtype),
            "kv_cache_dtype": p.kv_cache_dtype,
            "indexer_mode": p.indexer_mode,
            "kv_row_bytes": kv,
            "index_row_bytes": idx,
            "prompt_tokens": [p.ctx_min, p.ctx_max],
            "warmup_steps": a.warmup,
            "measured_steps": a.steps,
            "profile_steps": a.profile_steps,
            "stable_fraction": a.locality,
            "repeats": a.repeats,
            "order": [f"{e.label}/{_tag(ph)}" for block in self.schedule() for e, ph in block],
            "cuda_graphs": self.cuda,
            "torch": torch.__version__,
            "topk": describe_topk(),
            "engines": [
                {k: v for k, v in vars(e).items() if k != "phases"} for e in self.engines()
            ],
            "notes": (
                "device times: CUDA events around each graph-replayed decode step (medians); "
                "throughput = batch / device step time; wall = host clock per step (the step "
                "is not overlapped with host work). Repeated phases (config.order, '#r' the "
                "r-th repeat) alternate with their baseline in one block; metrics use each "
                "side's median. estimate_61_layers is an estimate, not a measurement."
            ),
        }

    # --------------------------------------------------------------- engines
    def engines(self) -> list[Engine]:
        p, a = self.plan, self.args
        loc = Locality(a.locality)
        rand = Locality(0.0)
        full = [Phase("full", None, loc, profile=a.profile_steps > 0, fill=True)]
        # No pressure: no fill. The smallest batch is profiled too, so the record says
        # where ECHO's cost without pressure goes (breakdown_low_load).
        low = [
            Phase(f"b{b}", b, loc, profile=a.profile_steps > 0 and b == min(p.low_load_batches))
            for b in p.low_load_batches
        ]
        sweep = [
            Phase(f"p{x:g}", None, Locality(x), fill=True, repeated=False)
            for x in (float(v) for v in a.locality_sweep.split(",") if v)
        ]
        random_phase = Phase("random", None, rand, fill=True, repeated=False)
        out = [
            Engine("noff_paper", "no-offload", pool=p.paper_pool, phases=list(full)),
            Engine(
                "echo_paper",
                "echo",
                dev_cache=p.paper_dev_cache,
                host=p.host_pool,
                phases=[*full, *([random_phase] if a.random_keys else []), *sweep, *low],
                partners=["noff_paper", "noff_low"],
            ),
            Engine(
                "noff_low",
                "no-offload",
                pool=max(p.low_load_batches) * (p.ctx_max + self.max_new),
                phases=low,
            ),
        ]
        # Lossless at scale: the batch no-offload holds in the paper's pool, under a device
        # cache of the batch's selections plus an eighth of a top-k, fewer spare slots than
        # a step's new selections at this locality, so every step evicts (a decode step's
        # new tokens take no slot until selected: the selections alone fill the cache);
        # greedy outputs must equal noff_low's at the same batch and seeds.
        b_p = self.pressure_batch
        out.append(
            Engine(
                "echo_pressure",
                "echo",
                dev_cache=b_p * self.cfg.index_topk + self.cfg.index_topk // PRESSURE_SPARE,
                host=p.host_pool,
                phases=[Phase(f"b{b_p}", b_p, loc, repeated=False)],  # a lossless check
            )
        )
        # The same check for the HiSparse-like backend: private buffers of one step's
        # selections plus an eighth, fewer rows than a step's new selections at this
        # locality, so every request evicts from about its second step.
        buffer = self.cfg.index_topk + self.cfg.index_topk // PRESSURE_SPARE
        out.append(
            Engine(
                "hisparse_pressure",
                "hisparse",
                dev_cache=b_p * buffer,
                host=p.host_pool,
                phases=[Phase(f"b{b_p}", b_p, loc, repeated=False)],
                buffer=buffer,
            )
        )
        for b in p.equal_hbm_batches:
            n_g, host = equal_hbm_split(self.cfg, p, p.paper_pool, b, self.max_new)
            if n_g < b * self.cfg.index_topk:  # the host tokens' index keys leave too little
                why = (
                    f"equal HBM at batch {b}: the {p.paper_pool}-token pool's bytes hold the "
                    f"index keys of {host} host tokens with room for {max(0, n_g)} device slots, "
                    f"fewer than one step's {b} x {self.cfg.index_topk} selections; not run"
                )
                if why not in self.skipped:  # engines() is called more than once
                    self.skipped.append(why)
                continue
            out.append(
                Engine(f"echo_equal_hbm_b{b}", "echo", dev_cache=n_g, host=host, phases=full)
            )
            # HiSparse's policy in the same device bytes: requests of a private buffer each.
            out.append(
                Engine(
                    f"hisparse_equal_hbm_b{b}", "hisparse", dev_cache=n_g, host=host, phases=full
                )
            )
        for pool in p.same_pools:
            out.append(Engine(f"noff_{pool}", "no-offload", pool=pool, phases=full))
            out.append(
                Engine(
                    f"echo_{pool}",
                    "echo",
                    dev_cache=pool,
                    host=p.host_pool,
                    phases=full,
                    partners=[f"noff_{pool}"],
                )
            )
        if a.only:
            keep = set(a.only.split(","))
            out = [e for e in out if e.label in keep]
        return out

    def build(self, eng: Engine):
        cfg, p, topk = self.cfg, self.plan, self.cfg.index_topk
        if eng.backend == "no-offload":
            kv = PlainKVCache.for_model(cfg, eng.pool, p.dtype, self.device, p.kv_cache_dtype)
            tokens, rows = eng.pool, eng.max_batch
        elif eng.backend == "hisparse":
            buffer = eng.buffer or self.buffer_size
            rows = min(eng.max_batch, eng.dev_cache // buffer)
            kv = HiSparseKVCache.for_model(
                cfg, eng.host, rows, buffer, p.dtype, self.device, p.kv_cache_dtype
            )
            tokens = eng.host
        else:
            echo = EchoConfig(offload=True, dev_cache_size=eng.dev_cache)
            kv = echo_cache_for_model(
                echo, cfg, eng.host, p.dtype, self.device, kv_cache_dtype=p.kv_cache_dtype
            )
            tokens, rows = eng.host, min(eng.max_batch, eng.dev_cache // topk)
        runner = StepRunner(
            self.model,
            kv,
            tokens,
            max_requests=rows,
            max_context=p.ctx_max + self.max_new + 8,
            use_cuda_graph=self.cuda,
        )
        timer = None
        if self.cuda:
            timer = EventTimer(runner.decode_runner)
            runner.decode_runner = timer
        return kv, runner, timer

    def schedule(self) -> list[list[tuple[Engine, Phase]]]:
        """Blocks of (engine, phase) in run order. An engine's block also measures its
        partners (the no-offload baselines), interleaved phase by phase and repeat by
        repeat; a partner left without its host engine (``--only``) gets a block of its
        own. Engines of a block live together, built at their first step."""
        engines = self.engines()
        by_label = {e.label: e for e in engines}
        absorbed = {p for e in engines for p in e.partners if p in by_label}
        blocks = []
        for eng in engines:
            if eng.label in absorbed:
                continue
            partners = [by_label[p] for p in eng.partners if p in by_label]
            steps: list[tuple[Engine, Phase]] = []
            paired: set[tuple[str, str]] = set()
            for ph in eng.phases:
                mates = [(pe, pp) for pe in partners for pp in pe.phases if pp.label == ph.label]
                paired.update((pe.label, pp.label) for pe, pp in mates)
                for r in range(self.args.repeats if ph.repeated else 1):
                    steps += [(pe, _nth(pp, r)) for pe, pp in mates]
                    steps.append((eng, _nth(ph, r)))
            for pe in partners:
                for pp in pe.phases:
                    if (pe.label, pp.label) not in paired:
                        steps += [
                            (pe, _nth(pp, r))
                            for r in range(self.args.repeats if pp.repeated else 1)
                        ]
            blocks.append(steps)
        return blocks

    def past_deadline(self) -> float | None:
        elapsed = time.perf_counter() - T0
        return elapsed if self.args.deadline_s and elapsed > self.args.deadline_s else None

    def run_block(self, steps: list[tuple[Engine, Phase]]) -> None:
        built: dict[str, tuple] = {}
        dropped: set[str] = set()
        for eng, phase in steps:
            if eng.label in dropped:
                continue
            late = self.past_deadline()
            if eng.label not in built:
                if late is not None:
                    msg = f"{eng.label}: skipped at {late:.0f}s, past the {self.args.deadline_s}s deadline"
                    log(msg)
                    self.errors.append(msg)
                    dropped.add(eng.label)
                    continue
                try:
                    built[eng.label] = self.build_logged(eng)
                except Exception as exc:
                    msg = f"{eng.label}: {type(exc).__name__}: {exc}"
                    log("ERROR " + msg)
                    self.errors.append(msg)
                    dropped.add(eng.label)
                    gc.collect()
                    if self.cuda:
                        torch.cuda.empty_cache()
                    continue
            elif phase.repeat and late is not None:
                msg = (f"{eng.label}/{_tag(phase)}: repeat skipped at {late:.0f}s, past the "
                       f"{self.args.deadline_s}s deadline")  # fmt: skip
                log(msg)
                self.errors.append(msg)
                continue
            self.run_step(eng, phase, *built[eng.label])
        built.clear()
        self.node = None
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def build_logged(self, eng: Engine) -> tuple:
        log(f"engine {eng.label}: building ({eng.backend}, pool {eng.pool}, "
            f"N_G {eng.dev_cache}, host {eng.host})")  # fmt: skip
        kv, runner, timer = self.build(eng)
        dev_bytes = kv_device_bytes(kv)
        if self.cuda:
            log(f"  built: KV state {dev_bytes / 2**30:.2f} GiB on the GPU, "
                f"{torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated")  # fmt: skip
        return kv, runner, timer, dev_bytes

    def run_step(self, eng: Engine, phase: Phase, kv, runner, timer, dev_bytes: int) -> None:
        try:
            res = self.run_phase(eng, phase, kv, runner, timer)
        except Exception as exc:  # keep what the other phases measure
            msg = f"{eng.label}/{_tag(phase)}: {type(exc).__name__}: {exc}"
            log("ERROR " + msg)
            self.errors.append(msg)
            if self.node is not None:
                self.node.release_all()
            return
        res["kv_device_bytes"] = kv_device_bytes(kv) if eng.backend != "no-offload" else dev_bytes
        self.runs.append(res)
        self.record()

    def run_phase(self, eng: Engine, phase: Phase, kv, runner: StepRunner, timer) -> dict:
        a = self.args
        synth = SyntheticKV(self.cfg, self.directions, phase.locality, self.plan.dtype, self.device)
        node = self.node = DecodeNode(runner, synth, self.cfg.vocab_size)
        admit_s, admitted = [], []
        seed = 0
        while phase.batch is None or len(node.running) < phase.batch:
            n = prompt_len(self.plan, seed)
            if not node.fits(n, self.max_new):
                break
            t = time.perf_counter()
            admitted.append(node.admit(n, seed, self.max_new))
            if self.cuda:
                torch.cuda.synchronize()
            admit_s.append(time.perf_counter() - t)
            seed += 1
        b = len(node.running)
        if b == 0 or (phase.batch is not None and b < phase.batch):
            raise RuntimeError(f"admitted {b} requests, wanted {phase.batch or '>= 1'}")
        ctx = [r.cached_len for r in node.running]
        log(f"  {eng.label}/{_tag(phase)}: admitted {b} requests (context {min(ctx)}-{max(ctx)}), "
            f"admission {max(admit_s):.3f}s max each")  # fmt: skip
        for _ in range(a.warmup):
            node.step()
        filled = 0
        counters = _eviction_counter(kv)
        if counters is not None and phase.fill:
            # Steady state: a cache that has not filled yet never evicts. Warm up on until
            # it does (or fill_max steps), so the measured steps pay evictions.
            start = int(counters.sum())
            while filled < a.fill_max and int(counters.sum()) == start:
                node.step()
                filled += 1
        moes = [m for m in self.model.modules() if isinstance(m, LocalRoutedMoE)]
        if counters is not None:
            (kv.cache if eng.backend == "echo" else kv).reset_telemetry()
        for m in moes:
            m.touched.zero_()
            m.forwards.zero_()
        if timer is not None:
            timer.events.clear()
        wall, prep, post = [], [], []
        for _ in range(a.steps):
            t0 = time.perf_counter()
            node.step()
            t1 = time.perf_counter()
            wall.append((t1 - t0) * 1e3)
            if timer is not None:
                prep.append((timer.entered - t0) * 1e3)
                post.append((t1 - timer.left) * 1e3)
        if self.cuda:
            torch.cuda.synchronize()
            device_ms = [s.elapsed_time(e) for s, e in timer.events]
        else:
            device_ms = list(wall)
        step_ms = median(device_ms)
        res = {
            "engine": eng.label,
            "backend": eng.backend,
            "phase": phase.label,
            "repeat": phase.repeat,
            "pool": eng.pool,
            "dev_cache": eng.dev_cache,
            "host_pool": eng.host,
            "batch": b,
            "context": [min(ctx), max(ctx)],
            "fill_steps": filled,
            "locality_source": phase.locality.source,
            "admission_s": {"median": median(admit_s), "max": max(admit_s)},
            "step_ms_device": step_ms,
            "step_ms_device_p10_p90": _spread(device_ms),
            "step_ms_wall": median(wall),
            "host_ms": {
                "before_launch": median(prep),
                "after_graph_launch": median(post),
                "wall_minus_device": median(wall) - step_ms if self.cuda else None,
            },
            "layer_us_device": step_ms * 1e3 / self.plan.layers,
            "tokens_per_s_device": b / step_ms * 1e3,
            "tokens_per_s_wall": b / median(wall) * 1e3,
            "experts_touched_per_layer": _touched(moes),
        }
        if counters is not None:
            tel = kv.telemetry()
            res["hit_rate_per_layer"] = [round(h, 4) for h in tel["hit_rate"]]
            res["evictions_per_step"] = sum(tel["evictions"]) / a.steps
            res["recalled_mb_per_step"] = sum(tel["recalled_bytes"]) / a.steps / 2**20
        if phase.profile and self.cuda:
            try:
                res["breakdown"] = profile_breakdown(node, a.profile_steps)
            except Exception as exc:
                res["breakdown"] = {"error": f"{type(exc).__name__}: {exc}"}
        # Greedy outputs of every admitted request: backends that ran the same seeds at the
        # same batch must agree token for token (ECHO is lossless).
        res["outputs"] = [list(r.output) for r in admitted]
        node.release_all()
        res["leak_free"] = _leak_free(eng, kv, runner)
        hit = res.get("hit_rate_per_layer")
        log(f"  {eng.label}/{_tag(phase)}: b={b} step {step_ms:.3f} ms device, "
            f"{res['step_ms_wall']:.3f} ms wall, {res['tokens_per_s_device']:.1f} tok/s"
            + (f", hit {min(hit):.3f}-{max(hit):.3f}, evict/step {res['evictions_per_step']:.0f}"
               if hit else "") + f", leak_free {res['leak_free']}")  # fmt: skip
        return res

    # ----------------------------------------------------------- components
    def measure_components(self) -> None:
        """Graph-replayed parts of one layer at each batch: the MoE (against the bytes
        table) and the attention-side weight GEMMs; the HBM copy bandwidth as ceiling."""
        if not self.cuda:
            return
        hbm = _hbm_copy_gbps(self.device)
        layer = self.model.model.layers[0]
        moe, attn = layer.mlp, layer.self_attn
        table = {r["batch"]: r for r in bytes_table(self.plan.moe_batches)}
        rows = []
        for b in self.plan.moe_batches:
            x = torch.randn(b, self.cfg.hidden_size, device=self.device, dtype=self.plan.dtype)
            moe_us = graph_us(lambda x=x: moe(x))
            proj_us = graph_us(lambda x=x: _attention_weights(attn, x))
            t = table[b]
            rows.append(
                {
                    "batch": b,
                    "moe_us": round(moe_us, 2),
                    "moe_bytes": t["moe_bytes"],
                    "moe_roofline_us": round(t["moe_bytes"] / hbm / 1e3, 2),
                    "moe_gbps": round(t["moe_bytes"] / moe_us / 1e3, 1),
                    "attn_weights_us": round(proj_us, 2),
                    "attn_weight_bytes": t["attention_weight_bytes"],
                    "attn_gbps": round(t["attention_weight_bytes"] / proj_us / 1e3, 1),
                    "experts_touched_formula": t["experts_touched"],
                    "layer_weights_us": round(moe_us + proj_us, 2),
                    "layer_roofline_us": round(t["layer_weight_bytes"] / hbm / 1e3, 2),
                }
            )
            log(f"  components b={b}: moe {moe_us:.1f} us ({rows[-1]['moe_gbps']} GB/s), "
                f"attention weights {proj_us:.1f} us")  # fmt: skip
        kernels = {}
        for b in (3, 16):
            x = torch.randn(b, self.cfg.hidden_size, device=self.device, dtype=self.plan.dtype)
            try:
                kernels[f"moe_b{b}"] = profile_graph(lambda x=x: moe(x))
            except Exception as exc:
                kernels[f"moe_b{b}"] = {"error": f"{type(exc).__name__}: {exc}"}
        moe.touched.zero_()
        moe.forwards.zero_()
        self.components.update(
            {"hbm_copy_gbps": round(hbm, 1), "per_batch": rows, "moe_kernels_us": kernels}
        )

    def measure_fixed_part(self) -> None:
        """What a decode step does besides its layers, timed alone at each batch a ratio
        measured: the embedding and rotary table, the final norm and the LM head (inside
        the measured step), and greedy sampling (DecodeNode's argmax, outside it). On a
        GPU also with a 129,280-entry LM head, DeepSeek-V3.2's vocabulary. The 61-layer
        estimate scales the rest of the step."""
        batches = sorted({r["batch"] for r in self.runs if r["phase"] == "full"})
        if not batches:
            return
        model, dev, dtype = self.model, self.device, self.plan.dtype
        big = None
        if self.cuda:
            big = torch.empty(DSV32_VOCAB, self.cfg.hidden_size, device=dev, dtype=dtype)
            big.normal_(std=0.02)
        rows: dict[int, dict] = {}
        for b in batches:
            ids = torch.randint(0, self.cfg.vocab_size, (b,), device=dev)
            pos = torch.randint(self.plan.ctx_min, self.plan.ctx_max, (b,), device=dev)

            def head(
                w: torch.Tensor = model.lm_head.weight,
                ids: torch.Tensor = ids,
                pos: torch.Tensor = pos,
            ) -> torch.Tensor:
                hidden = model.model.embed_tokens(ids)
                model.rotary().cos_sin(pos, hidden.dtype)
                return torch.nn.functional.linear(model.model.norm(hidden), w).float()

            logits = head()
            row = {
                "embed_norm_lm_head_ms": round(self.time_ms(head), 5),
                "sampling_ms": round(self.time_ms(lambda x=logits: x.argmax(dim=-1)), 5),
            }
            if big is not None:
                big_logits = head(big)
                row["embed_norm_lm_head_129k_ms"] = round(self.time_ms(lambda w=big: head(w)), 5)
                row["sampling_129k_ms"] = round(
                    self.time_ms(lambda x=big_logits: x.argmax(dim=-1)), 5
                )
                del big_logits
            rows[b] = row
            log(f"  fixed part b={b}: " + ", ".join(f"{k} {v:.4f}" for k, v in row.items()))
        del big
        how = "CUDA-graph replays (median)" if self.cuda else "wall clock (median of 20)"
        self.components["fixed_part"] = {
            "per_batch": rows,
            "source": "measured in this run: embedding + rotary + final norm + LM head "
            f"({self.plan.vocab} entries, as modelled) and greedy sampling, timed alone "
            f"at each batch by {how}",
        }
        self.record()

    def time_ms(self, fn) -> float:
        if self.cuda:
            return graph_us(fn) / 1e3
        for _ in range(2):
            fn()
        times = []
        for _ in range(20):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)

    def component_at(self, batch: int) -> dict | None:
        rows = self.components.get("per_batch") or []
        if not rows:
            return None
        return min(rows, key=lambda r: abs(r["batch"] - batch))

    # -------------------------------------------------------------- metrics
    def find_all(self, engine: str, phase: str = "full") -> list[dict]:
        """Every measurement of (engine, phase), in run order (repeat 0 first)."""
        return [r for r in self.runs if r["engine"] == engine and r["phase"] == phase]

    def find(self, engine: str, phase: str = "full") -> dict | None:
        runs = self.find_all(engine, phase)
        return runs[0] if runs else None

    def ratio(self, echo: str, noff: str, phase: str = "full") -> dict | None:
        """ECHO's throughput over no-offload's (at its "full" phase), each side the median
        of its repeats, with the range over every (ECHO, no-offload) pair of measurements:
        it holds the median ratio and shows how far one pair alone could have strayed."""
        es, ns = self.find_all(echo, phase), self.find_all(noff)
        if not es or not ns:
            return None
        mid, lo, hi = _ratio_range(es, ns)
        return {
            "ratio": round(mid, 3),
            "ratio_min": round(lo, 3),
            "ratio_max": round(hi, 3),
            "ratio_wall": round(_med(es, "tokens_per_s_wall") / _med(ns, "tokens_per_s_wall"), 3),
            "repeats": {"echo": len(es), "no_offload": len(ns)},
            "echo_batch": es[0]["batch"],
            "no_offload_batch": ns[0]["batch"],
            "echo_step_ms": round(_med(es, "step_ms_device"), 3),
            "no_offload_step_ms": round(_med(ns, "step_ms_device"), 3),
            "echo_hit_rate_mean": round(
                statistics.median(statistics.mean(e["hit_rate_per_layer"]) for e in es), 4
            ),
        }

    def sweep(self) -> dict:
        """Ratio and hit rate against the stable fraction (the knob's calibration)."""
        out = {}
        for r in self.runs:
            phase = r["phase"]
            swept = phase in ("full", "random") or phase.startswith("p")
            if r["engine"] != "echo_paper" or not swept or r["locality_source"] in out:
                continue
            ratio = self.ratio("echo_paper", "noff_paper", phase=r["phase"])
            out[r["locality_source"]] = ratio and {
                "hit_rate_mean": ratio["echo_hit_rate_mean"],
                "hit_rate_min": min(r["hit_rate_per_layer"]),
                "ratio": ratio["ratio"],
                "echo_step_ms": ratio["echo_step_ms"],
                "evictions_per_step": r["evictions_per_step"],
            }
        return out

    def breakdown(self, runs: list[dict]) -> dict | None:
        """Step and per-layer times from the median of the repeats; host times and the
        profiler from the first (the only profiled) measurement."""
        if not runs:
            return None
        run, step = runs[0], _med(runs, "step_ms_device")
        layer_us = step * 1e3 / self.plan.layers
        comp = self.component_at(run["batch"])
        out = {
            "batch": run["batch"],
            "step_ms_device": step,
            "layer_us_device": round(layer_us, 2),
            "host_ms": run["host_ms"],
            "step_ms_wall": run["step_ms_wall"],
        }
        if comp is not None:
            out["per_layer_us_by_difference"] = {
                "moe_ffn": comp["moe_us"],
                "attention_weights": comp["attn_weights_us"],
                "attention_side_rest": round(layer_us - comp["moe_us"] - comp["attn_weights_us"], 2),
                "component_batch": comp["batch"],
            }  # fmt: skip
        if "breakdown" in run:
            out["profiler"] = run["breakdown"]
        return out

    def repeats(self) -> dict[str, list[float]]:
        """Device step ms of every measurement of each repeated phase, in run order; keyed
        by engine for its "full" phase, else engine/phase."""
        out = {}
        for eng in self.engines():
            for ph in eng.phases:
                runs = self.find_all(eng.label, ph.label) if ph.repeated else []
                if runs:
                    key = eng.label if ph.label == "full" else f"{eng.label}/{ph.label}"
                    out[key] = [round(r["step_ms_device"], 4) for r in runs]
        return out

    def estimate_settings(self) -> dict[str, tuple[str, str]]:
        """Headline metric -> (offloading engine, no-offload engine) of its ratio; the
        equal-HBM ones per batch target (the metric is the best of them)."""
        same = self.plan.same_pools
        out = {"ratio_paper_all_hbm": ("echo_paper", "noff_paper")}
        for key, pool in zip(("ratio_paper_200k", "ratio_paper_110k"), same, strict=False):
            out[key] = (f"echo_{pool}", f"noff_{pool}")
        for b in self.plan.equal_hbm_batches:
            out[f"ratio_equal_hbm_380k_b{b}"] = (f"echo_equal_hbm_b{b}", "noff_paper")
            out[f"hisparse_ratio_equal_hbm_380k_b{b}"] = (f"hisparse_equal_hbm_b{b}", "noff_paper")
        return out

    def estimate_side(self, label: str) -> dict | None:
        """One backend's 61-layer step: its fixed part (timed alone at its batch) plus 61
        times the per-layer time left when that fixed part is taken off the measured step
        (median of the repeats). Without a timed fixed part, the whole step is layers."""
        runs = self.find_all(label)
        if not runs:
            return None
        b, step, layers = runs[0]["batch"], _med(runs, "step_ms_device"), self.plan.layers
        fixed = (self.components.get("fixed_part") or {}).get("per_batch", {}).get(b)
        in_step = fixed["embed_norm_lm_head_ms"] if fixed else 0.0
        layer = (step - in_step) / layers
        if layer <= 0:
            return {"batch": b, "step_ms_measured": round(step, 4), "error": "fixed part >= step"}
        out = {
            "batch": b,
            "step_ms_measured": round(step, 4),
            "layer_ms": round(layer, 4),
            "fixed_ms": fixed and round(in_step + fixed["sampling_ms"], 4),
        }
        step61 = DSV32_LAYERS * layer + (in_step + fixed["sampling_ms"] if fixed else 0.0)
        out["step_ms_61"] = round(step61, 3)
        out["tokens_per_s_61"] = round(b / step61 * 1e3, 1)
        if fixed and "embed_norm_lm_head_129k_ms" in fixed:
            big = fixed["embed_norm_lm_head_129k_ms"] + fixed["sampling_129k_ms"]
            out["step_ms_61_lm_head_129k"] = round(DSV32_LAYERS * layer + big, 3)
        return out

    def capacity_61(self, label: str) -> dict | None:
        """Token capacity and KV bytes of one engine at 61 layers: a pool token is one row
        in every layer, so the tokens (and the batches they admit) do not change, the
        bytes grow 61/L times."""
        eng = next((e for e in self.engines() if e.label == label), None)
        if eng is None:
            return None
        kv, idx = row_bytes(self.cfg, self.plan.dtype, self.plan.kv_cache_dtype)
        gib = DSV32_LAYERS / 2**30
        if eng.backend == "no-offload":
            return {
                "pool_tokens": eng.pool,
                "device_kv_gib_61": round(eng.pool * (kv + idx) * gib, 2),
            }
        device = eng.dev_cache * (kv + SLOT_META_BYTES) + eng.host * (idx + HOST_META_BYTES)
        return {
            "device_cache_tokens": eng.dev_cache,
            "host_pool_tokens": eng.host,
            "device_kv_gib_61": round(device * gib, 2),
            "host_kv_gib_61": round(eng.host * kv * gib, 2),
        }  # fmt: skip

    def estimate_61_layers(self) -> dict:
        fixed = self.components.get("fixed_part")
        settings, ratios, ratios_big = {}, {}, {}
        for key, (echo, noff) in self.estimate_settings().items():
            e, n = self.estimate_side(echo), self.estimate_side(noff)
            if not e or not n or "step_ms_61" not in e or "step_ms_61" not in n:
                continue
            entry = {
                "offload_engine": echo,
                "offload": e,
                "no_offload_engine": noff,
                "no_offload": n,
            }
            entry["ratio"] = round(e["tokens_per_s_61"] / n["tokens_per_s_61"], 3)
            ratios[key] = entry["ratio"]
            if "step_ms_61_lm_head_129k" in e and "step_ms_61_lm_head_129k" in n:
                big = (e["batch"] / e["step_ms_61_lm_head_129k"]) / (
                    n["batch"] / n["step_ms_61_lm_head_129k"]
                )
                entry["ratio_lm_head_129k"] = ratios_big[key] = round(big, 3)
            entry["capacity"] = {
                "offload": self.capacity_61(echo),
                "no_offload": self.capacity_61(noff),
            }
            settings[key] = entry
        for best in ("ratio_equal_hbm_380k", "hisparse_ratio_equal_hbm_380k"):
            for table in (ratios, ratios_big):
                vals = [v for k, v in table.items() if k.startswith(best + "_b")]
                if vals:
                    table[best] = max(vals)
        return {
            "estimate": True,
            "label": "ESTIMATE, not measured: a 61-layer step from this run's "
            f"{self.plan.layers}-layer device times",
            "formula": "step_ms_61 = fixed_ms + 61 x layer_ms; layer_ms = (median measured "
            "step - embedding/norm/LM head timed alone at that batch) / L; fixed_ms = that "
            "embedding/norm/LM head time + greedy sampling (argmax) timed alone",
            "fixed_part": fixed["source"]
            if fixed
            else "left out (not measured in this run): step_ms_61 = 61 x step / L",
            "ratios": ratios,
            "ratios_lm_head_129k": ratios_big,
            "settings": settings,
            "notes": [
                "DeepSeek-V3.2's first 3 layers have a dense FFN; they are counted here as MoE "
                "layers (the approximation: every one of the 61 layers costs the measured "
                "attention + MoE layer).",
                f"the LM head is the study's {self.plan.vocab}-entry one; "
                "ratios_lm_head_129k swap in a timed 129,280-entry LM head (DeepSeek-V3.2's, "
                "replicated on the worker: an upper bound on a vocab-parallel head) when the "
                "run is on a GPU",
                "token capacities: the pools are per worker and count tokens of all layers "
                "(one row per layer each), so the admitted batch sizes are the same at 61 "
                "layers; the bytes they take grow 61/L times (capacity: KV GiB at 61 layers)",
                "the fixed part is timed alone (its own CUDA graph), not inside the step's "
                "graph; the per-layer time absorbs any difference",
            ],
        }

    def metrics(self) -> dict:
        paper = self.ratio("echo_paper", "noff_paper")
        pools = {pool: self.ratio(f"echo_{pool}", f"noff_{pool}") for pool in self.plan.same_pools}
        equal = {
            b: self.ratio(f"echo_equal_hbm_b{b}", "noff_paper") for b in self.plan.equal_hbm_batches
        }
        equal_best = max((v for v in equal.values() if v), key=lambda v: v["ratio"], default=None)
        hisparse = {
            b: self.ratio(f"hisparse_equal_hbm_b{b}", "noff_paper")
            for b in self.plan.equal_hbm_batches
        }
        hisparse_best = max(
            (v for v in hisparse.values() if v), key=lambda v: v["ratio"], default=None
        )
        low, low_range = {}, {}
        for b in self.plan.low_load_batches:
            es, ns = self.find_all("echo_paper", f"b{b}"), self.find_all("noff_low", f"b{b}")
            if es and ns:
                mid, lo, hi = _ratio_range(es, ns)
                low[b] = round(1 - mid, 4)
                low_range[b] = [round(1 - hi, 4), round(1 - lo, 4)]
        echo_runs = self.find_all("echo_paper")
        echo_run = echo_runs[0] if echo_runs else None
        low_phase = f"b{min(self.plan.low_load_batches)}"  # the profiled one
        lossless, low_diff, low_tokens = {}, {}, {}
        for b in self.plan.low_load_batches:
            es, ns = self.find_all("echo_paper", f"b{b}"), self.find_all("noff_low", f"b{b}")
            if es and ns:
                ref = ns[0]["outputs"]
                lossless[b] = all(
                    outputs_agree(r["outputs"], ref, self.min_compared) for r in es + ns
                )
                diffs = (first_difference(r["outputs"], ref) for r in es + ns)
                low_diff[b] = next((d for d in diffs if d is not None), None)
                low_tokens[b] = min(tokens_in_common(r["outputs"], ref) for r in es + ns)
        pressure = self.lossless_check("echo_pressure")
        pressure_hisparse = self.lossless_check("hisparse_pressure")
        rand = self.ratio("echo_paper", "noff_paper", phase="random")
        same = self.plan.same_pools
        p200 = pools.get(same[0]) if same else None
        p110 = pools.get(same[1]) if len(same) > 1 else None
        hit = None
        if echo_runs:  # per layer, the median over the repeats
            hit = [round(statistics.median(v), 4) for v in zip(*(r["hit_rate_per_layer"] for r in echo_runs), strict=True)]  # fmt: skip
        return {
            "ratio_paper_all_hbm": paper and paper["ratio"],
            "ratio_paper_200k": p200 and p200["ratio"],
            "ratio_paper_110k": p110 and p110["ratio"],
            "ratio_equal_hbm_380k": equal_best and equal_best["ratio"],
            "hisparse_ratio_equal_hbm_380k": hisparse_best and hisparse_best["ratio"],
            "hisparse_device_buffer_size": self.buffer_size,
            "low_load_cost": {
                "per_batch": low,
                "mean": round(statistics.mean(low.values()), 4) if low else None,
                "per_batch_range": low_range,
            },
            "hit_rate_per_layer": hit,
            "locality_source": echo_run and echo_run["locality_source"],
            "breakdown": {
                "no_offload": self.breakdown(self.find_all("noff_paper")),
                "echo": self.breakdown(echo_runs),
            },
            "breakdown_low_load": {
                "no_offload": self.breakdown(self.find_all("noff_low", low_phase)),
                "echo": self.breakdown(self.find_all("echo_paper", low_phase)),
            },
            "repeats": self.args.repeats,
            "spread": {
                key: {"ratio_min": v["ratio_min"], "ratio_max": v["ratio_max"], **v["repeats"]}
                for key, v in (
                    ("ratio_paper_all_hbm", paper),
                    ("ratio_paper_200k", p200),
                    ("ratio_paper_110k", p110),
                    ("ratio_equal_hbm_380k", equal_best),
                    ("hisparse_ratio_equal_hbm_380k", hisparse_best),
                )
                if v
            },
            "estimate_61_layers": self.estimate_61_layers(),
            "details": {
                "repeats": self.repeats(),
                "paper_all_hbm": paper,
                "same_pools": pools,
                "equal_hbm_380k": equal,
                "hisparse_equal_hbm_380k": hisparse,
                "greedy_outputs_equal_at_low_load": lossless,
                "first_difference_at_low_load": low_diff,
                "tokens_compared_at_low_load": low_tokens,
                "lossless_under_eviction": pressure,
                "lossless_under_eviction_hisparse": pressure_hisparse,
                "locality_sweep_paper_all_hbm": self.sweep(),
                "random_keys_paper_all_hbm": rand
                and {
                    **rand,
                    "locality_source": "random",
                    "hit_rate_per_layer": self.find("echo_paper", "random")["hit_rate_per_layer"],
                },
            },
            "per_layer_note": "ratios are of the measured L-layer steps (all layers identical, "
            "the step's fixed part small); estimate_61_layers scales the per-layer device time "
            "to DeepSeek-V3.2's 61 layers",
        }

    def lossless_check(self, engine: str) -> dict | None:
        """``engine``'s greedy outputs at the pressure batch against the plain pool's
        (noff_low, same batch and seeds), with its eviction count."""
        e = self.find(engine, f"b{self.pressure_batch}")
        n = self.find("noff_low", f"b{self.pressure_batch}")
        if not (e and n):
            return None
        return {
            "batch": e["batch"],
            "dev_cache": e["dev_cache"],
            "evictions_per_step": e["evictions_per_step"],
            "hit_rate_per_layer": e["hit_rate_per_layer"],
            "requests_compared": len(n["outputs"]),
            "min_tokens_per_request": self.min_compared,
            "tokens_compared": tokens_in_common(e["outputs"], n["outputs"]),
            "greedy_outputs_equal": outputs_agree(e["outputs"], n["outputs"], self.min_compared),
            "first_difference": first_difference(e["outputs"], n["outputs"]),
        }

    # ------------------------------------------------------------------ main
    def run(self) -> dict:
        p = self.plan
        log(f"device {self.device}, torch {torch.__version__}, layers {p.layers}, "
            f"prompts {p.ctx_min}-{p.ctx_max}, stable fraction {self.args.locality}")  # fmt: skip
        self.model, self.directions = build_worker(self.cfg, p.moe, p.dtype, self.device)
        if self.cuda:
            log(f"model built: {torch.cuda.memory_allocated() / 2**30:.1f} GiB on the GPU")
            with torch.inference_mode():
                self.check_moe()
        # The model of issue 14's Build item 2: bytes per layer per step at batch 1..64.
        self.components["bytes_table"] = bytes_table(list(range(1, 65)))
        self.record()
        if not self.args.skip_components:
            with torch.inference_mode():
                self.measure_components()
            self.record()
        for steps in self.schedule():
            self.run_block(steps)
            self.record()
        if not self.args.skip_fixed:
            try:
                with torch.inference_mode():
                    self.measure_fixed_part()
            except Exception as exc:
                msg = f"fixed part: {type(exc).__name__}: {exc}"
                log("ERROR " + msg)
                self.errors.append(msg)
        rec = self.record(final=True)
        log(
            "metrics: "
            + json.dumps({k: v for k, v in rec["metrics"].items() if k.startswith("ratio")})
        )
        return rec

    def check_moe(self) -> None:
        """The grouped-GEMM MoE against its dense reference on this device (bf16)."""
        moe = self.model.model.layers[0].mlp
        x = torch.randn(4, self.cfg.hidden_size, device=self.device, dtype=self.plan.dtype)
        ref = moe.reference(x)
        err = ((moe(x).float() - ref).norm() / ref.norm()).item()
        moe.touched.zero_()
        moe.forwards.zero_()
        self.components["moe_check_rel_err"] = err
        log(f"MoE grouped GEMM vs dense reference: rel err {err:.2e}")
        if not err < 2e-2:
            raise RuntimeError(f"MoE grouped GEMM disagrees with its reference ({err:.3e})")


def _hbm_copy_gbps(device: torch.device) -> float:
    """Device-to-device copy of 2 GiB, counting bytes read + written: the HBM ceiling."""
    src = torch.empty(1 << 31, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    copy_us = graph_us(lambda: dst.copy_(src), reps=5, chain=2)
    return 2 * src.numel() / copy_us / 1e3


def _attention_weights(attn, x: torch.Tensor) -> torch.Tensor:
    """The weight-reading GEMMs of one attention layer at batch b (no KV): q/kv
    projections, the absorbed W_UK / W_UV products, o_proj, the indexer's projections."""
    n = x.shape[0]
    q_resid = attn.q_a_layernorm(attn.q_a_proj(x))
    q = attn.q_b_proj(q_resid).view(n, attn.n_heads, attn.nope_dim + attn.rope_dim)
    latent = attn.kv_a_proj_with_mqa(x)[:, : attn.kv_lora_rank]
    w_uk, w_uv = attn._absorbed_weights()
    q_lat = torch.einsum("thd,hdr->thr", q[..., : attn.nope_dim], w_uk)
    out = torch.einsum("thr,hvr->thv", q_lat + latent.unsqueeze(1), w_uv)
    idx = attn.indexer
    extra = idx.wq_b(q_resid).sum() + idx.wk(x).sum() + idx.weights_proj(x).sum()
    return attn.o_proj(out.reshape(n, -1)) + extra


def _med(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def _ratio_range(echo: list[dict], noff: list[dict]) -> tuple[float, float, float]:
    """(median ratio, min, max) of device tokens/s, ECHO side over no-offload side. The
    min and max are over every cross pair, so they bound the ratio of the medians."""
    pairs = [e["tokens_per_s_device"] / n["tokens_per_s_device"] for e in echo for n in noff]
    mid = _med(echo, "tokens_per_s_device") / _med(noff, "tokens_per_s_device")
    return mid, min(pairs), max(pairs)


def _spread(values: list[float]) -> list[float] | None:
    if len(values) < 2:
        return None
    q = statistics.quantiles(values, n=10)
    return [round(q[0], 4), round(q[-1], 4)]


def _touched(moes: list[LocalRoutedMoE]) -> float | None:
    calls = sum(int(m.forwards) for m in moes)
    if not calls:
        return None
    return round(sum(int(m.touched) for m in moes) / calls, 3)


def _eviction_counter(kv) -> torch.Tensor | None:
    """The backend's per-layer eviction counts (None for the plain pool)."""
    if isinstance(kv, HiSparseKVCache):
        return kv.evictions
    cache = getattr(kv, "cache", None)
    return cache.evictions if cache is not None else None


def _leak_free(eng: Engine, kv, runner: StepRunner) -> bool:
    ok = runner.allocator.num_free == runner.allocator.capacity
    ok = ok and runner.table.num_free_rows == runner.max_requests
    if eng.backend == "echo":
        ok = ok and kv.cache.free_count.tolist() == [eng.dev_cache] * kv.num_layers
    if eng.backend == "hisparse":
        ok = ok and kv.free_slots() == [kv.max_requests * kv.buffer_size] * kv.num_layers
    return bool(ok)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default="benchmark/results")
    ap.add_argument("--smoke", action="store_true", help="tiny configuration on the CPU")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "fp8_e4m3"],
        help="KV rows as stored by every backend: auto = the model dtype (bf16 on the GPU); "
        "fp8_e4m3 = 656-byte rows (with --smoke the tiny latent becomes one 128-wide tile)",
    )
    ap.add_argument("--warmup", type=int, default=8, help="decode steps before measuring")
    ap.add_argument("--steps", type=int, default=32, help="measured decode steps")
    ap.add_argument("--profile-steps", type=int, default=3, help="profiled steps (0: none)")
    ap.add_argument("--locality", type=float, default=0.9, help="stable fraction of the top-k")
    ap.add_argument("--random-keys", action=argparse.BooleanOptionalAction, default=True,
                    help="also the random-keys run (the pessimistic bound)")  # fmt: skip
    ap.add_argument("--only", default="", help="comma-separated engine labels to run")
    ap.add_argument(
        "--fill-max",
        type=int,
        default=150,
        help="ECHO: at most this many extra warm-up steps until the cache evicts",
    )
    ap.add_argument("--locality-sweep", default="0.5,0.7",
                    help="extra stable fractions run at the paper's all-HBM setting")  # fmt: skip
    ap.add_argument("--skip-components", action="store_true")
    ap.add_argument(
        "--hisparse-buffer",
        type=int,
        default=0,
        help="the HiSparse-like backend's device_buffer_size per request and layer "
        f"(default {DEFAULT_DEVICE_BUFFER_SIZE}, HiSparse's)",
    )
    ap.add_argument("--deadline-s", type=float, default=0.0,
                    help="start no engine and no repeat after this many seconds (0: no limit)")  # fmt: skip
    ap.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="measurements of each ratio's phases, ECHO and its baseline interleaved "
        f"(A B A B); ratios use the medians (default {GPU_REPEATS}, smoke {SMOKE_REPEATS})",
    )
    ap.add_argument("--skip-fixed", action="store_true",
                    help="do not time the fixed part (the 61-layer estimate then leaves it out)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.repeats is None:
        args.repeats = SMOKE_REPEATS if args.smoke else GPU_REPEATS
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    if not args.smoke and 1 + args.warmup + args.steps < MIN_TOKENS_COMPARED:
        ap.error(
            f"the lossless checks compare at least {MIN_TOKENS_COMPARED} tokens per request: "
            f"--warmup + --steps must be at least {MIN_TOKENS_COMPARED - 1}"
        )
    if args.smoke:
        args.warmup, args.steps, args.profile_steps = min(args.warmup, 2), min(args.steps, 3), 0
        args.fill_max = min(args.fill_max, 20)
    return args


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    return Study(parse_args(argv), argv).run()


if __name__ == "__main__":
    main()
