"""Per-layer cost of ECHO's cache management in one decode step, graph-replayed.

The step is what a layer does every decode step: write the batch's new tokens (index keys
on the device, rows to the host pool), then resolve the exact top-k of every request (look
up, protect, evict, allocate, map, recall). Beside it, the step as it was before the new
tokens left the append's allocation (append + resolve), and the launches chained or not
(kernels/pdl.py, SGLANG_ECHO_PDL) at batch 1 and 4 too.
Selections come from a synthetic trace with a set per-step reuse (hit rate), each request
drawing from its own context. One graph holds ``--group`` consecutive layer-steps (as a
model's decode graph holds one per layer) and a replay's time is divided by them: a lone
layer-step per replay would count the graph launch's own fixed cost, which a decode step
pays once for all its layers (``graph_replay_floor_us`` times it, with one no-op kernel,
and ``launch_floor_us`` a chain of such kernels per layer-step: the floor of the launches). Measured: the Triton cache kernels (management alone, the
target's scope: <= 4 us per layer-step; and with the recall), the torch reference, the
sort exact LRU would need, and the hit rates of the victim policies on one trace. Small
batches time the one-program path against the launches past it ("pipeline" in
``one_program_study``: the look-back resolve since 2026-12-03). Targets: <= 8 us per
layer-step at batch 48, <= 4 us at batch 1 with nothing to evict. (Earlier records also
time the five-launch pipeline's resolve, ordered atomics, the look-back's launch shapes
and the one program's widths: choices made since, docs/ARCHITECTURE.md section 4.)

    python benchmark/kernels/cache_ops_bench.py --out benchmark/results
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import event_us, pyplot, save_record, time_us
from victim_policies import policy_hit_rates

from sglang_echo.config import EchoConfig
from sglang_echo.kernels.alloc import STAGES, AllocWorkspace, allocate_kernel
from sglang_echo.kernels.alloc_common import ONE_PROGRAM_LANES
from sglang_echo.kernels.alloc_lookback import STAGES as LOOKBACK_STAGES
from sglang_echo.kernels.pdl import pdl_prologue, use_pdl
from sglang_echo.offload.echo_cache import EchoKVCache


def make_trace(
    steps: int, batch: int, topk: int, context: int, reuse: float, seed: int = 0
) -> torch.Tensor:
    """[steps, batch, topk] host ids; request r owns ids r*context+1 .. (r+1)*context."""
    g = torch.Generator().manual_seed(seed)
    base = torch.arange(batch).view(batch, 1) * context + 1
    current = torch.stack([torch.randperm(context, generator=g)[:topk] for _ in range(batch)])
    out = []
    for _ in range(steps):
        out.append(current + base)
        nxt = current.clone()
        for r in range(batch):
            replace = torch.rand(topk, generator=g) > reuse
            pool = torch.ones(context, dtype=torch.bool)
            pool[current[r]] = False
            candidates = pool.nonzero().squeeze(1)
            pick = candidates[torch.randperm(candidates.numel(), generator=g)[: int(replace.sum())]]
            nxt[r, replace] = pick
        current = nxt
    return torch.stack(out)


def _host_tokens(args) -> int:
    """Trace ids, then the new tokens of every step, then the filler (see _fill)."""
    return args.batch * args.context + args.batch * (args.steps + 8) + args.slots + 1


def _fill(cache: EchoKVCache, args, dev: torch.device) -> None:
    """Occupy every device slot with filler tokens (ids past the trace's), as in a server's
    steady state: from the first step on, each miss needs a victim."""
    first = args.batch * args.context + args.batch * (args.steps + 8) + 1
    chunk = 8192
    rows = torch.zeros(chunk, 576, device=dev, dtype=torch.bfloat16)
    keys = torch.zeros(chunk, 128, device=dev, dtype=torch.bfloat16)
    for start in range(0, args.slots, chunk):
        n = min(chunk, args.slots - start)
        locs = torch.arange(first + start, first + start + n, device=dev)
        cache.write(0, locs, rows[:n], keys[:n])


def _cache(
    args, dev: torch.device, host_tokens: int, use_kernels: bool, shape: dict | None = None
) -> EchoKVCache:
    config = EchoConfig(
        offload=True, dev_cache_size=args.slots, eviction_reserve=args.eviction_reserve
    )
    cache = EchoKVCache(config, 1, host_tokens, 576, 128, torch.bfloat16, dev)
    cache.manager.use_kernels = use_kernels and cache.manager.host_view is not None
    if shape:
        # pdl: the shape's, else the manager's (SGLANG_ECHO_PDL); the recall follows it.
        pdl = shape.get("pdl", cache.manager.pdl)
        cache.manager.pdl = pdl
        ws = AllocWorkspace(cache.cache, cache.cache.num_slots, pdl=pdl)
        for name, value in shape.items():  # the one program's bound (one_program_lanes)
            if name != "pdl":
                setattr(ws, name, value)
        cache.manager._workspace = ws
    return cache


STATE = ("host_to_device", "device_to_host", "priority", "free_stack", "free_count", "clock")


def shape_is_exact(args, dev: torch.device, trace: torch.Tensor, shape: dict, steps: int) -> bool:
    """Correct first: ``steps`` resolves with the kernels at ``shape`` leave the state the
    torch reference leaves (on a full cache, so victims are chosen)."""
    states = []
    for use_kernels in (True, False):
        cache = _cache(args, dev, _host_tokens(args), use_kernels, shape if use_kernels else None)
        _fill(cache, args, dev)
        for t in range(steps):
            cache.resolve(0, trace[t])
        states.append([getattr(cache.cache, name)[0].clone() for name in STATE])
    return all(torch.equal(a, b) for a, b in zip(*states, strict=True))


def measure(
    args,
    dev: torch.device,
    trace: torch.Tensor,
    use_kernels: bool,
    part: str,
    shape: dict | None = None,
    fill: bool = True,
    group: int | None = None,
    distinct: bool = True,
) -> dict:
    """Median time per layer-step of ``part``, graph-replayed, and the trace's hit rate:
    "management", the two allocations only (append, resolve); "step", append + resolve
    with the recall; "resolve" and "decode_step", the same without the append's allocation
    (a decode step's new tokens take free slots in the launch that writes their host rows,
    kernels/decode_write.py, or stay host-only and are recalled when selected: no
    allocation pass either way).
    ``shape``: the kernels' launches (pdl: chained or not; one_program_lanes: the one
    program's bound) instead of the default. ``fill=False``: the cache starts
    empty, so below its capacity nothing is evicted (the no-pressure path). ``group``:
    layer-steps per graph replay (default ``--group``; 1 is the records' old definition,
    which counts a graph launch per layer-step). ``distinct``: the resolve is told no id
    repeats, as the runtime's decode tells it (model/attention.py: requests share no
    location); off for a trace whose requests select the same ids."""
    cache = _cache(args, dev, _host_tokens(args), use_kernels, shape)
    if fill:
        _fill(cache, args, dev)
    m = cache.manager
    group = args.group if group is None else group
    sels = [torch.empty_like(trace[0]) for _ in range(group)]
    new_locs = [torch.empty(args.batch, dtype=torch.int64, device=dev) for _ in range(group)]
    new_rows = torch.randn(args.batch, 576, device=dev, dtype=torch.bfloat16)
    keys = torch.randn(args.batch, 128, device=dev, dtype=torch.bfloat16)
    next_loc = args.batch * args.context + 1

    def step(i: int) -> None:
        sel, locs = sels[i], new_locs[i]
        if part == "management":
            m._allocate(0, locs, append=True)
            m._allocate_selection(0, sel, distinct)
        elif part == "resolve":
            m._allocate_selection(0, sel, distinct)
        else:
            cache.write(0, locs, new_rows, keys, decode=part == "decode_step")
            cache.resolve(0, sel, distinct)

    def load(i: int, t: int) -> None:
        nonlocal next_loc
        sels[i].copy_(trace[t])
        new_locs[i].copy_(torch.arange(next_loc, next_loc + args.batch, device=dev))
        next_loc += args.batch

    warm = args.warmup_steps  # eager warm-up: fills the cache, reaches steady state
    for t in range(warm):
        load(0, t)
        step(0)
    c = cache.cache
    hits0, misses0 = c.hits.sum().item(), c.misses.sum().item()
    evicted0 = (c.evictions.sum() + c.append_evictions.sum()).item()
    on_gpu = dev.type == "cuda"
    if on_gpu:
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(group):
                step(i)
    times = []
    timed = 0
    for t0 in range(warm, trace.shape[0] - group + 1, group):
        for i in range(group):
            load(i, t0 + i)
        timed += group
        if not on_gpu:
            start_s = time.perf_counter()
            for i in range(group):
                step(i)
            times.append((time.perf_counter() - start_s) * 1e6 / group)
            continue
        times.append(event_us(graph.replay) / group)
    if not times:
        raise ValueError(f"the trace has no {group} steps past the {warm} warm-up steps")
    hits, misses = c.hits.sum().item() - hits0, c.misses.sum().item() - misses0
    return {
        "us": statistics.median(times),
        "us_min": min(times),
        "layer_steps_per_replay": group,
        "replays": len(times),
        "hit_rate": hits / max(1, hits + misses),
        "evictions_per_step": ((c.evictions.sum() + c.append_evictions.sum()).item() - evicted0)
        / max(1, timed),
    }


@triton.jit
def _noop_kernel(counter_ptr, PDL: tl.constexpr):
    """The least a dependent launch can do: wait for its predecessor, bump a counter."""
    pdl_prologue(PDL)
    tl.store(counter_ptr, tl.load(counter_ptr) + 1)


def launch_floor(args, dev: torch.device, launches: int, group: int) -> float:
    """Median us per layer-step of ``launches`` chained no-op launches (the allocation's
    launch chain with no work), ``group`` layer-steps per graph replay: what no pipeline of
    that many dependent launches can beat. group=1, launches=1: a graph replay's own fixed
    cost under this timing."""
    pdl = use_pdl(dev)
    counter = torch.zeros(1, dtype=torch.int64, device=dev)
    for _ in range(3):  # compile, warm up
        _noop_kernel[(1,)](counter, PDL=pdl, launch_pdl=pdl)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(group * launches):
            _noop_kernel[(1,)](counter, PDL=pdl, launch_pdl=pdl)
    times = [event_us(graph.replay) / group for _ in range(max(20, args.replays))]
    return statistics.median(times[2:])


# Launches timed beside the default (kernels/pdl.py): chained (the default) and unchained
# (SGLANG_ECHO_PDL=0); the atomics relaxed in both. The recall follows the variant's pdl
# too (the manager's, which SGLANG_ECHO_PDL sets in a server).
CHAINING_VARIANTS = {"unchained_relaxed": False, "chained_relaxed": True}


def chaining_study(args, dev: torch.device) -> dict:
    """us per layer-step (management alone, and with the recall) of each launch variant, at
    the bench's batch on a full cache and at batches 1 and 4 with nothing evicted (the
    study's low-load case, where the launches' fixed cost is all there is); for the default
    launch also the decode step as the model runs it (no append allocation). Each variant
    is first checked against the reference on the full cache."""
    out: dict = {}
    for name, pdl in CHAINING_VARIANTS.items():
        shape = {"pdl": pdl}
        trace = make_trace(args.steps, args.batch, args.topk, args.context, args.reuse)
        row: dict = {"exact": shape_is_exact(args, dev, trace.to(dev), shape, steps=4)}
        settings = [(args.batch, True), (1, False), (4, False)]
        for batch, fill in settings:
            a = argparse.Namespace(**{**vars(args), "batch": batch})
            tr = make_trace(a.steps, batch, a.topk, a.context, a.reuse).to(dev)
            key = f"batch_{batch}_{'full' if fill else 'no_pressure'}"
            parts = ["management", "step"]
            if name == "chained_relaxed":  # the default launch: also the decode path
                parts += ["resolve", "decode_step"]
            for part in parts:
                timed = measure(a, dev, tr, True, part, shape, fill)
                row[f"{key}_{part}_us"] = timed["us"]
            row[f"{key}_evictions_per_step"] = timed["evictions_per_step"]
        out[name] = row
        print(f"{name}: {row}")
    return out


# Small batches: the one-program kernel against the launches past it (the workspace's
# one_program_lanes; resolves there take the look-back launches), the resolve's management
# alone, on an empty cache (nothing evicted: the low-load case), on a full one (steady
# state: an eviction every few steps) and with every selection resident (look-ups only).
ONE_PROGRAM_BATCHES = (1, 2, 4, 8)
# The paths compared: the launches past the one program and the one program.
ONE_PROGRAM_VARIANTS = {
    "pipeline": {"one_program_lanes": 0},
    "one_program": {"one_program_lanes": 1 << 30},
}


def one_program_study(args, dev: torch.device) -> dict:
    """us per layer-step of both paths at each small batch; each checked against the
    reference on a full cache first (the one-program path must be exact to be timed)."""
    out: dict = {}
    for batch in ONE_PROGRAM_BATCHES:
        a = argparse.Namespace(**{**vars(args), "batch": batch})
        tr = make_trace(a.steps, batch, a.topk, a.context, a.reuse).to(dev)
        # Every selection resident (a decode node's placed prompts at low load): look-ups.
        resident = argparse.Namespace(**{**vars(a), "reuse": 1.0})
        resident_tr = make_trace(a.steps, batch, a.topk, a.context, 1.0).to(dev)
        row: dict = {"lanes": batch * a.topk}
        for name, shape in ONE_PROGRAM_VARIANTS.items():
            row[f"{name}_exact"] = shape_is_exact(a, dev, tr, shape, steps=4)
            for fill in (False, True):
                key = f"{name}_{'full' if fill else 'no_pressure'}"
                timed = measure(a, dev, tr, True, "resolve", shape, fill)
                row[f"{key}_us"] = timed["us"]
                row[f"{key}_evictions_per_step"] = timed["evictions_per_step"]
            timed = measure(resident, dev, resident_tr, True, "resolve", shape, False)
            row[f"{name}_resident_us"] = timed["us"]
            row[f"{name}_resident_hit_rate"] = timed["hit_rate"]
        out[f"batch_{batch}"] = row
        print(f"one-program study, batch {batch}: {row}")
    return out


def stage_breakdown(args, dev: torch.device, trace: torch.Tensor) -> dict[str, float]:
    """Median device time of each resolve kernel (the default path's: the look-back
    resolve's alloc_lookback.STAGES). The launches are queued behind a sleep kernel so the
    events measure the kernels, not launch gaps."""
    cache = _cache(args, dev, _host_tokens(args), True)
    _fill(cache, args, dev)
    m = cache.manager
    m._workspace = AllocWorkspace(m.cache, m.cache.num_slots, pdl=m.pdl)
    new_rows = torch.randn(args.batch, 576, device=dev, dtype=torch.bfloat16)
    keys = torch.randn(args.batch, 128, device=dev, dtype=torch.bfloat16)
    next_loc = args.batch * args.context + 1
    names = LOOKBACK_STAGES
    per_stage: dict[str, list[float]] = {name: [] for name in names}
    for t in range(trace.shape[0]):
        new_locs = torch.arange(next_loc, next_loc + args.batch, device=dev)
        next_loc += args.batch
        cache.write(0, new_locs, new_rows, keys)
        if t < args.warmup_steps:
            cache.resolve(0, trace[t])
            continue
        torch.cuda.synchronize()
        torch.cuda._sleep(5_000_000)
        events: list = []
        alloc = allocate_kernel(m.cache, 0, trace[t].reshape(-1), False, m._workspace, events)
        m._recall(0, alloc)
        torch.cuda.synchronize()
        for name, a, b in zip(names, events[:-1], events[1:], strict=True):
            per_stage[name].append(a.elapsed_time(b) * 1000)
    return {name: statistics.median(v) for name, v in per_stage.items()}


def profile(args, dev: torch.device, trace: torch.Tensor) -> None:
    """One graph replay of ``--group`` resolves (the look-back launches) under the
    profiler, after the warm-up: each kernel's start (offset from the first) and duration,
    us. With chained launches a kernel starts once every program of the one before
    it has started, and waits for it to finish: the starts show where a step's time goes."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for path in ("look-back",):
        cache = _cache(args, dev, _host_tokens(args), True)
        _fill(cache, args, dev)
        m = cache.manager
        sels = [torch.empty_like(trace[0]) for _ in range(args.group)]
        for t in range(args.warmup_steps):
            sels[0].copy_(trace[t])
            m._allocate_selection(0, sels[0])
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for sel in sels:
                m._allocate_selection(0, sel)
        for first in (args.warmup_steps, args.warmup_steps + args.group):  # the 2nd profiled
            for i, sel in enumerate(sels):
                sel.copy_(trace[first + i])
            if first == args.warmup_steps:
                graph.replay()
        evicted = cache.cache.evictions.sum().item()
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            graph.replay()
            torch.cuda.synchronize()
        evicted = cache.cache.evictions.sum().item() - evicted
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        kernels.sort(key=lambda e: e.time_range.start)
        if not kernels:  # under Nsight Compute (stage cache_profile) it holds CUPTI
            print(f"profile {path}: no kernel events (another profiler holds CUPTI)")
            continue
        t0 = kernels[0].time_range.start
        span = max(e.time_range.end for e in kernels) - t0
        print(f"profile {path}: {args.group} resolves, {evicted} evictions, span {span:.1f} us")
        for e in kernels:
            print(
                f"  {e.time_range.start - t0:8.1f} {e.time_range.elapsed_us():7.1f}  {e.name[:60]}"
            )


def sort_us(slots: int, dev: torch.device) -> float | None:
    """What exact LRU would pay every step: one stable sort of every slot's last use."""
    if dev.type != "cuda":
        return None
    prio = torch.randint(0, 1000, (slots + 2,), device=dev, dtype=torch.int64)
    return time_us(lambda: torch.sort(prio, stable=True), warmup=5, reps=50)


def plot(record_path: Path) -> Path:
    """Bar chart of the record's per-layer-step times beside the JSON."""
    plt = pyplot()
    if plt is None:
        raise ImportError("matplotlib is missing")
    m = json.loads(record_path.read_text())["metrics"]
    bars = {
        "kernels:\nmanagement": m["us_per_layer_step"],
        "kernels:\n+ recall": m["us_per_layer_step_with_recall"],
        "torch ref:\nmanagement": m["torch_reference_us_per_layer_step"],
        "torch ref:\n+ recall": m["torch_reference_us_with_recall"],
    }
    if m.get("exact_lru_sort_us"):
        bars["one sort of\nall priorities"] = m["exact_lru_sort_us"]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(list(bars), list(bars.values()), color="tab:blue")
    ax.axhline(m["target_us"], color="tab:red", linestyle="--", label=f"target {m['target_us']} us")
    ax.set_yscale("log")
    ax.set_ylabel("us per layer-step (median, graph replay)")
    ax.set_title(
        f"ECHO cache management, batch {m['batch']} x top-k {m['topk']}, {m['slots']} slots, "
        f"hit rate {m['hit_rate']:.3f}",
        fontsize=9,
    )
    ax.legend()
    fig.tight_layout()
    out = record_path.with_suffix(".png")
    fig.savefig(out, dpi=120)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmark/results")
    p.add_argument("--batch", type=int, default=48)
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--slots", type=int, default=260_000)
    p.add_argument("--context", type=int, default=16_384)
    p.add_argument("--reuse", type=float, default=0.97)
    p.add_argument(
        "--eviction-reserve",
        type=int,
        default=None,
        help="extra victims per evicting step (SGLANG_ECHO_EVICTION_RESERVE; 0: none; "
        "default: the product's, N_G / 32 up to 8192)",
    )
    p.add_argument(
        "--warmup-steps", type=int, default=20, help="eager steps before timing (steady state)"
    )
    p.add_argument("--replays", type=int, default=10, help="timed graph replays per figure")
    p.add_argument(
        "--group",
        type=int,
        default=8,
        help="layer-steps per graph replay (a decode graph holds one per layer); the record "
        "also keeps the headline figures at 1, the old definition",
    )
    p.add_argument(
        "--policy-slots",
        type=int,
        default=0,
        help="cache slots of the victim-policy study (default 1.25 x batch x top-k)",
    )
    p.add_argument(
        "--policy-trace",
        default=None,
        help="npz with a [steps, batch, topk] 'selections' array (e.g. a trained model's "
        "layer trace) for the victim-policy study; default: the synthetic trace",
    )
    p.add_argument(
        "--device", default="cuda", help="cuda (timed, graph-replayed) or cpu (smoke run)"
    )
    p.add_argument("--plot-only", default=None, help="redraw the PNG of this JSON and exit")
    p.add_argument(
        "--profile",
        action="store_true",
        help="print the kernels of one graph replay (look-back resolves) under the profiler "
        "instead of timing; writes no record (CUDA only)",
    )
    args = p.parse_args()
    if args.plot_only:
        print(plot(Path(args.plot_only)))
        return
    if min(args.warmup_steps, args.replays - 1, args.group - 1) < 0:
        p.error("--warmup-steps must be >= 0, --replays and --group >= 1")
    args.steps = args.warmup_steps + args.replays * args.group  # the traces' length
    dev = torch.device(args.device)
    trace = make_trace(args.steps, args.batch, args.topk, args.context, args.reuse).to(dev)
    if args.profile:
        if dev.type != "cuda":
            p.error("--profile needs CUDA (graph replays)")
        profile(args, dev, trace)
        return
    on_gpu = dev.type == "cuda"
    paired = trace.clone()
    paired[:, 1::2] = trace[:, 0::2][:, : paired[:, 1::2].shape[1]]
    runs = {
        # A decode layer-step as the model runs it: the resolve's allocation only (the new
        # tokens go to the host pool; kvcache write(decode=True)), then with the writes and
        # the recall; before it, the append's allocation as well (prefill still appends).
        "kernels_decode_management": measure(args, dev, trace, on_gpu, "resolve"),
        "kernels_decode_step": measure(args, dev, trace, on_gpu, "decode_step"),
        "kernels_management": measure(args, dev, trace, on_gpu, "management"),
        "kernels_step": measure(args, dev, trace, on_gpu, "step"),
        # Requests in pairs selecting the same ids (a shared prefix, at its worst: every id
        # of a step twice): from the first repeat on, the look-back tiles wait twice.
        "kernels_decode_management_repeats": measure(
            args, dev, paired, on_gpu, "resolve", distinct=False
        ),
        "torch_management": measure(args, dev, trace, False, "resolve"),
        "torch_step": measure(args, dev, trace, False, "decode_step"),
    }
    stages = stage_breakdown(args, dev, trace) if on_gpu else None
    one_program = one_program_study(args, dev) if on_gpu else None
    # The low-load figure with the default launch path (one program at batch 1).
    one = argparse.Namespace(**{**vars(args), "batch": 1})
    one_trace = make_trace(one.steps, 1, one.topk, one.context, one.reuse).to(dev)
    runs["kernels_batch_1_no_eviction"] = measure(
        one, dev, one_trace, on_gpu, "resolve", fill=False
    )
    # Dynamic residency at low load: a decode node places a request's prompt in free slots
    # (EchoManager.write_prompt), so every selection is resident and a step only looks up.
    resident = argparse.Namespace(**{**vars(one), "reuse": 1.0})
    resident_trace = make_trace(one.steps, 1, one.topk, one.context, 1.0).to(dev)
    runs["kernels_batch_1_resident"] = measure(
        resident, dev, resident_trace, on_gpu, "resolve", fill=False
    )
    runs["kernels_batch_1_resident_with_recall"] = measure(
        resident, dev, resident_trace, on_gpu, "decode_step", fill=False
    )
    # The old definition (one layer-step per replay: a graph launch each) beside.
    runs["kernels_decode_management_single_replay"] = measure(
        args, dev, trace, on_gpu, "resolve", group=1
    )
    runs["kernels_batch_1_no_eviction_single_replay"] = measure(
        one, dev, one_trace, on_gpu, "resolve", fill=False, group=1
    )
    floors = (
        {
            "graph_replay_floor_us": launch_floor(args, dev, 1, 1),
            "launch_floor_us": {
                str(n): launch_floor(args, dev, n, args.group) for n in (1, len(STAGES))
            },
        }
        if on_gpu
        else {}
    )
    print("launch floors:", floors)
    chaining = chaining_study(args, dev) if on_gpu else None
    # The timing runs use a full cache; the policy study needs one smaller than the trace's
    # working set too, or every policy hits the same (nothing is ever evicted).
    policy_slots = args.policy_slots or int(1.25 * args.batch * args.topk)
    policy_trace, policy_source = trace, "synthetic trace above"
    if args.policy_trace:
        import numpy as np

        data = np.load(args.policy_trace)
        policy_trace = torch.from_numpy(data["selections"]).to(dev, torch.int64)
        policy_slots = int(data["slots"]) if "slots" in data else policy_slots
        policy_source = args.policy_trace
    host = int(policy_trace.max()) + 2
    policies = policy_hit_rates(policy_trace, policy_slots, host, policy_trace.shape[0] // 2)
    us = runs["kernels_decode_management"]["us"]
    metrics = {
        "implementation": "Triton cache kernels (kernels/alloc.py, bucketed LRU), graph-replayed"
        if on_gpu
        else "torch reference on CPU (smoke run)",
        "us_per_layer_step": us,
        "resolve_path": "look-back (kernels/alloc_lookback.py)",
        "us_per_layer_step_repeats": runs["kernels_decode_management_repeats"]["us"],
        "us_per_layer_step_with_recall": runs["kernels_decode_step"]["us"],
        "us_per_layer_step_with_append": runs["kernels_management"]["us"],
        "us_per_layer_step_with_append_and_recall": runs["kernels_step"]["us"],
        "torch_reference_us_per_layer_step": runs["torch_management"]["us"],
        "torch_reference_us_with_recall": runs["torch_step"]["us"],
        "exact_lru_sort_us": sort_us(args.slots, dev),
        "resolve_stage_us": stages,
        "batch": args.batch,
        "topk": args.topk,
        "slots": args.slots,
        "eviction_reserve": EchoConfig(
            dev_cache_size=args.slots, eviction_reserve=args.eviction_reserve
        ).eviction_reserve,
        "trace_reuse": args.reuse,
        "hit_rate": runs["kernels_decode_management"]["hit_rate"],
        "target_us": 8.0,
        "us_per_layer_step_batch_1_no_eviction": runs["kernels_batch_1_no_eviction"]["us"],
        "us_per_layer_step_batch_1_resident": runs["kernels_batch_1_resident"]["us"],
        "us_per_layer_step_batch_1_resident_with_recall": runs[
            "kernels_batch_1_resident_with_recall"
        ]["us"],
        "target_us_batch_1_no_eviction": 4.0,
        "layer_steps_per_replay": args.group,
        "us_per_layer_step_single_replay": runs["kernels_decode_management_single_replay"]["us"],
        "us_per_layer_step_batch_1_no_eviction_single_replay": runs[
            "kernels_batch_1_no_eviction_single_replay"
        ]["us"],
        **floors,
        "one_program_lanes": ONE_PROGRAM_LANES,
        "one_program_study": one_program,
        "victim_policies": policies,
        "victim_policy_trace": policy_source,
        "victim_policy_slots": policy_slots,
        "evictions_per_step": runs["kernels_decode_management"]["evictions_per_step"],
        "victim_policy_kept": "lru_bucketed",
        "launch_chaining": chaining,
        "runs": runs,
    }
    path = save_record(
        args.out, "cache_ops", torch.cuda.get_device_name() if on_gpu else "cpu", metrics
    )
    try:
        plot(path)
    except ImportError:
        print("matplotlib missing: no PNG")
    print(f"{'run':22s} {'us/layer-step':>14s} {'min':>8s} {'hit rate':>9s}")
    for name, r in runs.items():
        print(f"{name:22s} {r['us']:14.1f} {r['us_min']:8.1f} {r['hit_rate']:9.3f}")
    print(f"exact-LRU sort of {args.slots} priorities: {metrics['exact_lru_sort_us']} us")
    print("resolve kernels, us each:", stages)
    print("victim policy hit rates:", {k: round(v, 4) for k, v in policies.items()})


if __name__ == "__main__":
    main()
