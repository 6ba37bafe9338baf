"""Figure 14's task mixes over several runs: each task's ECHO / no-offload output throughput
per run, with its median, minimum and maximum, and each run's first token per backend.

Why: a task run lasts one to four seconds (32 prompts of ~100K tokens, 5-40 output tokens
each), so its throughput is mostly the prompts' arrival, and one run cannot tell an effect
from the spread (two runs of the same runtime differed by far more than any code change:
PROVENANCE's `e2e_sweep_tasks/` row). The earliest first token of a run (``first_token_s``)
shows a stall at its start, which is where those two runs differed. The device stage
``tasks_repeats`` runs the tasks sweep several times and writes this record over its runs.

    python3 benchmark/task_spread.py --runs RUN_DIR [RUN_DIR ...] --out FILE --commit SHA

Each RUN_DIR is an ``e2e_sweep.sh`` output of ``TASKS=1`` (its ``e2e_sweep.json`` and
``tasks/<backend>/<task>/req_rate_<rate>.jsonl``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script

from benchmark.analysis_record import command_line, write_record

BACKENDS = ("no-offload", "offload")


def run_tasks(run_dir: Path) -> dict[str, dict[str, dict]]:
    """One run's ``metrics.tasks`` (task -> backend -> rate and tok/s), each entry with the
    earliest first token of its requests, read from the run's bench output."""
    record_file = run_dir / "e2e_sweep.json"
    if not record_file.is_file():
        raise ValueError(f"{record_file} does not exist: --runs names tasks sweep folders")
    tasks = json.loads(record_file.read_text()).get("metrics", {}).get("tasks")
    if not tasks:
        raise ValueError(f"{record_file} has no task mixes (a sweep run with TASKS=1 has)")
    out: dict[str, dict[str, dict]] = {}
    for task, per_backend in tasks.items():
        missing = [b for b in BACKENDS if not (per_backend.get(b) or {}).get("tok_s")]
        if missing:
            raise ValueError(f"{record_file}: task {task} has no throughput for {missing}")
        out[task] = {}
        for backend in BACKENDS:
            entry = dict(per_backend[backend])
            entry["first_token_s"] = first_token_s(run_dir, backend, task, entry.get("rate"))
            out[task][backend] = entry
    return out


def first_token_s(run_dir: Path, backend: str, task: str, rate: str | None) -> float | None:
    """The smallest time to first token among the run's requests (None without its file)."""
    bench = run_dir / "tasks" / backend / task / f"req_rate_{rate}.jsonl"
    if not bench.is_file():
        return None
    lines = [ln for ln in bench.read_text().splitlines() if ln.strip()]
    ttfts = json.loads(lines[-1]).get("ttfts") if lines else None
    return round(min(ttfts), 4) if ttfts else None


def spread(runs: list[dict[str, dict[str, dict]]]) -> dict[str, dict]:
    """Per task (those every run has): the ratio per run and its median, min and max."""
    common = set(runs[0]).intersection(*runs[1:])
    out: dict[str, dict] = {}
    for task in sorted(common):
        ratios = [r[task]["offload"]["tok_s"] / r[task]["no-offload"]["tok_s"] for r in runs]
        out[task] = {
            "ratio_per_run": [round(x, 4) for x in ratios],
            "median": round(statistics.median(ratios), 4),
            "min": round(min(ratios), 4),
            "max": round(max(ratios), 4),
            "first_token_s_per_run": {
                b: [r[task][b]["first_token_s"] for r in runs] for b in BACKENDS
            },
        }
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--runs", required=True, nargs="+", type=Path, help="tasks sweep folders")
    ap.add_argument("--out", required=True, type=Path, help="the file to write (JSON)")
    ap.add_argument("--commit", default="", help="the sha the runs ran on, literally")
    ap.add_argument("--command", default="", help="the device command that made the runs")
    args = ap.parse_args(argv)
    try:
        runs = [run_tasks(d) for d in args.runs]
    except ValueError as e:
        ap.error(str(e))
    first = json.loads((args.runs[0] / "e2e_sweep.json").read_text())
    record = {
        "name": "task_spread",
        "commit": args.commit,
        "device": first.get("device"),
        "date": first.get("date"),
        "command": args.command or command_line("benchmark/task_spread.py", argv),
        "runs": [str(d) for d in args.runs],
        "metrics": {"repeats": len(runs), "tasks": spread(runs)},
    }
    return write_record(args.out, record, record["metrics"])


if __name__ == "__main__":
    main()
