"""Fold the ``itl_ab`` stage's probe clocks (benchmark/decode_node_probe.py, one JSON per arm
and round) into one record: per batch and arm the device and decode-only wall ms per step
over the rounds, and each arm over a base arm of the same batch.

Why: an A/B of an ECHO switch is read from several folders (one per batch size, often one
per device call) whose files carry no command; the record keeps the runs' numbers beside
the command that measured them, the spread of each arm, and the ratio a decision rests on.
The decode-only wall leaves out the prompts' arrival (the ``admit`` and ``receive``
phases), which is time to first token, not inter-token latency: the measure at batch 1,
where the one prompt arrives before any step. With several prompts, arrivals interleave
with decode steps and the engine's receive time overlaps the GPU's; there the whole run's
wall per step is the one to read (both are kept).

    python3 benchmark/itl_ab_summary.py --runs DIR [DIR ...] --out FILE \\
        --measured-by "AB_BATCH=16 ... bash benchmark/device_session.sh OUTDIR itl_ab" \\
        --commit SHA --runs-commit SHA [--device NAME] [--base echo]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script

from benchmark.analysis_record import command_line, write_record

KEYS = ("device_ms_per_step", "decode_wall_ms_per_step", "wall_ms_per_step")
ROUND_FILE = re.compile(r"^(?P<arm>.+)_(?P<round>\d+)\.json(\.txt)?$")


def decode_wall_ms(clock: dict) -> float:
    """Wall ms per decode step without the arrivals (admit + receive phases)."""
    phases = clock["phase_s"]
    wall = clock["seconds"] - phases.get("admit", 0.0) - phases.get("receive", 0.0)
    return 1e3 * wall / clock["decode_steps"]


def load_runs(folders: list[Path]) -> dict[int, dict[str, list[dict]]]:
    """{batch: {arm: [clock, ...]}} from ``ARM_ROUND.json`` files (``.json.txt`` as
    committed logs); a clock without a device time (no graphs, the CPU) is refused."""
    runs: dict[int, dict[str, list[dict]]] = {}
    for folder in folders:
        files = sorted(p for p in folder.iterdir() if ROUND_FILE.match(p.name))
        if not files:
            raise SystemExit(f"{folder} holds no ARM_ROUND.json clocks of the itl_ab stage")
        for path in files:
            clock = json.loads(path.read_text())
            if not clock.get("device_ms_per_step"):
                raise SystemExit(f"{path} has no device_ms_per_step: not a CUDA-graph run")
            arm = ROUND_FILE.match(path.name)["arm"]
            runs.setdefault(int(clock["num_prompts"]), {}).setdefault(arm, []).append(clock)
    return runs


def _spread(values: list[float]) -> dict:
    med = statistics.median(values)
    return {
        "median": round(med, 4),
        "range": [round(min(values), 4), round(max(values), 4)],
        "spread": round((max(values) - min(values)) / med, 4),
    }


def summarize(runs: dict[int, dict[str, list[dict]]], base: str) -> dict:
    """Per batch: each arm's rounds, device and decode-only wall ms per step (median, range,
    spread = range / median) and, where the base arm ran, its medians over the base's."""
    out: dict[str, dict] = {}
    for batch in sorted(runs):
        arms = runs[batch]
        row: dict[str, dict] = {"arms": {}}
        for arm in sorted(arms):
            clocks = arms[arm]
            row["arms"][arm] = {
                "rounds": len(clocks),
                "device_ms_per_step": _spread([c["device_ms_per_step"] for c in clocks]),
                "decode_wall_ms_per_step": _spread([decode_wall_ms(c) for c in clocks]),
                "wall_ms_per_step": _spread([c["wall_ms_per_step"] for c in clocks]),
            }
        if base in row["arms"]:
            b = row["arms"][base]
            row[f"over_{base}"] = {
                arm: {key: round(a[key]["median"] / b[key]["median"], 4) for key in KEYS}
                for arm, a in row["arms"].items()
                if arm != base
            }
        out[str(batch)] = row
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument("--runs", nargs="+", required=True, type=Path, help="itl_ab folders")
    ap.add_argument("--out", required=True, type=Path, help="the record to write (JSON)")
    ap.add_argument("--base", default="echo", help="the arm the others are divided by")
    ap.add_argument("--measured-by", required=True, help="the device command(s) of the runs")
    ap.add_argument(
        "--device", default=None, help="the machine the runs ran on (default: the clocks')"
    )
    ap.add_argument("--runs-commit", required=True, help="the sha the runs ran on, literally")
    ap.add_argument("--commit", default="", help="the sha this summary ran on, literally")
    args = ap.parse_args(argv)
    runs = load_runs(args.runs)
    named = {c.get("device") for arms in runs.values() for cs in arms.values() for c in cs}
    named.discard(None)
    if args.device is None and len(named) != 1:
        ap.error(f"the clocks name devices {sorted(named)}; say which with --device")
    device = args.device or next(iter(named))
    if named - {device}:
        ap.error(f"--device {device!r} but the clocks name {sorted(named)}")
    record = {
        "name": "itl_ab_summary",
        "commit": args.commit,
        "device": device,
        "date": time.strftime("%Y-%m-%d"),
        "command": command_line("benchmark/itl_ab_summary.py", argv),
        "source": {"commit": args.runs_commit, "command": args.measured_by},
        "metrics": {"base": args.base, "by_batch": summarize(runs, args.base)},
    }
    return write_record(args.out, record, record["metrics"])


if __name__ == "__main__":
    main()
