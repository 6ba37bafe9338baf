"""A/B of two versions of kernels/alloc.py on one GPU, interleaved round by round, to tell a
code change from the run-to-run spread of cache_ops_bench.py's single-series medians.

The other version is a file (e.g. an earlier commit's alloc.py, written by
``git show COMMIT:python/sglang_echo/kernels/alloc.py > .harness/alloc_COMMIT.py``: no
git on the GPU machine) loaded as its own module and swapped into the manager for its
turns. Cases: the resolve's cache management per layer-step (cache_ops_bench.measure,
graph-replayed) at batch 1 without eviction (the one-program path), the same forced past
the one program (the workspace's ``one_program_lanes`` set to 0: the look-back launches
now, the five-launch pipeline in versions before 2026-12-03; the case keeps its name
``..._pipeline``), and batch 48 on a full cache. Each version is checked exact against the
torch reference first.

    python benchmark/kernels/alloc_ab.py --other .harness/alloc_617151e.py --label 617151e --out OUT
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cache_ops_bench as bench

import sglang_echo.kernels.alloc as current_alloc
import sglang_echo.offload.manager as manager_module

CASES = {  # name: (batch, full cache, one_program_lanes; None = the module's default)
    "batch_1_no_eviction": (1, False, None),
    "batch_1_no_eviction_pipeline": (1, False, 0),
    "batch_48_full": (48, True, None),
}


def load_module(path: str):
    spec = importlib.util.spec_from_file_location("alloc_other", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def use(module) -> None:
    """Route the manager's and the bench's allocation through ``module``."""
    for name in ("Allocation", "AllocWorkspace", "allocate_kernel", "allocate_reference"):
        setattr(manager_module, name, getattr(module, name))
    bench.AllocWorkspace = module.AllocWorkspace


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--other", required=True, help="path of the other alloc.py")
    ap.add_argument("--label", required=True, help="what the other version is (a commit)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("alloc_ab.py times graph replays: it needs a GPU")
    dev = torch.device("cuda")
    versions = {"current": current_alloc, args.label: load_module(args.other)}
    base = argparse.Namespace(topk=2048, slots=260_000, context=16_384, reuse=0.97,
                              eviction_reserve=None, steps=40)  # fmt: skip
    traces, exact = {}, {}
    for case, (batch, _fill, _lanes) in CASES.items():
        a = argparse.Namespace(**{**vars(base), "batch": batch})
        traces[case] = (a, bench.make_trace(a.steps, batch, a.topk, a.context, a.reuse).to(dev))
    for name, module in versions.items():
        use(module)
        a, tr = traces["batch_48_full"]
        exact[name] = bench.shape_is_exact(a, dev, tr, {}, steps=4)
    times: dict = {case: {name: [] for name in versions} for case in CASES}
    for r in range(args.rounds):
        order = list(versions) if r % 2 == 0 else list(reversed(versions))
        for name in order:
            use(versions[name])
            for case, (_batch, fill, lanes) in CASES.items():
                a, tr = traces[case]
                shape = {} if lanes is None else {"one_program_lanes": lanes}
                timed = bench.measure(a, dev, tr, True, "resolve", shape or None, fill)
                times[case][name].append(timed["us"])
        print(f"round {r + 1}: " + json.dumps({c: {n: round(v[-1], 2) for n, v in t.items()}
                                                for c, t in times.items()}), flush=True)  # fmt: skip
    use(current_alloc)
    summary = {}
    for case, by_version in times.items():
        row = {}
        for name, values in by_version.items():
            row[name] = {"median_us": statistics.median(values), "min_us": min(values),
                         "max_us": max(values), "rounds": values}  # fmt: skip
        other = row[args.label]["median_us"]
        row["current_over_other"] = row["current"]["median_us"] / other
        summary[case] = row
        print(f"{case}: current {row['current']['median_us']:.2f} us "
              f"[{row['current']['min_us']:.2f}, {row['current']['max_us']:.2f}] vs {args.label} "
              f"{other:.2f} us [{row[args.label]['min_us']:.2f}, {row[args.label]['max_us']:.2f}]")  # fmt: skip
    record = {
        "name": "alloc_ab",
        "command": "python " + " ".join(sys.argv),
        "device": torch.cuda.get_device_name(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "metrics": {"exact": exact, "cases": summary},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "alloc_ab.json").write_text(json.dumps(record, indent=2) + "\n")
    return 0 if all(exact.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
