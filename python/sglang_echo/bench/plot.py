"""``python -m sglang_echo.bench.plot RESULT_DIRS... [--out-dir D]``: ECHO-paper-style figures.

Reads ``req_rate_R.jsonl`` records (this project's bench_serving or SGLang's; the last
line of each file counts) from result folders laid out as the e2e scripts write them:
``<root>/{no-offload,offload}-MMDD/req_rate_R.jsonl`` and, per task,
``<root>/<mode>-MMDD/<task>/req_rate_R.jsonl``. A root folder (``infini-318``) expands to
its run folders. Writes:
  throughput_vs_rate.png  output token throughput vs request rate, one line per run (Fig. 12-13)
  per_task_throughput.png per-task bars at the highest request rate (Fig. 14)
  latency_vs_rate.png     TTFT, ITL and E2E latency vs request rate (Fig. 15)
  summary.json            the plotted numbers and the offload / no-offload ratios

Per run and rate, summary.json holds the record's throughput and latency figures, its
``steady_output_throughput`` (bench.metrics: between the first tenth's and nine tenths' completions), the
server's ``served_efficiency`` and ``mean_decode_batch`` and ECHO's counters over the run
(``echo_hit_rate``, ``echo_hits``, ``echo_misses``, ``echo_evictions``,
``echo_recalled_bytes``): None where a record lacks them (no ECHO, an older server, SGLang's
client). ``offload_over_no_offload_output_throughput`` is the offload / no-offload ratio of
whole-run output throughput per group and rate; ``steady_ratio`` the same ratio of steady
output throughput, at the rates where both runs have one.

``--record PATH`` writes, instead of summary.json, the sweep's record: {name, device, date,
command (this command as run), sweeps (the commands that wrote the inputs, from
``--sweep-command``), config (each ``--config`` file's lines), metrics (what summary.json
holds)}. The device is read from the ``--config`` files (``serving_sweep.sh`` writes the
GPU's nvidia-smi line there), the date from ``--date`` (the day the sweeps ran; default
today). That is how the runs of several sweeps over one model and config are merged into one
record by a command instead of by hand.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shlex
import sys
import time
from pathlib import Path

RATE_FILE = re.compile(r"^req_rate_(.+)\.jsonl$")
RUN_NAME = re.compile(r"^(no-offload|offload)(?:-.*)?$")


def _rate(text: str) -> float:
    return math.inf if text.lower() in ("inf", "infinity") else float(text)


def read_run(folder: Path) -> dict[float, dict]:
    """{request rate: last record} of one run folder."""
    out = {}
    for f in folder.iterdir():
        m = RATE_FILE.match(f.name)
        if not m or not f.is_file():
            continue
        lines = [ln for ln in f.read_text().splitlines() if ln.strip()]
        if lines:
            out[_rate(m.group(1))] = json.loads(lines[-1])
    return dict(sorted(out.items()))


def _label(folder: Path) -> str:
    """no-offload-1129 -> no-offload; anything else keeps its name."""
    m = RUN_NAME.match(folder.name)
    return m.group(1) if m else folder.name


def discover(paths: list[Path]) -> tuple[dict[str, dict], dict[str, dict[str, dict]]]:
    """-> (runs: label -> rate -> record, tasks: label -> task -> rate -> record)."""
    runs: dict[str, dict] = {}
    tasks: dict[str, dict[str, dict]] = {}

    def visit(folder: Path, depth: int, group: str = "") -> None:
        name = f"{group} {_label(folder)}".strip()
        direct = read_run(folder)
        if direct:
            runs[_unique(runs, name)] = direct
            return
        subs = sorted(p for p in folder.iterdir() if p.is_dir())
        if any(RUN_NAME.match(p.name) for p in subs):  # a root such as infini-318/
            for p in subs:
                visit(p, depth - 1, folder.name if len(paths) > 1 else "")
            return
        per_task = {p.name: read_run(p) for p in subs}
        per_task = {k: v for k, v in per_task.items() if v}
        if per_task:
            tasks[_unique(tasks, name)] = per_task
            return
        if depth > 0:
            for p in subs:
                visit(p, depth - 1)

    for p in paths:
        if not p.is_dir():
            raise SystemExit(f"error: {str(p)!r} is not a folder")
        visit(p, 2)
    return runs, tasks


def _unique(d: dict, key: str) -> str:
    if key not in d:
        return key
    i = 2
    while f"{key}#{i}" in d:
        i += 1
    return f"{key}#{i}"


def _x_positions(rates: list[float]) -> tuple[list[float], list[str], float]:
    """Finite rates at their value; inf one step past the largest."""
    finite = [r for r in rates if math.isfinite(r)]
    top = max(finite) if finite else 1.0
    step = (top / max(1, len(finite))) if finite else 1.0
    inf_x = top + step
    return [r if math.isfinite(r) else inf_x for r in rates], [_fmt(r) for r in rates], inf_x


def _fmt(rate: float) -> str:
    return "inf" if not math.isfinite(rate) else f"{rate:g}"


def _color(label: str) -> str | None:
    if label.endswith("no-offload"):
        return "tab:blue"
    return "tab:red" if label.endswith("offload") else None


def _linestyle(label: str, labels: list[str]) -> str:
    """One line style per result group (e.g. infini-318 vs sharegpt-100)."""
    groups = sorted({name.rpartition(" ")[0] for name in labels})
    return ["-", "--", ":", "-."][groups.index(label.rpartition(" ")[0]) % 4]


def plot_throughput(runs: dict[str, dict], out: Path, plt) -> Path:
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    all_rates = sorted({r for recs in runs.values() for r in recs})
    xs, labels, _ = _x_positions(all_rates)
    pos = dict(zip(all_rates, xs, strict=True))
    for label, recs in runs.items():
        rates = list(recs)
        ax.plot(
            [pos[r] for r in rates],
            [recs[r]["output_throughput"] for r in rates],
            marker="o",
            label=label,
            color=_color(label),
            linestyle=_linestyle(label, list(runs)),
        )
    ax.set_xticks(xs, labels)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("output throughput (tok/s)")
    ax.set_title("Generation throughput vs request rate")
    ax.grid(alpha=0.3)
    ax.legend()
    path = out / "throughput_vs_rate.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_latency(runs: dict[str, dict], out: Path, plt) -> Path:
    metrics = [
        ("median_ttft_ms", "TTFT (ms, median)"),
        ("median_itl_ms", "ITL (ms, median)"),
        ("median_e2e_latency_ms", "E2E latency (ms, median)"),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    all_rates = sorted({r for recs in runs.values() for r in recs})
    xs, labels, _ = _x_positions(all_rates)
    pos = dict(zip(all_rates, xs, strict=True))
    for ax, (key, title) in zip(axes, metrics, strict=True):
        for label, recs in runs.items():
            rates = [r for r in recs if key in recs[r]]
            ax.plot(
                [pos[r] for r in rates],
                [recs[r][key] for r in rates],
                marker="o",
                label=label,
                color=_color(label),
                linestyle=_linestyle(label, list(runs)),
            )
        ax.set_xticks(xs, labels)
        ax.set_xlabel("request rate (req/s)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend()
    path = out / "latency_vs_rate.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_tasks(tasks: dict[str, dict[str, dict]], out: Path, plt) -> tuple[Path, dict]:
    names = sorted({t for per in tasks.values() for t in per})
    labels = list(tasks)
    width = 0.8 / max(1, len(labels))
    fig, ax = plt.subplots(figsize=(max(6.4, 1.3 * len(names)), 4.0))
    table: dict = {}
    for i, label in enumerate(labels):
        values = []
        for name in names:
            recs = tasks[label].get(name, {})
            top = max(recs) if recs else None
            v = recs[top]["output_throughput"] if top is not None else 0.0
            values.append(v)
            table.setdefault(name, {})[label] = {"rate": _fmt(top) if top else None, "tok_s": v}
        ax.bar(
            [j + i * width for j in range(len(names))],
            values,
            width,
            label=label,
            color=_color(label),
        )
    ax.set_xticks([j + width * (len(labels) - 1) / 2 for j in range(len(names))], names)
    ax.set_ylabel("output throughput (tok/s)")
    ax.set_title("Per-task throughput at the highest request rate")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path = out / "per_task_throughput.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path, table


def _ratios(runs: dict[str, dict], key: str = "output_throughput") -> dict:
    """Offload / no-offload ``key`` per rate, for each pair of the same group (the rates
    where both runs have it)."""
    out = {}
    for name, off in runs.items():
        if not name.endswith("offload") or name.endswith("no-offload"):
            continue
        base = runs.get(name[: -len("offload")] + "no-offload")
        if base is None:
            continue
        out[name[: -len("offload")].strip() or "all"] = {
            _fmt(r): off[r][key] / base[r][key]
            for r in off
            if r in base and base[r].get(key) and off[r].get(key) is not None
        }
    return out


RUN_FIELDS = (
    "output_throughput",
    "request_throughput",
    "median_ttft_ms",
    "median_itl_ms",
    "median_e2e_latency_ms",
    "p99_ttft_ms",
    "p99_itl_ms",
    "completed",
    "steady_output_throughput",
    "served_efficiency",
    "mean_decode_batch",
)
ECHO_FIELDS = ("hit_rate", "hits", "misses", "evictions", "recalled_bytes")


def run_metrics(rec: dict) -> dict:
    """One run's figures at one rate for summary.json (None where the record lacks one)."""
    echo = rec.get("server_echo") or {}
    return {
        **{k: rec.get(k) for k in RUN_FIELDS},
        **{f"echo_{k}": echo.get(k) for k in ECHO_FIELDS},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sglang_echo.bench.plot", description=__doc__)
    p.add_argument("result_dirs", nargs="+", type=Path)
    p.add_argument("--out-dir", type=Path, default=None, help="default: plots/ in the cwd")
    p.add_argument("--record", type=Path, default=None, help="write the sweep record here")
    p.add_argument(
        "--config", type=Path, action="append", default=[], help="a sweep's sweep_config.txt"
    )
    p.add_argument(
        "--sweep-command",
        action="append",
        default=[],
        help="a command that wrote the inputs (recorded as given)",
    )
    p.add_argument("--date", default=None, help="YYYY-MM-DD the sweeps ran (default: today)")
    args = p.parse_args(argv)
    if args.record is not None and not args.config:
        p.error("--record needs --config (the device is read from it)")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, tasks = discover(args.result_dirs)
    if not runs and not tasks:
        print("error: no req_rate_*.jsonl results under the given folders", file=sys.stderr)
        return 2
    out = args.out_dir or Path("plots")
    out.mkdir(parents=True, exist_ok=True)
    written = []
    summary: dict = {}
    if runs:
        written.append(plot_throughput(runs, out, plt))
        written.append(plot_latency(runs, out, plt))
        summary["runs"] = {
            label: {_fmt(r): run_metrics(rec) for r, rec in recs.items()}
            for label, recs in runs.items()
        }
        summary["offload_over_no_offload_output_throughput"] = _ratios(runs)
        summary["steady_ratio"] = _ratios(runs, "steady_output_throughput")
    if tasks:
        path, table = plot_tasks(tasks, out, plt)
        written.append(path)
        summary["tasks"] = table
    if args.record is None:
        target = out / "summary.json"
        target.write_text(json.dumps(summary, indent=2))
    else:
        target = args.record
        record = sweep_record(summary, args, argv if argv is not None else sys.argv[1:])
        target.write_text(json.dumps(record, indent=2) + "\n")
    for w in [*written, target]:
        print(f"wrote {w}")
    return 0


# nvidia-smi's "name, memory" line, or "device: NAME" where there is no GPU (a CPU check).
GPU_LINE = re.compile(r"^(?:(?P<name>[^,]+), \d+ MiB|device: (?P<other>\S.*))$")


def sweep_record(summary: dict, args: argparse.Namespace, argv: list[str]) -> dict:
    """The record of the sweeps whose results ``summary`` holds (see ``--record``)."""
    configs = []
    devices = set()
    for path in args.config:
        lines = path.read_text().splitlines()
        configs.append({"file": str(path), "lines": lines})
        devices.update(m["name"] or m["other"] for ln in lines if (m := GPU_LINE.match(ln.strip())))
    if len(devices) != 1:
        raise SystemExit(f"error: the --config files name {len(devices)} GPUs: {sorted(devices)}")
    return {
        "name": "serving_sweep",
        "device": devices.pop(),
        "date": args.date or time.strftime("%Y-%m-%d"),
        "command": shlex.join(["python", "-m", "sglang_echo.bench.plot", *argv]),
        "sweeps": list(args.sweep_command),
        "config": configs,
        "metrics": summary,
    }


if __name__ == "__main__":
    raise SystemExit(main())
