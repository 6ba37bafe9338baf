"""Two engines' profiler traces of the same decode, laid side by side layer by layer: which
kernels one adds or replaces, and before which of the kernels both run the second falls
behind the first, at which layer of the step.

Why: at batch 1, where nothing needs offloading, ECHO's decode step takes a few percent
longer than no-offload's. Kernel totals per name (``ops_by_name`` of benchmark/device_timeline.py)
sum ECHO's extra kernels, but those run on a side stream beside the main one and most of
their time is hidden; what a step pays is where the main chain waits. Cutting each trace
into layers at an anchor kernel (one launch per layer: the sparse MLA), taking each
engine's typical layer (its most common kernel sequence, median start and duration per
position) and aligning the two sequences by name shows the added kernels and the positions
where the second engine's drift behind the first jumps, each jump split by layer index,
with the streams the graph put them on.

    python -m benchmark.trace_layers A/trace.json.gz B/trace.json.gz --layers 8 [--out X.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from difflib import SequenceMatcher
from itertools import pairwise
from pathlib import Path

from benchmark.device_timeline import NAME_WIDTH, DeviceOp, load_chrome_trace

ANCHOR = "_sparse_mla_kernel"
JUMP_US = 1.0  # drift changes below this are launch jitter


@dataclass(frozen=True)
class Layer:
    """The device operations from one anchor launch to the next, and the layer's index in
    its step (anchor count modulo the step's layers)."""

    index: int
    ops: tuple[DeviceOp, ...]
    span_us: float  # to the next anchor's start

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(o.name for o in self.ops)

    def gap_before(self, position: int) -> float:
        """Idle time on the device before the op at ``position`` (its start minus the
        latest end of the ops before it)."""
        before = max(o.end_us for o in self.ops[:position])
        return self.ops[position].start_us - before


def cut_layers(ops: Sequence[DeviceOp], layers: int, anchor: str = ANCHOR) -> list[Layer]:
    """Every span from one anchor to the next (the last layer of a step runs into the next
    step's first and its sequence differs: :func:`typical_layer` leaves it out)."""
    at = [i for i, o in enumerate(ops) if o.name == anchor]
    return [
        Layer(n % layers, tuple(ops[a:b]), ops[b].start_us - ops[a].start_us)
        for n, (a, b) in enumerate(pairwise(at))
    ]


def typical_layer(cut: Sequence[Layer]) -> tuple[tuple[str, ...], list[dict], float]:
    """The most common kernel sequence, per position the median start (from the anchor's)
    and duration over the layers with that sequence, and their median span."""
    if not cut:
        raise ValueError(f"no layers: the trace has fewer than two {ANCHOR} launches")
    names, _ = Counter(layer.names for layer in cut).most_common(1)[0]
    same = [layer for layer in cut if layer.names == names]
    rows = []
    for p, name in enumerate(names):
        starts = [layer.ops[p].start_us - layer.ops[0].start_us for layer in same]
        row = {
            "name": name[:NAME_WIDTH],
            "start_us": round(statistics.median(starts), 2),
            "dur_us": round(statistics.median(layer.ops[p].dur_us for layer in same), 2),
        }
        rows.append(row)
    return names, rows, statistics.median(layer.span_us for layer in same)


def gap_by_layer(cut: Sequence[Layer], prefix: tuple[str, ...], layers: int) -> list[float | None]:
    """The median idle gap before the last op of ``prefix``, per layer index, over the
    layers that begin with ``prefix`` (the last layer of a step included)."""
    position = len(prefix) - 1
    out: list[float | None] = []
    for index in range(layers):
        gaps = [
            layer.gap_before(position)
            for layer in cut
            if layer.index == index and layer.names[: len(prefix)] == prefix
        ]
        out.append(round(statistics.median(gaps), 2) if gaps else None)
    return out


def stream_by_layer(cut: Sequence[Layer], name: str, layers: int) -> list[int | None]:
    """The stream ``name`` ran on most often, per layer index (CUDA graphs spread a
    captured fork and join over streams of their own: which one a chain lands on matters)."""
    out: list[int | None] = []
    for index in range(layers):
        seen = Counter(
            o.stream for layer in cut if layer.index == index for o in layer.ops if o.name == name
        )
        out.append(seen.most_common(1)[0][0] if seen else None)
    return out


def compare(base: Sequence[Layer], other: Sequence[Layer], layers: int) -> dict:
    """``other``'s typical layer against ``base``'s: kernels inserted or replaced, the
    drift (other's start minus base's at kernels both run) and where it jumps, with the
    gap before that kernel per layer index in each."""
    names_a, rows_a, span_a = typical_layer(base)
    names_b, rows_b, span_b = typical_layer(other)
    differs, jumps = [], []
    matcher = SequenceMatcher(a=names_a, b=names_b, autojunk=False)
    for op, i1, i2, j1, j2 in matcher.get_opcodes():
        if op != "equal":
            streams = {n: stream_by_layer(other, n, layers) for n in dict.fromkeys(names_b[j1:j2])}
            differs.append(
                {"op": op, "base": rows_a[i1:i2], "other": rows_b[j1:j2], "other_streams": streams}
            )
            continue
        drift = rows_b[j1]["start_us"] - rows_a[i1]["start_us"]
        for k in range(1, i2 - i1):
            now = rows_b[j1 + k]["start_us"] - rows_a[i1 + k]["start_us"]
            if abs(now - drift) >= JUMP_US:
                jumps.append(
                    {
                        "before": rows_a[i1 + k]["name"],
                        "position": i1 + k,
                        "jump_us": round(now - drift, 2),
                        "gap_by_layer_base": gap_by_layer(base, names_a[: i1 + k + 1], layers),
                        "gap_by_layer_other": gap_by_layer(other, names_b[: j1 + k + 1], layers),
                        "stream_by_layer_other": stream_by_layer(other, names_b[j1 + k], layers),
                    }
                )
            drift = now
    return {
        "anchor": ANCHOR,
        "layers": layers,
        "layers_cut": {"base": len(base), "other": len(other)},
        "typical_span_us": {
            "base": round(span_a, 2),
            "other": round(span_b, 2),
            "diff": round(span_b - span_a, 2),
        },
        "kernels_per_layer": {"base": len(names_a), "other": len(names_b)},
        "differs": differs,
        "drift_jumps": jumps,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("base", help="the baseline engine's trace (.json or .json.gz)")
    ap.add_argument("other", help="the engine compared with it")
    ap.add_argument("--layers", type=int, required=True, help="anchor launches per step")
    ap.add_argument("--out", default=None, help="write the comparison here as JSON")
    args = ap.parse_args()
    if args.layers < 1:
        ap.error(f"--layers must be >= 1, got {args.layers}")
    cuts = [cut_layers(load_chrome_trace(p)[0], args.layers) for p in (args.base, args.other)]
    try:
        report = compare(cuts[0], cuts[1], args.layers)
    except ValueError as e:  # a trace without the anchor kernel: not a decode of this model
        ap.error(str(e))
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
