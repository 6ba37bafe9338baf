"""What the GPU did, stream by stream, in a profiler trace: where a served decode node's
device time goes between its decode steps.

Why: the served efficiency (decode steps' device time / wall time) counts only the CUDA-event
span of each step's graph. What fills the rest of the decode stream's time (sampling, the
step's input uploads, admission's and arrivals' kernels, releases) or leaves it idle (the
host late with the next launch, a blocking call) is not in any counter. A torch profiler
trace (CUDA activity only: kernels, copies and the runtime calls that launched them) holds
every device operation with its stream; this module folds it into busy time, idle gaps and
the kernels that took the time, per stream, so a reader can tell "the GPU waited for the
host" from "the GPU did other work" without opening the trace.

    python -m benchmark.device_timeline TRACE.json [--out SUMMARY.json]
"""

from __future__ import annotations

import argparse
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
NAME_WIDTH = 90  # kernel names are C++ signatures: long, and their start tells them apart


@dataclass(frozen=True)
class DeviceOp:
    """One kernel, copy or memset: its stream and its span in microseconds."""

    name: str
    category: str
    stream: int
    start_us: float
    dur_us: float

    @property
    def end_us(self) -> float:
        return self.start_us + self.dur_us


@dataclass(frozen=True)
class HostCall:
    """One CUDA runtime call on the host (a launch, a copy, a synchronize)."""

    name: str
    dur_us: float


def load_chrome_trace(path: str | Path) -> tuple[list[DeviceOp], list[HostCall]]:
    """The device operations and the host's CUDA runtime calls of a torch profiler trace."""
    events = json.loads(Path(path).read_text())
    if isinstance(events, dict):
        events = events.get("traceEvents", [])
    ops: list[DeviceOp] = []
    calls: list[HostCall] = []
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        cat = e.get("cat", "")
        if cat in DEVICE_CATEGORIES:
            stream = int(e.get("args", {}).get("stream", -1))
            ops.append(DeviceOp(e["name"], cat, stream, float(e["ts"]), float(e["dur"])))
        elif cat == "cuda_runtime":
            calls.append(HostCall(e["name"], float(e["dur"])))
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
    for op in ops:
        by_stream[op.stream].append(op)
    if main_stream is None:
        main_stream = max(by_stream, key=lambda s: sum(o.dur_us for o in by_stream[s]))
    streams = {}
    for stream, sops in sorted(by_stream.items()):
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
        "main_busy_share": streams[str(main_stream)]["busy_share"],
        "main_idle_us": round(window - _busy(main_spans), 1),
        "main_gaps": buckets,
        "main_largest_gaps": [{"us": round(s, 1), "after": b, "before": a} for s, b, a in largest],
        "main_gap_borders": [
            {"after": b, "before": a, "count": len(v), "us": round(sum(v), 1)}
            for (b, a), v in border_rows
        ],
        "streams": streams,
        "host_blocking_us": {k: round(v, 1) for k, v in sorted(blocking.items())},
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
