"""What the GPU did, stream by stream, in a profiler trace: where a served decode node's
device time goes between its decode steps.

Why: the served efficiency (decode steps' device time / wall time) counts only the CUDA-event
span of each step's graph. What fills the rest of the decode stream's time (sampling, the
step's input uploads, admission's and arrivals' kernels, releases) or leaves it idle (the
host late with the next launch, a blocking call) is not in any counter. A torch profiler
trace (CUDA activity only: kernels, copies and the runtime calls that launched them) holds
every device operation with its stream; this module folds it into busy time, idle gaps and
the kernels that took the time, per stream, and folds the decode steps' graph launches
into the gaps between them (the host late, or the next step held behind other work), so a
reader can tell "the GPU waited for the host" from "the GPU did other work" without opening
the trace.

    python -m benchmark.device_timeline TRACE.json[.gz] [--out SUMMARY.json]
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

# Chrome-trace categories of device work (torch.profiler's export_chrome_trace).
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
# Gap sizes on the decode stream, in microseconds: (label, upper bound).
GAP_BUCKETS = (("<10us", 10.0), ("10-100us", 100.0), ("0.1-1ms", 1000.0), (">=1ms", float("inf")))
STREAMS_SHOWN = 8
NAME_WIDTH = 90  # kernel names are C++ signatures: long, and their start tells them apart


@dataclass(frozen=True)
class DeviceOp:
    """One kernel, copy or memset: its stream and its span in microseconds."""

    name: str
    category: str
    stream: int
    start_us: float
    dur_us: float
    correlation: int = -1  # the runtime call that launched it

    @property
    def end_us(self) -> float:
        return self.start_us + self.dur_us


@dataclass(frozen=True)
class HostCall:
    """One CUDA runtime call on the host (a launch, a copy, a synchronize)."""

    name: str
    dur_us: float
    correlation: int = -1
    thread: int = -1
    start_us: float = 0.0


def load_chrome_trace(path: str | Path) -> tuple[list[DeviceOp], list[HostCall]]:
    """The device operations and the host's CUDA runtime calls of a torch profiler trace
    (``.json``, or ``.json.gz`` as the probe leaves it)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        events = json.load(f)
    if isinstance(events, dict):
        events = events.get("traceEvents", [])
    ops: list[DeviceOp] = []
    calls: list[HostCall] = []
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        cat = e.get("cat", "")
        args = e.get("args", {})
        corr = int(args.get("correlation", -1))
        if cat in DEVICE_CATEGORIES:
            stream = int(args.get("stream", -1))
            ops.append(DeviceOp(e["name"], cat, stream, float(e["ts"]), float(e["dur"]), corr))
        elif cat in ("cuda_runtime", "cuda_driver"):
            tid = int(e.get("tid", -1))
            calls.append(HostCall(e["name"], float(e["dur"]), corr, tid, float(e["ts"])))
    ops.sort(key=lambda o: o.start_us)
    return ops, calls


def merged_spans(ops: Iterable[DeviceOp]) -> list[tuple[float, float]]:
    """The union of the operations' spans, as sorted disjoint (start, end) pairs."""
    spans: list[tuple[float, float]] = []
    for op in sorted(ops, key=lambda o: o.start_us):
        if spans and op.start_us <= spans[-1][1]:
            if op.end_us > spans[-1][1]:
                spans[-1] = (spans[-1][0], op.end_us)
        else:
            spans.append((op.start_us, op.end_us))
    return spans


def _busy(spans: Sequence[tuple[float, float]]) -> float:
    return sum(end - start for start, end in spans)


def _short(name: str) -> str:
    return name if len(name) <= NAME_WIDTH else name[: NAME_WIDTH - 3] + "..."


def top_names(ops: Iterable[DeviceOp], limit: int = 12) -> list[dict]:
    """The operations' names by total device time (microseconds), most first."""
    total: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for op in ops:
        key = _short(op.name)
        total[key] += op.dur_us
        count[key] += 1
    ranked = sorted(total, key=total.__getitem__, reverse=True)[:limit]
    return [{"name": k, "us": round(total[k], 1), "count": count[k]} for k in ranked]


def gaps_of(
    ops: Sequence[DeviceOp], spans: Sequence[tuple[float, float]]
) -> list[tuple[float, str, str]]:
    """Each idle gap between the stream's busy spans: (microseconds, the name of the
    operation that ended it before, the name of the one that started after)."""
    ending: dict[float, str] = {}
    starting: dict[float, str] = {}
    for op in ops:
        ending[op.end_us] = op.name
        starting.setdefault(op.start_us, op.name)
    out = []
    for (_, end), (start, _) in pairwise(spans):
        out.append((start - end, _short(ending.get(end, "?")), _short(starting.get(start, "?"))))
    return out


GRAPH_LAUNCHES = ("cudaGraphLaunch", "cuGraphLaunch")
WAIT_US = 100.0  # an engine-thread operation that started this long after the one before


def graph_gaps(ops: Sequence[DeviceOp], calls: Sequence[HostCall]) -> dict | None:
    """The decode steps as graph launches: the device time between one step's graph and
    the next, whether the host launched the next one late (the GPU waited for the host) or
    early (the GPU was held by other work: which operation of the engine thread waited,
    and how long), and the engine thread's device work outside the graphs.

    Why by launch and not by stream: a graph's kernels are reported on the streams of its
    branches, so the stream it was launched into looks idle while its own graph runs."""
    by_corr = {c.correlation: c for c in calls if c.correlation >= 0}
    spans: dict[int, list[float]] = {}
    for op in ops:
        call = by_corr.get(op.correlation)
        if call is not None and call.name in GRAPH_LAUNCHES:
            span = spans.setdefault(op.correlation, [op.start_us, op.end_us])
            span[0], span[1] = min(span[0], op.start_us), max(span[1], op.end_us)
    if len(spans) < 2:
        return None
    engine = by_corr[next(iter(spans))].thread
    steps = sorted((a, b, by_corr[c].start_us) for c, (a, b) in spans.items())
    direct = [
        op
        for op in ops
        if op.correlation in by_corr
        and by_corr[op.correlation].thread == engine
        and by_corr[op.correlation].name not in GRAPH_LAUNCHES
    ]
    direct.sort(key=lambda o: o.start_us)
    late = {"count": 0, "us": 0.0}
    held = {"count": 0, "us": 0.0}
    waits: dict[str, list[float]] = defaultdict(list)
    gaps = []
    j = 0
    for (_, end, _), (start, _, launched) in pairwise(steps):
        gap = max(0.0, start - end)
        gaps.append(gap)
        kind = late if launched > end else held
        kind["count"] += 1
        kind["us"] += gap
        # the engine thread's operations inside a held gap: each that started WAIT_US or
        # more after the one before (or after the graph) waited for something else
        while j < len(direct) and direct[j].start_us < end:
            j += 1
        prev_end, k = end, j
        while k < len(direct) and direct[k].start_us < start:
            wait = direct[k].start_us - prev_end
            if wait >= WAIT_US and launched <= end:
                waits[_short(direct[k].name)].append(wait)
            prev_end = max(prev_end, direct[k].end_us)
            k += 1
    gaps_sorted = sorted(gaps)
    window = steps[-1][1] - steps[0][0]
    return {
        "steps": len(steps),
        "step_span_us_median": round(sorted(b - a for a, b, _ in steps)[len(steps) // 2], 1),
        "gap_us": {
            "median": round(gaps_sorted[len(gaps) // 2], 1),
            "mean": round(sum(gaps) / len(gaps), 1),
            "max": round(gaps_sorted[-1], 1),
            "total": round(sum(gaps), 1),
        },
        "gap_share": round(sum(gaps) / window, 4),
        "host_late": {"count": late["count"], "us": round(late["us"], 1)},
        "launched_early": {"count": held["count"], "us": round(held["us"], 1)},
        "engine_direct_us_per_step": round(sum(o.dur_us for o in direct) / len(steps), 1),
        "engine_direct_top": top_names(direct, limit=8),
        "waited_before": [
            {"op": name, "count": len(v), "us": round(sum(v), 1)}
            for name, v in sorted(waits.items(), key=lambda kv: sum(kv[1]), reverse=True)[:8]
        ],
    }


def summarize(
    ops: Sequence[DeviceOp], calls: Sequence[HostCall] = (), main_stream: int | None = None
) -> dict:
    """Busy time per stream, the decode stream's idle gaps and what bordered the largest,
    and the host's blocking runtime calls. ``main_stream``: the decode's stream (default:
    the stream with the most device time)."""
    if not ops:
        raise ValueError("the trace holds no device operations (was CUDA activity profiled?)")
    t0 = min(o.start_us for o in ops)
    t1 = max(o.end_us for o in ops)
    window = t1 - t0
    by_stream: dict[int, list[DeviceOp]] = defaultdict(list)
    device_us: dict[int, float] = defaultdict(float)
    for op in ops:
        by_stream[op.stream].append(op)
        device_us[op.stream] += op.dur_us
    # The busiest streams (a graph's branches each report a stream of their own: hundreds).
    busiest = sorted(by_stream, key=device_us.__getitem__, reverse=True)
    if main_stream is None:
        main_stream = busiest[0]
    streams = {}
    for stream in sorted(busiest[:STREAMS_SHOWN]):
        sops = by_stream[stream]
        spans = merged_spans(sops)
        streams[str(stream)] = {
            "ops": len(sops),
            "busy_us": round(_busy(spans), 1),
            "busy_share": round(_busy(spans) / window, 4),
            "top": top_names(sops),
        }
    main_ops = by_stream[main_stream]
    main_spans = merged_spans(main_ops)
    gaps = gaps_of(main_ops, main_spans)
    buckets = {label: {"count": 0, "us": 0.0} for label, _ in GAP_BUCKETS}
    for size, _, _ in gaps:
        label = next(label for label, bound in GAP_BUCKETS if size < bound)
        buckets[label]["count"] += 1
        buckets[label]["us"] = round(buckets[label]["us"] + size, 1)
    largest = sorted(gaps, reverse=True)[:10]
    # What bordered the gaps of 0.1 ms and more, by (before, after) pair: a gap that comes
    # back at the same place each step has one cause.
    borders: dict[tuple[str, str], list[float]] = defaultdict(list)
    for size, before, after in gaps:
        if size >= 100.0:
            borders[(before, after)].append(size)
    border_rows = sorted(borders.items(), key=lambda kv: sum(kv[1]), reverse=True)[:10]
    blocking = defaultdict(float)
    for call in calls:
        if "Synchronize" in call.name or call.name in ("cudaMemcpy", "cudaMemset"):
            blocking[call.name] += call.dur_us
    return {
        "window_us": round(window, 1),
        "device_busy_share": round(_busy(merged_spans(ops)) / window, 4),
        "main_stream": main_stream,
        "main_busy_share": round(_busy(main_spans) / window, 4),
        "streams_total": len(by_stream),
        "main_idle_us": round(window - _busy(main_spans), 1),
        "main_gaps": buckets,
        "main_largest_gaps": [{"us": round(s, 1), "after": b, "before": a} for s, b, a in largest],
        "main_gap_borders": [
            {"after": b, "before": a, "count": len(v), "us": round(sum(v), 1)}
            for (b, a), v in border_rows
        ],
        "streams": streams,
        # every operation name over all streams (a graph's kernels report many streams): what
        # two engines' windows differ by, per step once divided by the window's steps
        "ops_by_name": top_names(ops, limit=len(ops)),
        "host_blocking_us": {k: round(v, 1) for k, v in sorted(blocking.items())},
        "graphs": graph_gaps(ops, calls),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", help="a torch profiler chrome trace (export_chrome_trace)")
    ap.add_argument("--main-stream", type=int, default=None, help="default: the busiest")
    ap.add_argument("--out", default=None, help="write the summary as JSON here")
    args = ap.parse_args()
    ops, calls = load_chrome_trace(args.trace)
    summary = summarize(ops, calls, args.main_stream)
    text = json.dumps(summary, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
