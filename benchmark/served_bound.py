"""The best a served rate-inf run of this workload could do: its measured bound.

Why: ``served_over_study`` compares a finite served run with the study's full-batch steady
state. A served run cannot be at full batch all the time: at rate inf every prompt is sent
at once, but a decode node can only decode a request once its KV has arrived (the ramp),
and the last requests finish at ever smaller batches (the drain). Neither is the server's
fault, and both weigh more on ECHO, whose batch is larger. This replays the run's own
workload on an ideal scheduler, built only from what the run measured:

- every prompt present at t=0, its KV arriving one prompt after another, each in the run's
  mean transfer time (``transfer_seconds / transfers``);
- a request admitted the moment its KV is in and a place is free, up to the most requests
  the engine held at once in the run (its memory bound, from the sampled counters);
- each decode step taking the run's own device time at that batch (a line fitted to the
  device ms per step by batch, weighted by steps: few steps at a batch make a noisy mean),
  with no host time between steps, and each request needing ``output_len - 1`` steps (the
  first token arrives with the KV).

Its output throughput per engine, their ratio (``ideal_ratio``), that ratio over the study's
(``bound_over_study``: what ``served_over_study`` can reach on this workload) and the served
ratio over it (``served_over_bound``: how close the server came; per engine ``served_over_ideal``, its
served throughput over its ideal one), beside the same with every KV in place at t=0
(``no_ramp``: the drain alone). The transfer time is each prompt's start-to-arrival, so it
includes any wait behind the transfers before it: where transfers overlap, the ramp here
is slower than the hardware's.

    python3 benchmark/served_bound.py --record benchmark/results/served_vs_study --out DIR
"""

from __future__ import annotations

import sys
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script

from benchmark.analysis_record import analysis_args, analysis_record, write_record

ENGINES = ("no-offload", "offload")


def step_line(run: dict) -> tuple[float, float] | None:
    """(ms at batch 0, ms per extra request) of the run's device time per decode step,
    least squares weighted by the steps at each batch; None without the counters."""
    secs = run.get("decode_device_seconds_by_batch") or {}
    steps = run.get("decode_device_steps_by_batch") or {}
    pts = [(int(b), 1e3 * secs[b] / n, n) for b, n in steps.items() if n > 0 and b in secs]
    weight = sum(w for _, _, w in pts)
    if not weight:
        return None
    mean_b = sum(b * w for b, _, w in pts) / weight
    mean_ms = sum(ms * w for _, ms, w in pts) / weight
    spread = sum(w * (b - mean_b) ** 2 for b, _, w in pts)
    slope = sum(w * (b - mean_b) * (ms - mean_ms) for b, ms, w in pts) / spread if spread else 0.0
    return mean_ms - slope * mean_b, slope


def held_at_most(run: dict) -> int | None:
    """The most requests the engine held at once (running, sampled), rounded."""
    series = run.get("counter_series") or {}
    cols = series.get("columns") or []
    if "running" not in cols or not series.get("rows"):
        return None
    i = cols.index("running")
    held = [row[i] for row in series["rows"] if row[i] is not None]
    return round(max(held)) if held else None


def replay(
    outputs: list[int], arrival_s: float, cap: int, line: tuple[float, float]
) -> tuple[float, float]:
    """(seconds, mean decode batch) of the ideal schedule: FIFO, KV arriving one prompt
    after another every ``arrival_s`` from t=0, at most ``cap`` decoding at once."""
    base, per = line
    left = deque(max(o - 1, 0) for o in outputs)
    ready_at = deque((i + 1) * arrival_s for i in range(len(outputs)))
    running: list[int] = []
    now, steps, batch_sum = 0.0, 0, 0
    while left or running:
        while left and len(running) < cap and ready_at[0] <= now:
            ready_at.popleft()
            need = left.popleft()
            if need:
                running.append(need)
        if not running:
            if left:
                now = max(now, ready_at[0])
            continue
        now += (base + per * len(running)) / 1e3
        steps += 1
        batch_sum += len(running)
        running = [n - 1 for n in running if n > 1]
    return now, (batch_sum / steps if steps else 0.0)


def engine_bound(run: dict, ramp: bool = True) -> dict | None:
    """One engine's ideal schedule on its run's workload; None without the counters."""
    line, cap = step_line(run), held_at_most(run)
    eng = run.get("server_engine") or {}
    outputs = run.get("output_lens") or []
    transfers = eng.get("transfers")
    if line is None or not cap or not outputs or not transfers:
        return None
    arrival_s = eng.get("transfer_seconds", 0.0) / transfers if ramp else 0.0
    seconds, batch = replay(outputs, arrival_s, cap, line)
    if seconds <= 0:
        return None
    ideal = sum(outputs) / seconds
    served = run.get("output_throughput")
    return {
        "output_tok_per_s": round(ideal, 1),
        "served_over_ideal": round(served / ideal, 4) if served else None,
        "mean_decode_batch": round(batch, 2),
        "held_at_most": cap,
        "arrival_ms": round(1e3 * arrival_s, 2),
        "step_ms_line": [round(line[0], 4), round(line[1], 4)],
    }


def bound(
    runs_inf: dict[str, dict], study_ratio: float | None, served_ratio: float | None
) -> dict | None:
    """Both engines' ideal schedules at rate inf and what they bound (module docstring)."""
    out: dict = {}
    for name, ramp in (("with_ramp", True), ("no_ramp", False)):
        per = {e: engine_bound(runs_inf.get(e) or {}, ramp) for e in ENGINES}
        if not all(per.values()):
            return None
        ideal = per["offload"]["output_tok_per_s"] / per["no-offload"]["output_tok_per_s"]
        out[name] = {
            "engines": per,
            "ideal_ratio": round(ideal, 4),
            "bound_over_study": round(ideal / study_ratio, 4) if study_ratio else None,
            "served_over_bound": round(served_ratio / ideal, 4) if served_ratio else None,
        }
    return out


def main(argv: list[str] | None = None) -> dict:
    ap, args, source = analysis_args(
        __doc__,
        "served_vs_study.json",
        "a served_vs_study folder: served_vs_study.json and sweep/infini/<engine>/req_rate_inf.jsonl",
        argv,
    )
    # here, not at the top: served_vs_study imports this module for its own record
    from benchmark.served_vs_study import runs_of

    runs = {}
    for eng in ENGINES:
        inf = runs_of(args.record / "sweep", eng).get("inf")
        if not inf:
            ap.error(f"{args.record}/sweep/infini/{eng}: no rate-inf run (req_rate_inf.jsonl)")
        runs[eng] = inf
    m = source.get("metrics", {})
    result = bound(runs, m.get("study_ratio"), m.get("served_ratio_inf"))
    if result is None:
        ap.error(
            f"{args.record}: its runs lack the counters this needs (counter_series, step times by batch)"
        )
    metrics = {
        "study_ratio": m.get("study_ratio"),
        "served_ratio_inf": m.get("served_ratio_inf"),
        "served_over_study": m.get("served_over_study"),
        **result,
    }
    record = analysis_record(
        "served_bound", "benchmark/served_bound.py", argv, args, source, metrics
    )
    return write_record(args.out, record, record["metrics"])


if __name__ == "__main__":
    main()
