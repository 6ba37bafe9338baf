"""What the study runs, derived from its args alone: the sizes of the run (``Plan``: the
GPU study or its CPU miniature), the bytes that size the equal-HBM engines, the engines
with their phases (``StudyPlan.engines``) and their order (``StudyPlan.schedule``: each
ratio's two sides interleaved, repeat by repeat). Nothing here touches a device, so the
schedule and the skipped engines can be checked on any host."""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, field, replace

import torch

from benchmark.e2e.lossless import min_tokens_compared
from benchmark.study.locality import Locality
from benchmark.study.worker import DSV32_DIMS, DSV32_MOE, SMOKE_DIMS, SMOKE_MOE, study_config
from sglang_echo.config import DEFAULT_DECODE_PREFETCH, DEFAULT_RESOLVE_OVERLAP_FROM
from sglang_echo.offload.hisparse_cache import DEFAULT_DEVICE_BUFFER_SIZE

# Per-token bytes of ECHO state per layer besides the MLA rows: device_to_host (int32),
# priority (int64) and the free stack (int32) per slot; host_to_device (int32) per host
# token (offload/device_cache.py).
SLOT_META_BYTES = 4 + 8 + 4
HOST_META_BYTES = 4
PRESSURE_SPARE = 8  # the pressure checks' spare rows: top-k / this (per request: HiSparse)
# The decode prefetch's A/B (--decode-prefetch): ECHO at the paper's setting under the
# prefetch's rule (auto, the default) against the same ECHO without the prefetch.
PREFETCH_ON = "echo_paper"
PREFETCH_OFF = "echo_noprefetch"


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
    # Run beside its partners' phase of the same label and repeat, their timed steps
    # alternating (measure.run_joint): the low-load cost is a few percent, less than the
    # drift between two phases run one after the other.
    paired: bool = False


def _nth(phase: Phase, r: int) -> Phase:
    """The r-th measurement of ``phase``: profiled only the first time (the profiler slows
    the steps and its breakdown needs one run)."""
    return replace(phase, repeat=r, profile=phase.profile and r == 0)


def tag(phase: Phase) -> str:
    """The phase's label in logs, errors and ``config.order``: "#r" marks the r-th repeat."""
    return phase.label + (f"#{phase.repeat}" if phase.repeat else "")


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
    # ECHO: decode tokens placed in free slots as written, and the decode resolve beside
    # the query's up-projection from this batch up (the defaults; False and 0: the
    # per-layer step before them).
    decode_place: bool = True
    resolve_overlap: int = DEFAULT_RESOLVE_OVERLAP_FROM
    # ECHO: SGLANG_NSA_FUSE_LOGITS_RECALL_DECODE ("0", "1" or "auto"): the product's
    # default unless an engine is an A/B's other side.
    fuse_decode: str = DEFAULT_DECODE_PREFETCH


class StudyPlan:
    """The run's sizes (``plan``), model config (``cfg``) and derived numbers, the engines
    it runs and their order, from the args alone. Engines the plan cannot build land in
    ``skipped`` with their reason (a skip, not an error)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.plan = smoke_plan() if args.smoke else gpu_plan(args.layers)
        self.plan.kv_cache_dtype = args.kv_cache_dtype
        if args.smoke and args.kv_cache_dtype == "fp8_e4m3":  # fp8 tiles are 128 wide
            self.plan.dims = {**self.plan.dims, "kv_lora_rank": 128}
        self.max_new = args.warmup + args.fill_max + args.steps + args.profile_steps + 2
        # Tokens each compared request must have (parse_args holds the GPU study to 32).
        self.min_compared = min_tokens_compared(args.warmup, args.steps)
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
        self.skipped: list[str] = []  # engines the plan cannot build, and why

    def engines(self) -> list[Engine]:
        p, a = self.plan, self.args
        loc = Locality(a.locality)
        rand = Locality(0.0)
        full = [Phase("full", None, loc, profile=a.profile_steps > 0, fill=True)]
        # No pressure: no fill. The smallest batch is profiled too, so the record says
        # where ECHO's cost without pressure goes (breakdown_low_load).
        low = [
            Phase(
                f"b{b}",
                b,
                loc,
                profile=a.profile_steps > 0 and b == min(p.low_load_batches),
                paired=True,
            )
            for b in p.low_load_batches
        ]
        sweep = [
            Phase(f"p{x:g}", None, Locality(x), fill=True, repeated=False)
            for x in (float(v) for v in a.locality_sweep.split(",") if v)
        ]
        # Once, as a bound; repeated where it is a ratio's input (the prefetch's A/B).
        random_phase = Phase("random", None, rand, fill=True, repeated=a.decode_prefetch)
        out = [
            Engine("noff_paper", "no-offload", pool=p.paper_pool, phases=list(full)),
            Engine(
                PREFETCH_ON,
                "echo",
                dev_cache=p.paper_dev_cache,
                host=p.host_pool,
                phases=[*full, *([random_phase] if a.random_keys else []), *sweep, *low],
                partners=[
                    "noff_paper",
                    "noff_low",
                    "echo_inline",
                    *([PREFETCH_OFF] if a.decode_prefetch else []),
                ],
                # The A/B's prefetching side: auto whatever the default (then the default).
                fuse_decode="auto" if a.decode_prefetch else DEFAULT_DECODE_PREFETCH,
            ),
            Engine(
                "noff_low",
                "no-offload",
                pool=max(p.low_load_batches) * (p.ctx_max + self.max_new),
                phases=low,
            ),
            # The A/B of the per-layer step's two defaults at low load: ECHO with decode
            # tokens written to the host only and the resolve in line, alternated step by
            # step with echo_paper and noff_low (no profile: its first repeat is timed too).
            Engine(
                "echo_inline",
                "echo",
                dev_cache=p.paper_dev_cache,
                host=max(p.low_load_batches) * (p.ctx_max + self.max_new),
                phases=[replace(ph, profile=False) for ph in low],
                decode_place=False,
                resolve_overlap=0,
            ),
        ]
        if a.decode_prefetch:
            # The decode prefetch's A/B: echo_paper (auto, the default) beside ECHO without
            # it, phase by phase: the paper's setting and the random-keys run.
            out.append(
                Engine(
                    PREFETCH_OFF,
                    "echo",
                    dev_cache=p.paper_dev_cache,
                    host=p.host_pool,
                    phases=[*full, *([random_phase] if a.random_keys else [])],
                    fuse_decode="0",
                )
            )
        # Lossless at scale: the batch no-offload holds in the paper's pool, under a device
        # cache of the batch's selections plus an eighth of a top-k, fewer spare slots than
        # a step's new selections at this locality, so every step evicts (a decode step's
        # new tokens take free slots only, never evict: the selections fill the cache);
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
