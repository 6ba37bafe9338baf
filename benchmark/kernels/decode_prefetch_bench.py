"""Decode intra-query prefetch (ECHO Figure 18): batch 16, 128K context, fp8 indexer.

One layer's decode indexer + cache step, through the production code: the model's
``LightningIndexer.select`` (fp8 logits kernel, exact tie-stable top-k) and
``EchoManager`` (Triton cache-management and UVA recall kernels) over a 260K-slot device
cache and a pinned host pool of 656 B rows (SGLang's fp8 MLA row):

- unfused: logits -> top-k -> resolve (look up, evict, allocate, recall the misses);
- chunked (SGLANG_NSA_FUSE_LOGITS_RECALL_DECODE=1, the runtime's design and the SGLang
  plugin's): the logits in chunks of key positions; after each, side streams stage the
  chunk's misses scoring above the request's predicted threshold into a staging buffer
  (kernels/decode_stage.py, bounded grid) while the next chunks and the top-k run ->
  resolve, whose recall takes staged rows device to device.

``speedup`` = unfused / chunked (``chunked_speedup`` too). Figure 18's own definition
(ECHO), top-k and cache management left out: (logits; recall of every miss) against (the
chunked logits and their side-stream copies; the recall with the staging),
``fig18_chunked_speedup``. The designs this bench timed beside it until they left the
package (the in-kernel and split designs, the allocating one, the selects on the copies'
stream) are in its earlier records (benchmark/results/decode_prefetch.json and
history/, docs/ARCHITECTURE.md section 6).

Thresholds come from two earlier steps (queries perturbed by ``--query-noise``) through
the DecodeThresholdPredictor (EMA, alpha 0.5). Residency: a fraction ``hit`` of the
step's exact selections is resident (90% of them last used one step ago, as consecutive
decode steps select mostly the same tokens), the rest of the (full) cache holds
unselected tokens aged 1..300 steps, so every allocation evicts. Before timing, each
case checks that all variants select the same tokens and attention would read the same
bytes (= host rows), eagerly and from CUDA-graph replay. Times: CUDA events, warm-up,
medians of graph replays in interleaved rounds (the range of the rounds recorded), cache
state restored before every run (untimed); eager launches alongside.
``slowdown_at_hit_1.0`` = chunked / unfused with nothing selected to fetch.

    PYTHONPATH=python python benchmark/kernels/decode_prefetch_bench.py --out benchmark/results
    python benchmark/kernels/decode_prefetch_bench.py --device cpu --smoke --out /tmp/dp  # CPU
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmark/results")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--hit-rates", default="0.5,0.8,0.9,0.97,0.98,1.0")
    p.add_argument("--dev-slots", type=int, default=260_000, help="N_G")
    p.add_argument("--row-bytes", type=int, default=656)
    p.add_argument("--rounds", type=int, default=3, help="interleaved graph-timing rounds")
    p.add_argument("--query-noise", type=float, default=0.3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--stream-priority", choices=("equal", "high"), default="equal")
    p.add_argument("--no-graphs", dest="graphs", action="store_false")
    p.add_argument(
        "--profile",
        default=None,
        help="hit rates (comma-separated) whose graph replays are profiled instead of timed: "
        "each variant's kernels in start order, with start offsets and durations",
    )
    p.add_argument("--smoke", action="store_true", help="tiny sizes (CPU check of the bench)")
    args = p.parse_args()
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.smoke:
        args.batch, args.context, args.heads, args.dim, args.topk = 2, 512, 16, 32, 64
        args.dev_slots, args.hit_rates, args.warmup, args.reps = 400, "0.5,1.0", 0, 1
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    return args


ARGS = _parse()

from common import graph_us, pyplot, save_record, time_us  # noqa: E402

from sglang_echo.config import default_stage_rows, settings  # noqa: E402
from sglang_echo.kernels.cache_layout import ABSENT  # noqa: E402
from sglang_echo.kernels.indexer import fp8_index_logits, program_span  # noqa: E402
from sglang_echo.kernels.recall import recall_rows  # noqa: E402
from sglang_echo.model import indexer as indexer_module  # noqa: E402
from sglang_echo.model.config import fp8_row_bytes  # noqa: E402
from sglang_echo.model.forward_batch import ForwardBatch  # noqa: E402
from sglang_echo.model.indexer import (  # noqa: E402
    LightningIndexer,
    exact_topk,
    pack_fp8_rows,
    select_topk,
    unpack_fp8_rows,
)
from sglang_echo.offload.decode_prefetcher import (  # noqa: E402
    STAGE_STREAM_PRIORITY,
    DecodePrefetcher,
)
from sglang_echo.offload.device_cache import DeviceCache  # noqa: E402
from sglang_echo.offload.host_pool import HostKVPool  # noqa: E402
from sglang_echo.offload.manager import EchoManager  # noqa: E402

MAPS = ("host_to_device", "device_to_host", "priority", "free_stack", "free_count", "clock")


class Bench:
    """One layer: indexer keys, host pool, device cache, manager, prefetcher, queries."""

    def __init__(self, args: argparse.Namespace, dev: torch.device) -> None:
        self.args, self.dev = args, dev
        B, L, H, D = args.batch, args.context, args.heads, args.dim
        self.cuda = dev.type == "cuda"
        g = torch.Generator(device=dev).manual_seed(0)
        n_h = B * L  # host ids 1..n_h; 0 is the sink
        keys = torch.randn(n_h + 1, D, device=dev, generator=g).to(torch.float8_e4m3fn)
        scales = torch.rand(n_h + 1, device=dev, generator=g) + 0.5
        # The model's index-K rows: SGLang's 132 bytes padded to 144 (config.fp8_row_bytes).
        self.key_rows = pack_fp8_rows(keys, scales, fp8_row_bytes(D))
        del keys, scales
        # Paged like SGLang's index-K cache: each request owns shuffled 64-token pages.
        pages = -(-L // 64)
        perm = torch.randperm(B * pages, device=dev, generator=g).view(B, pages)
        locs = (perm[:, :, None] * 64 + torch.arange(64, device=dev) + 1).reshape(B, -1)[:, :L]
        self.locs = locs.clamp(max=n_h)
        base = torch.randn(B, H, D, device=dev, generator=g)
        self.w = torch.randn(B, H, device=dev, generator=g) / H**0.5
        self.q = base.to(torch.float8_e4m3fn)
        noise = args.query_noise
        self.q_prev = [
            (base + noise * torch.randn(B, H, D, device=dev, generator=g)).to(torch.float8_e4m3fn)
            for _ in range(2)
        ]
        self.rows_of = torch.arange(B, device=dev)
        self.batch = ForwardBatch(
            input_ids=torch.zeros(B, dtype=torch.int64, device=dev),
            positions=torch.full((B,), L - 1, dtype=torch.int64, device=dev),
            out_locs=torch.zeros(B, dtype=torch.int64, device=dev),
            context_locs=self.locs,
            extend_lens=[1] * B,
            context_lens=[L] * B,
            is_decode=True,
            request_rows=self.rows_of,
        )
        cfg = SimpleNamespace(
            index_n_heads=H,
            index_head_dim=D,
            qk_rope_head_dim=min(64, D),
            index_topk=args.topk,
            indexer_mode="fp8_hadamard",
            q_lora_rank=8,
            hidden_size=8,
        )
        self.indexer = LightningIndexer(cfg).to(dev)
        # Host pool (pinned, read through its UVA alias on CUDA) and the device cache.
        self.host = HostKVPool(1, n_h, args.row_bytes, torch.uint8, pin=self.cuda)
        self._fill_host(g)
        self.cache = DeviceCache(1, args.dev_slots, n_h, args.row_bytes, torch.uint8, dev)
        self.manager = EchoManager(self.host, self.cache, use_kernels=True, pdl=settings().pdl)
        # The prefetcher's staged rows per request for these rows (at most the top-k: the
        # smoke run's tiny top-k).
        stage_cap = min(default_stage_rows(args.row_bytes), args.topk)
        self.chunker = DecodePrefetcher(self.manager, max_rows=B, cap=stage_cap)
        self._learn_thresholds()

    def _fill_host(self, g: torch.Generator) -> None:
        rows = self.host.device_view[0] if self.cuda else self.host.rows[0]
        step = 1 << 18
        for s in range(0, rows.shape[0], step):
            n = min(step, rows.shape[0] - s)
            chunk = torch.randint(0, 256, (n, rows.shape[1]), device=self.dev, generator=g)
            rows[s : s + n].copy_(chunk.to(torch.uint8))

    def logits(self, q: torch.Tensor) -> torch.Tensor:
        keys, scales = unpack_fp8_rows(self.key_rows, self.args.dim)
        lens = (self.batch.positions + 1).to(torch.int32)
        return fp8_index_logits(q, self.w, keys, scales, self.locs, lens)

    def _learn_thresholds(self) -> None:
        """Two earlier steps' exact k-th scores through the predictor (EMA, alpha 0.5)."""
        qpos = self.batch.positions.view(-1, 1)
        p = self.chunker.predictors[0]
        for q in self.q_prev:
            _, kth = select_topk(self.logits(q).unsqueeze(1), qpos, self.args.topk, True)
            p.update(kth.squeeze(1), self.rows_of)
        self.theta0, self.finite0 = p.theta.clone(), p.finite.clone()

    # ------------------------------------------------------------------ residency
    def set_residency(self, hit: float) -> dict:
        """A fraction ``hit`` of this step's selections resident, the rest of the cache
        full of unselected tokens with ages 1..300 steps. Saves the state to restore."""
        c, n_g = self.cache, self.cache.num_slots
        sel = self.indexer.select(self.q, self.w, self.key_rows, self.batch)
        selected = torch.unique(sel[sel >= 0])
        gen = torch.Generator(device=self.dev).manual_seed(int(hit * 1000))
        order = torch.randperm(selected.numel(), device=self.dev, generator=gen)
        keep = selected[order[: round(hit * selected.numel())]]
        others = torch.ones(c.host_tokens + 1, dtype=torch.bool, device=self.dev)
        others[0] = False
        others[selected] = False
        pool = others.nonzero().squeeze(1)
        fill = n_g - keep.numel()
        if fill < 0 or pool.numel() < fill:
            raise SystemExit("--dev-slots must hold the resident selections and fit the host")
        extra = pool[torch.randperm(pool.numel(), device=self.dev, generator=gen)[:fill]]
        ids = torch.cat((keep, extra))
        slots = torch.randperm(n_g, device=self.dev, generator=gen) + 1
        clock = 1000
        # Temporal locality, as in real decode: most resident selections were selected in
        # the previous step too (age 1); other resident tokens have any age up to 300.
        ages = torch.randint(1, 301, (n_g,), device=self.dev, generator=gen)
        recent = torch.rand(keep.numel(), device=self.dev, generator=gen) < 0.9
        ages[: keep.numel()] = torch.where(recent, 1, ages[: keep.numel()])
        c.host_to_device[0].fill_(ABSENT)
        c.host_to_device[0, 0] = 0
        c.host_to_device[0].index_copy_(0, ids, slots.to(torch.int32))
        c.device_to_host[0, 1 : n_g + 1].copy_(torch.zeros(n_g, dtype=torch.int32))
        c.device_to_host[0].index_copy_(0, slots, ids.to(torch.int32))
        c.priority[0, 1 : n_g + 1].copy_(torch.zeros(n_g, dtype=torch.int64))
        c.priority[0].index_copy_(0, slots, clock - ages)
        c.free_count.zero_()
        c.clock.fill_(clock)
        host = self.host.device_view[0] if self.cuda else self.host.rows[0]
        c.rows[0].fill_(0xAB)  # poison: a row never recalled cannot pass the check
        c.rows[0].index_copy_(0, slots, host.index_select(0, ids))
        self.saved = {name: getattr(c, name).clone() for name in MAPS}
        self.saved_rows = c.rows.clone()
        return {"selected": selected.numel(), "resident_selected": keep.numel()}

    def restore(self, rows: bool = False) -> None:
        for name in MAPS:
            getattr(self.cache, name).copy_(self.saved[name])
        if rows:
            self.cache.rows.copy_(self.saved_rows)
        p = self.chunker.predictors[0]
        p.theta.copy_(self.theta0)
        p.finite.copy_(self.finite0)

    # ------------------------------------------------------------------- variants
    def unfused(self) -> tuple[torch.Tensor, torch.Tensor]:
        sel = self.indexer.select(self.q, self.w, self.key_rows, self.batch)
        return sel, self.manager.resolve(0, sel)

    def chunked(self) -> tuple[torch.Tensor, torch.Tensor]:
        sel = self.indexer.select(self.q, self.w, self.key_rows, self.batch, self.chunker, 0)
        return sel, self.manager.resolve(0, sel)

    # Figure 18's definition: the indexer's logits and the recall of every miss, top-k and
    # cache management left out. The miss list and its slots are fixed (distinct slots).
    def fig18_plain(self) -> None:
        self.logits(self.q)
        recall_rows(self.host_rows(), self.scratch_rows, *self.fig18_misses)

    def fig18_chunked(self) -> None:
        keys, scales = unpack_fp8_rows(self.key_rows, self.args.dim)
        lens = (self.batch.positions + 1).to(torch.int32)
        theta = self.chunker.theta(0, self.rows_of)
        scores = torch.empty(self.locs.shape, dtype=torch.float32, device=self.dev)
        bounds = self.chunker.chunk_bounds(self.locs.shape[1], program_span())
        for i, (start, end) in enumerate(bounds):
            fp8_index_logits(
                self.q, self.w, keys, scales, self.locs, lens, out=scores, start=start, end=end
            )
            self.chunker.stage(0, i, scores, self.locs, lens, theta, start, end)
        staged = self.chunker.staged_rows(0, self.args.batch)  # no top-k: no finish()
        if self.cuda:
            torch.cuda.current_stream().wait_stream(self.chunker._side_stream())
        recall_rows(self.host_rows(), self.scratch_rows, *self.fig18_misses, staged=staged)

    def host_rows(self) -> torch.Tensor:
        return self.host.device_view[0] if self.cuda else self.host.rows[0]

    def counters(self) -> dict:
        c, m = self.cache, self.manager
        return {
            "hits": int(c.hits.sum()),
            "misses": int(c.misses.sum()),
            "prefetched": int(m.prefetched_rows.sum()),
            "prefetch_hits": int(m.prefetch_hits.sum()),
        }

    def run_checked(self, fn) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """Run ``fn`` from the saved state; return the selection, the rows attention would
        read, and the counter deltas."""
        self.restore(rows=True)
        before = self.counters()
        sel, slots = fn()
        self.sync()
        after = self.counters()
        rows = self.cache.rows[0][slots.clamp(min=0)].cpu()
        return sel.cpu(), rows, {k: after[k] - before[k] for k in after}

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def expected_rows(self, sel: torch.Tensor) -> torch.Tensor:
        return self.host.rows[0][sel.clamp(min=0)]


def time_ms(bench: Bench, fn, warmup: int, reps: int) -> float:
    """Median CUDA-event time of ``fn`` with the cache state restored before each run
    (untimed); one wall-clock run on a CPU."""
    if not bench.cuda:
        bench.restore()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1000
    for _ in range(warmup):
        bench.restore()
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        bench.restore()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def stateless_ms(bench: Bench, fn, warmup: int, reps: int) -> float:
    """One component alone; on CUDA replayed from a graph (as the step totals are), so
    the components and the totals share one basis and no CPU launch overhead."""
    if not bench.cuda:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1000
    try:
        return graph_us(fn, warmup=max(1, warmup), reps=reps) / 1000
    except RuntimeError:  # not capturable: eager device time
        return time_us(fn, warmup=max(1, warmup), reps=reps) / 1000


def capture(bench: Bench, fn, stream) -> torch.cuda.CUDAGraph:
    bench.restore()
    fn()  # warm (allocations, compilation) before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    torch.cuda.synchronize()
    return graph


GRAPHED = ("unfused", "chunked", "fig18_plain", "fig18_chunked")


def graph_times(bench: Bench, row: dict, sel_u, want, stream, args) -> bool:
    """Device time: every variant replayed from its CUDA graph (the side streams fork and
    join inside), in ``args.rounds`` interleaved rounds; each round's figure is a median
    of ``args.reps`` replays, the record keeps the median round and the range. Returns
    whether each step replay left the right rows."""
    ok = True
    graphs = {}
    for name in GRAPHED:
        fn = getattr(bench, name)
        graphs[name] = capture(bench, fn, stream)
        if name.startswith("fig18"):
            continue
        bench.restore(rows=True)
        graphs[name].replay()
        torch.cuda.synchronize()
        sel = sel_u.to(bench.dev)
        slots = bench.cache.host_to_device[0][sel.clamp(min=0)].long()
        ok = ok and torch.equal(bench.cache.rows[0][slots].cpu(), want)
    rounds = {name: [] for name in GRAPHED}
    for _ in range(args.rounds):
        for name in GRAPHED:
            rounds[name].append(time_ms(bench, graphs[name].replay, args.warmup, args.reps))
    for name, times in rounds.items():
        row[f"{name}_graph_ms"] = statistics.median(times)
        row[f"{name}_graph_ms_range"] = [min(times), max(times)]
    graphs.clear()
    return ok


def run_case(bench: Bench, hit: float, args, stream) -> dict:
    row = {"hit_rate": hit, **bench.set_residency(hit)}
    # Correct first: same selections, and the rows attention reads are the host rows.
    sel_u, rows_u, cnt_u = bench.run_checked(bench.unfused)
    sel_c, rows_c, cnt_c = bench.run_checked(bench.chunked)
    want = bench.expected_rows(sel_u)
    ok = torch.equal(sel_u, sel_c) and torch.equal(rows_u, want) and torch.equal(rows_c, want)
    row.update(
        hit_rate_measured=cnt_u["hits"] / max(1, cnt_u["hits"] + cnt_u["misses"]),
        recall_rows=cnt_u["misses"],
        recall_MB=cnt_u["misses"] * args.row_bytes / 1e6,
        staged_rows=cnt_c["prefetched"],
        staged_used=cnt_c["prefetch_hits"],
        staged_remaining=cnt_c["misses"] - cnt_c["prefetch_hits"],
        stage_cap=bench.chunker.cap,
        stage_chunks=bench.chunker.chunks,
    )
    w, r = args.warmup, args.reps
    row["unfused_ms"] = time_ms(bench, bench.unfused, w, r)
    row["chunked_ms"] = time_ms(bench, bench.chunked, w, r)
    row["speedup_eager"] = row["unfused_ms"] / row["chunked_ms"]
    # Components (stateless): logits alone, top-k alone, the unfused recall alone (its
    # miss count, into distinct slots).
    bench.restore()
    row["logits_ms"] = stateless_ms(bench, lambda: bench.logits(bench.q), w, r)
    logits = bench.logits(bench.q).unsqueeze(1)
    qpos = bench.batch.positions.view(-1, 1)
    # The top-k decode runs: the radix-select kernel on CUDA, the sort on the CPU.
    row["topk_ms"] = stateless_ms(
        bench,
        lambda: exact_topk(logits.squeeze(1), qpos.view(-1), args.topk, bench.cuda),
        w,
        r,
    )
    misses = torch.unique(sel_u[sel_u >= 0]).to(bench.dev)
    misses = misses[bench.saved["host_to_device"][0][misses] == ABSENT]
    count = torch.tensor([misses.numel()], device=bench.dev)
    slots = torch.arange(1, misses.numel() + 1, device=bench.dev)
    host = bench.host_rows()
    bench.scratch_rows = torch.zeros(misses.numel() + 1, args.row_bytes, dtype=torch.uint8,
                                     device=bench.dev)  # fmt: skip
    bench.fig18_misses = (misses, slots, count)
    row["recall_ms"] = stateless_ms(
        bench, lambda: recall_rows(host, bench.cache.rows[0], misses, slots, count), w, r
    )
    # Figure 18's staged path moves every miss's row (from the staging or the host).
    bench.restore()
    bench.scratch_rows.zero_()
    bench.fig18_chunked()
    bench.sync()
    ok = ok and torch.equal(bench.scratch_rows[1:].cpu(), bench.host.rows[0][misses.cpu()])
    row["speedup"] = row["speedup_eager"]
    if args.graphs and bench.cuda:
        try:
            ok = ok and graph_times(bench, row, sel_u, want, stream, args)
            row["speedup"] = row["unfused_graph_ms"] / row["chunked_graph_ms"]
            row["chunked_speedup"] = row["speedup"]
            fig18_chunked = row["fig18_chunked_graph_ms"]
            row["fig18_chunked_speedup"] = row["fig18_plain_graph_ms"] / fig18_chunked
            lo_u, hi_u = row["unfused_graph_ms_range"]
            lo_s, hi_s = row["chunked_graph_ms_range"]
            row["speedup_range"] = [lo_u / hi_s, hi_u / lo_s]
        except RuntimeError as exc:  # keep the eager results; say why graphs are missing
            row["graph_error"] = str(exc)[:300]
            print(f"CUDA graphs failed at hit {hit}: {row['graph_error']}", flush=True)
    row["correct"] = bool(ok)
    return row


def plot(rows: list[dict], path: Path, device: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    graphs = all("unfused_graph_ms" in r for r in rows)
    suffix = "_graph_ms" if graphs else "_ms"
    labels = [f"hit {r['hit_rate']}" for r in rows]
    x = list(range(len(rows)))
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    names = ("unfused", "chunked")
    labels_of = {"chunked": "chunked staging"}
    for k, name in enumerate(names):
        label = labels_of.get(name, name)
        a.bar([i + 0.4 * (k - 0.5) for i in x], [r[name + suffix] for r in rows], 0.4, label=label)
    a.set_xticks(x, labels)
    a.set_ylabel("ms, indexer + top-k + cache step" + (" (graph)" if graphs else ""))
    a.legend()
    b.bar(x, [r["speedup"] for r in rows], label="whole step" if graphs else "eager")
    if graphs:
        b.plot(x, [r["fig18_chunked_speedup"] for r in rows], "rx", label="Figure 18's definition")
    b.axhline(1.0, color="k", lw=0.8)
    b.set_xticks(x, labels)
    b.set_ylabel("unfused / chunked")
    b.legend()
    fig.suptitle(f"Decode intra-query prefetch ({device})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def profile(bench: Bench, hits: str, stream) -> None:
    """One graph replay of each step under the profiler: the kernels in start order
    (offset from the first, duration; us). Where the staged step's extra time goes."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for hit in (float(h) for h in hits.split(",")):
        bench.set_residency(hit)
        for name in ("unfused", "chunked"):
            graph = capture(bench, getattr(bench, name), stream)
            bench.restore(rows=True)
            graph.replay()
            bench.restore(rows=True)
            torch.cuda.synchronize()
            with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
                graph.replay()
                torch.cuda.synchronize()
            kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            kernels.sort(key=lambda e: e.time_range.start)
            if not kernels:
                print(f"profile hit {hit} {name}: no kernels recorded")
                continue
            t0 = kernels[0].time_range.start
            end = max(e.time_range.end for e in kernels)
            print(f"profile hit {hit} {name}: {len(kernels)} kernels, span {end - t0:.1f} us")
            for e in kernels:
                start = e.time_range.start - t0
                print(f"  {start:8.1f} {e.time_range.elapsed_us():7.1f}  {e.name[:90]}")
            del graph


def main() -> None:
    args = ARGS
    dev = torch.device(args.device)
    if dev.type == "cpu":
        indexer_module.INDEXER_KERNELS_ON_CPU = True  # the Triton kernels, interpreted
    t0 = time.perf_counter()
    stream = None
    if dev.type == "cuda":
        stream = torch.cuda.Stream(priority=-1 if args.stream_priority == "high" else 0)
        torch.cuda.set_stream(stream)
    bench = Bench(args, dev)
    device = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (interpreter smoke)"
    if args.profile:
        if dev.type != "cuda":
            raise SystemExit("--profile needs CUDA (graph replays)")
        profile(bench, args.profile, stream)
        return
    print(
        f"{device}: batch {args.batch} x {args.context} ctx, {args.heads}h x {args.dim}d fp8, "
        f"top-k {args.topk}, {args.dev_slots} slots, {args.row_bytes} B rows, "
        f"{bench.chunker.cap} staged rows per request"
    )
    head = (
        f"{'hit':>5} {'logits':>7} {'recall rows':>11} {'MB':>6} {'recall':>7} {'unfused':>8} "
        f"{'staged':>7} {'used':>6} {'remain':>6} {'chunked':>8} {'speedup':>7} {'fig18':>6} ok"
    )
    print("ms; step totals are CUDA-graph replays where available")
    print(head)
    rows = []
    for hit in (float(h) for h in args.hit_rates.split(",")):
        r = run_case(bench, hit, args, stream)
        rows.append(r)
        g = lambda k, r=r: r.get(f"{k}_graph_ms", r[f"{k}_ms"])  # noqa: E731
        print(
            f"{hit:>5} {r['logits_ms']:>7.3f} {r['recall_rows']:>11} {r['recall_MB']:>6.2f} "
            f"{r['recall_ms']:>7.3f} {g('unfused'):>8.3f} "
            f"{r['staged_rows']:>7} {r['staged_used']:>6} {r['staged_remaining']:>6} "
            f"{g('chunked'):>8.3f} {r['speedup']:>7.3f} "
            f"{r.get('fig18_chunked_speedup', 0):>6.3f} {r['correct']}",
            flush=True,
        )
    by_hit = {r["hit_rate"]: r for r in rows}
    graphs = all("unfused_graph_ms" in r for r in rows)
    if not graphs:  # one basis for every case
        for r in rows:
            r["speedup"] = r["speedup_eager"]
    metrics = {
        **{f"speedup_at_hit_{h}": r["speedup"] for h, r in by_hit.items() if h < 1.0},
        "slowdown_at_hit_1.0": 1 / by_hit[1.0]["speedup"] if 1.0 in by_hit else None,
        "default_design": "chunked",
        "design": "speedup: the chunked staged design (kernels/decode_stage.py) over none",
        "speedup_range": {f"hit_{h}": r.get("speedup_range") for h, r in by_hit.items()},
        "chunked_speedup": {f"hit_{h}": r.get("chunked_speedup") for h, r in by_hit.items()},
        "fig18_chunked_speedup": {
            f"hit_{h}": r.get("fig18_chunked_speedup") for h, r in by_hit.items()
        },
        "stage_cap": bench.chunker.cap,
        "stage_chunks": bench.chunker.chunks,
        "stage_stream_priority": STAGE_STREAM_PRIORITY,
        "rounds": args.rounds,
        "speedup_basis": "CUDA-graph replay (device time)" if graphs else "eager launches",
        "speedup_eager": {f"hit_{h}": r["speedup_eager"] for h, r in by_hit.items()},
        "all_correct": all(r["correct"] for r in rows),
        "batch": args.batch,
        "context": args.context,
        "heads": args.heads,
        "dim": args.dim,
        "topk": args.topk,
        "dev_slots": args.dev_slots,
        "row_bytes": args.row_bytes,
        "query_noise": args.query_noise,
        "stream_priority": args.stream_priority,
        "seconds": time.perf_counter() - t0,
    }
    out = Path(args.out)
    save_record(out, "decode_prefetch", device, metrics, cases=rows)
    plot(rows, out / "decode_prefetch.png", device)
    summary = {
        k: round(v, 3)
        for k, v in metrics.items()
        if k.startswith(("speedup_at", "slow")) and v is not None  # rates not run: None
    }
    print(f"{summary} ({metrics['speedup_basis']}); all correct {metrics['all_correct']}; "
          f"{metrics['seconds']:.1f} s")  # fmt: skip


if __name__ == "__main__":
    main()
