"""Start-up sizing: every byte ECHO's plan puts on a GPU and in pinned host memory, and
whether it fits, decided while sglang resolves its arguments (before any weight loads),
and again, exactly, against the memory sglang measured before it builds its pools.

Why at resolution: sglang sizes its KV pools only after loading the weights (minutes on
DeepSeek-V3.2's full checkpoint), and HiSparse and ECHO allocate more after that. A plan that cannot fit
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
  [slots, context + 68], its top-k row table, ECHO's ring tables (each request's page
  rows and first ring position), and the per-request buffer tables that ECHO frees right
  away (counted: the caching allocator need not reuse their blocks).
- with the plugin's decode prefetch (``SGLANG_NSA_FUSE_LOGITS_RECALL_DECODE=1``), its
  staging buffer, host-id map and thresholds, also allocated by the coordinator.

On the host (``host_bytes``): HiSparse's pinned pool, ``(S x R + 64) x row x L`` per rank,
once per GPU of a node.

What there is, twice (``sizing_budget.py``): at argument resolution, ``Budget``, an estimate
before anything loads (sglang's static-fraction rule less an estimated start-up overhead
and the weights, from the checkpoint's index or config.json: ``sizing_weights.py``), and the host
pools of a node against sglang's host-memory rule; in each scheduler, ``MeasuredBudget``
(``guards.profile_guard``, an AFTER hook on ``KVCacheConfigurator._profile_available_bytes``,
before any pool is allocated), the bytes sglang's profile returned. Since sglang only limits
its own pools and ECHO's metadata comes later, the plan fits when all device totals fit the
budget. The scheduler's check is exact; the estimate only stops early what cannot fit.

A refusal names every total and the largest ``--max-total-tokens`` (at this N_G) and
``NSA_DEV_CACHE_SIZE`` (at this T) that fit, the smallest ``--mem-fraction-static`` that
fits, and, where the fraction is sglang's default, the largest
``--cuda-graph-max-bs-decode`` whose default fraction fits (``Graphs``: sglang's own rule,
probed by ``args_sizing.graph_fractions``).

Pure Python (no torch): ``sglang_echo.sglang.args_sizing`` gathers the inputs from sglang's
resolved view and, in the scheduler, from its KV cache configurator.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from sglang_echo.config import (
    default_stage_rows,
    dev_cache_for,
    eviction_reserve_in_force,
    max_running,
)
from sglang_echo.offload import footprint
from sglang_echo.sglang.sizing_budget import AnyBudget, Graphs
from sglang_echo.sglang.sizing_weights import SCALE_BLOCK, gib

PAGE = 64  # DSA's page size (sglang forces 64)
# req_to_token rows are context + 4 wide (get_req_to_token_extra_context_len without
# speculative decoding); req_to_host_pool adds one page.
REQ_EXTRA_CONTEXT = 4
# The plugin's decode prefetch stages in one chunk: sglang's logits come from one DeepGEMM
# launch (sglang/decode_prefetch.py builds its prefetcher with this; defined here, where
# sizing reads it without torch).
PLUGIN_STAGE_CHUNKS = 1
# --mem-fraction-static is suggested in thousandths (sglang rounds its own to 3 places).
FRACTION_STEP = 1000


def ceil_to(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


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
        if self.running is None:
            return max_running(self.dev_cache_size, self.top_k)  # the capacity rule
        return self.running

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
        return 1 <= self.per_rank_running <= max_running(self.dev_cache_size, self.top_k)


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
    """ECHO's device tensors besides the rows, as their owners count them
    (offload/footprint.py): the DeviceCache over N_H = host_slots - 2 host ids and N_G
    slots (its rows borrowed from sglang's pool), the rank's one AllocWorkspace (calls of
    up to N_G lanes), EchoManager's counters, and the ids the coordinator reserves.
    ``eviction_reserve``: SGLANG_ECHO_EVICTION_RESERVE, None for its default."""
    n = dev_cache_size
    reserve = eviction_reserve_in_force(n, eviction_reserve)
    return footprint.echo_metadata_bytes(layers, n, host_slots - 2, reserve) + reserved_id_bytes(n)


def reserved_id_bytes(dev_cache_size: int) -> int:
    """The coordinator's int64 ids (pool_layout.py): ECHO's N_G + 1 device rows, page-rounded
    (``reserve_device_rows``), and the logical page the host pool cannot serve
    (``match_logical_to_host``)."""
    return 8 * ceil_to(dev_cache_size + 1, PAGE) + 8 * PAGE


def decode_prefetch_bytes(request_slots: int, host_slots: int, row_bytes: int, layers: int) -> int:
    """The plugin's decode prefetch (sglang/decode_prefetch.py's DecodePrefetcher, made by
    the coordinator after sglang profiled memory), as the prefetcher counts itself: its
    staging at the default rows per request in PLUGIN_STAGE_CHUNKS chunks, its host-id map
    over the host pool (N_H + 2 = host slots) and each layer's thresholds."""
    return footprint.decode_prefetch_bytes(
        request_slots,
        host_slots - 2,
        row_bytes,
        layers,
        PLUGIN_STAGE_CHUNKS,
        default_stage_rows(row_bytes),
    )


def request_slots(sizes: EchoSizes, shape: RankShape) -> int:
    """sglang's request slots per rank: running + PD pre-allocation + the padding slot."""
    return sizes.per_rank_running + shape.extra_req_slots + 1


def request_table_bytes(sizes: EchoSizes, shape: RankShape) -> int:
    """HiSparse's tables (hisparse_coordinator.py), allocated after sglang profiled memory:
    req_to_host_pool int64 [slots, context + 4 + 64], top_k_device_locs_buffer int32
    [slots, top-k], ECHO's ring_rows int64 [slots, 64] and ring_start int64 [slots], and
    the per-request buffer tables
    ECHO frees at start-up (int64 [slots, B + 64], 2 x int32 [L, slots, B + 64], int16
    [L, slots, B], int32 [slots, top-k], int16 [B]; B = ceil64(top-k))."""
    slots = request_slots(sizes, shape)
    top_k, buf = sizes.top_k, ceil_to(sizes.top_k, PAGE)
    kept = slots * (
        8 * (shape.context_len + REQ_EXTRA_CONTEXT + PAGE) + 4 * top_k + 8 * PAGE + 8  # rings
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


@dataclass(frozen=True)
class Sizing:
    """The plan's totals against the budget, and, when it does not fit, the largest
    --max-total-tokens (at this N_G) and NSA_DEV_CACHE_SIZE (at this T), the smallest
    --mem-fraction-static and the largest --cuda-graph-max-bs-decode that do."""

    sizes: EchoSizes
    shape: RankShape
    budget: AnyBudget
    device: DeviceBytes
    host: HostBytes
    largest_host_tokens: int | None = None
    largest_dev_cache: int | None = None
    smallest_fraction: float | None = None
    graphs: Graphs | None = None
    largest_graph_bs: int | None = None

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
        fit = "<=" if self.fits_device else ">"
        lines = [
            f"per GPU: N_G {s.dev_cache_size}, T {s.host_tokens}, {s.per_rank_running} "
            f"running -> S = {s.device_rows} device rows, R = {s.ratio}",
            *self.device.lines(s, shape),
            f"GPU total {gib(self.device.total)} {fit} KV budget {gib(b.kv_bytes)} = {b.formula()}",
            *b.detail_lines(),
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

    def options(self) -> list[str]:
        """The changes that make the plan fit, each at its largest (or smallest) value."""
        s, b = self.sizes, self.budget
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
        if self.fits_device:
            return [by_t, by_n, "free host memory"]
        now = b.mem_fraction_static
        if self.smallest_fraction is None:
            by_f = "no --mem-fraction-static below 1 fits"
        else:
            f = self.smallest_fraction
            by_f = (
                f"--mem-fraction-static {f} (the smallest that fits; sglang's activations "
                f"and CUDA graphs then keep {gib(b.runtime_reserve(f))}, "
                f"{gib(b.runtime_reserve(now))} at {now})"
            )
        found = [by_t, by_n, by_f]
        g = self.graphs
        if g is not None and self.largest_graph_bs is None:
            found.append(
                f"no --cuda-graph-max-bs-decode fits (sglang's default "
                f"--mem-fraction-static is {g.fraction_at(1)} even at 1)"
            )
        elif g is not None:
            bs = self.largest_graph_bs
            found.append(
                f"--cuda-graph-max-bs-decode {bs} (sglang's default --mem-fraction-static "
                f"is then {g.fraction_at(bs)}, {now} at {g.max_bs})"
            )
        return [*found, "spread the weights over more GPUs"]

    def message(self) -> str:
        """Why the plan does not fit, every total, and the values that do."""
        where = []
        if not self.fits_device:
            where.append(
                f"{self.budget.gpu_name()} ({gib(self.device.total)} > {gib(self.budget.kv_bytes)})"
            )
        if not self.fits_host:
            where.append(
                f"the host ({gib(self.host.per_node)} > {gib(self.budget.host_limit or 0)})"
            )
        first, *rest = self.options()
        ways = "".join(f";\n      or {option}" for option in rest)
        note = self.budget.note() if not self.fits_device else None
        head = (
            self.budget.empty_message()
            if self.budget.kv_bytes <= 0
            else f"ECHO's pools do not fit {' and '.join(where)}:"
        )
        return f"{head}\n{self.summary()}\n    largest that fit: {first}{ways}." + (
            f"\n    ({note})" if note else ""
        )


def totals(sizes: EchoSizes, shape: RankShape, budget: AnyBudget) -> Sizing:
    """The plan's totals against the budget (no search)."""
    return Sizing(
        sizes=sizes,
        shape=shape,
        budget=budget,
        device=device_bytes(sizes, shape),
        host=host_bytes(sizes, shape, budget.ranks_per_node),
    )


def fits(sizes: EchoSizes, shape: RankShape, budget: AnyBudget) -> bool:
    return sizes.valid() and totals(sizes, shape, budget).fits


def largest_host_tokens(sizes: EchoSizes, shape: RankShape, budget: AnyBudget) -> int | None:
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


def largest_dev_cache(sizes: EchoSizes, shape: RankShape, budget: AnyBudget) -> int | None:
    """The largest N_G <= the plan's that fits at this T.

    The totals are not monotone in N_G (S x R, the host pool, can shrink when S grows),
    but S is constant between consecutive multiples of 64 and of top-k (where the default
    running count changes), and there only the metadata grows with N_G. So: walk those
    intervals from the top; in the first one whose bottom fits, binary-search the top."""
    lowest = dev_cache_for(sizes.running or 1, sizes.top_k)
    top = sizes.dev_cache_size
    while top >= lowest:
        # S is constant on [bottom, top]: N // 64 (so ceil64(N + 1)) and, by default, the
        # running count N // top-k do not change there.
        bottom = max(lowest, top // PAGE * PAGE)
        if sizes.running is None:
            bottom = max(bottom, dev_cache_for(max_running(top, sizes.top_k), sizes.top_k))
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


def smallest_fraction(device_total: int, budget: AnyBudget) -> float | None:
    """The smallest --mem-fraction-static (in thousandths, below 1) whose budget holds
    ``device_total`` (the budget grows with the fraction: binary search)."""
    low, high = 0, FRACTION_STEP - 1  # not fits(low / STEP) unless the plan is empty

    def holds(step: int) -> bool:
        return device_total <= budget.at_fraction(step / FRACTION_STEP).kv_bytes

    if not holds(high):
        return None
    while high - low > 1:  # holds(high), not holds(low)
        mid = (low + high) // 2
        if holds(mid):
            high = mid
        else:
            low = mid
    return high / FRACTION_STEP


def largest_graph_bs(device_total: int, budget: AnyBudget, graphs: Graphs) -> int | None:
    """The largest --cuda-graph-max-bs-decode below the launch's whose sglang-default
    fraction holds ``device_total`` (fewer captured batches reserve less: the default
    fraction does not fall as the batch shrinks; binary search)."""

    def holds(bs: int) -> bool:
        return device_total <= budget.at_fraction(graphs.fraction_at(bs)).kv_bytes

    low, high = 1, graphs.max_bs  # not holds(high): the launch's own does not fit
    if high <= low or not holds(low):
        return None
    while high - low > 1:  # holds(low), not holds(high)
        mid = (low + high) // 2
        if holds(mid):
            low = mid
        else:
            high = mid
    return low


def check(
    sizes: EchoSizes, shape: RankShape, budget: AnyBudget, graphs: Graphs | None = None
) -> Sizing:
    """The plan's totals, with the values that fit when it does not (``graphs``: sglang's
    default fraction by decode graph batch, when the fraction is its default)."""
    result = totals(sizes, shape, budget)
    if result.fits:
        return result
    result = replace(
        result,
        largest_host_tokens=largest_host_tokens(sizes, shape, budget),
        largest_dev_cache=largest_dev_cache(sizes, shape, budget),
    )
    if result.fits_device:
        return result
    total = result.device.total
    return replace(
        result,
        smallest_fraction=smallest_fraction(total, budget),
        graphs=graphs,
        largest_graph_bs=None if graphs is None else largest_graph_bs(total, budget, graphs),
    )
