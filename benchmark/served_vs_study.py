"""The served system against the engine, from one device call: the in-process study's
ratio at the paper's setting beside the served Figure-12 sweep's, and what the server does
with the engine's time (issue: "served at engine speed").

Reads the study's record (``e2e_study.json``) and the sweep's per-rate runs
(``infini/{no-offload,offload}/req_rate_R.jsonl``) made in the same call, and writes
``served_vs_study.json``: ``metrics`` holds

- ``study_ratio`` (ECHO / no-offload, in process), ``served_ratio_inf`` (through HTTP at rate
  inf) and ``served_over_study`` (goal >= 0.90);
- ``steady_ratio_inf``: the same ratio over each run's steady window (10%-90% of
  completions), and each engine's ``mean_decode_batch``;
- ``itl_p50_ratio_rate1`` (ECHO's median inter-token latency over no-offload's at rate 1,
  where nothing needs offloading; goal <= 1.02);
- ``decode_step_ratio_rate1_by_batch``: at rate 1, ECHO's device ms per decode step over
  no-offload's, per batch (the part of the ITL ratio the device step explains);
- ``echo_served_efficiency`` / ``no_offload_served_efficiency`` at rate inf: the decode
  steps' device time (CUDA events) over the run's wall time (goals >= 0.90 / 0.93);
- ``served_hit_rate`` and ``study_hit_rate`` (should agree within 0.01); the study counts
  full-batch steps after a warm-up and fill (and the workload's locality grows as requests
  decode), the whole run counts every arrival's first steps and the ramp and drain, so
  ``study_hit_rate_from_admission`` counts the study's steps from admission on, and
  ``served_hit_rate_steady`` (and each engine's ``mean_decode_batch_steady_inf``) takes the servers' counters sampled during the run
  (``bench_serving --poll-counters-s``; the stage sets ``POLL_COUNTERS_S=0.5``) over its
  steady window;
- ``study_hit_rate_at_served_ages``: the study's hit rate over the steps its requests
  had lived at the served ECHO requests' ages (``hit_rate_at_ages``), the like-for-like
  figure beside ``served_hit_rate``;
- ``admission_ms_p50`` (engine-thread ms per admission on the ECHO server; goal <= 2) and
  its per-run mean, and ``admission_ms_parts_inf``: that mean by part at rate inf (the
  table row, then the transfer start's locations, upload, seed, ECHO's slots, submission);
- ``graph_captures_during_run`` (both servers, all runs; goal 0), and
  ``triton_compiles_during_run``: the Triton specializations they compiled during the runs
  (runtime/jit_watch.py; goal 0; None from servers without the counter);
- ``outputs_equal``: every request's greedy tokens equal between the two servers, at
  every rate, ``outputs_equal_by_rate`` (rate -> [equal, compared]) and each server's
  ``server_schedule`` (overlap, engine process; None from records made before it);
- ``outputs_equal_across_rates``: per engine, [equal, compared] between its lowest rate
  and rate inf (the same prompts at another batch composition);
- ``latency``: TTFT and ITL p50 / p99 of both engines at every rate;
- ``throughput_factors``: per engine, served output throughput at rate inf over the study's
  full-batch device throughput, taken apart: ``batch`` (served mean decode batch / the
  study's), ``step`` (the study's device ms per step / the served one's), ``efficiency``
  (device time of decode steps / wall), their ``product``, and ``measured``; where the
  served ratio loses against the study's, these say which factor and on which engine;
  and the requests a decode step had beside it on average (``served_running``: admitted,
  ``served_arriving``: admitted with their KV still arriving, ``served_waiting``: not
  admitted) with the free token locations (``served_free_tokens``): a small batch with
  few running and few free tokens is memory, with many arriving is the arrivals;
- ``ingress_inf``: per engine, when its rate-inf prompts had reached the engine (half, all),
  from the counters sampled during the run (``ingress``).
- ``schedule_bound_inf``: the rate-inf workload replayed on an ideal scheduler built from
  the run's own measurements (benchmark/served_bound.py): the ratio it reaches, that over
  the study's (the most ``served_over_study`` can be on this workload) and the served
  ratio over it; None without the counters.
- ``batch_limits_inf``: per engine, its rate-inf decode steps split by what held the batch
  back, from the counters sampled during the run (``batch_limits``): none waiting, waiting
  but short of memory, or waiting with room (admission, arrivals);
plus ``commit`` (as given: the sha, literally), ``device``, ``date`` and ``command``.

    python3 -m benchmark.served_vs_study --study DIR --sweep DIR --out FILE --commit SHA
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from benchmark.analysis_record import write_record
from benchmark.served_bound import ENGINES
from benchmark.served_bound import bound as schedule_bound


def runs_of(sweep: Path, engine: str) -> dict[str, dict]:
    """rate -> the last record of that rate's jsonl."""
    out: dict[str, dict] = {}
    for f in sorted((sweep / "infini" / engine).glob("req_rate_*.jsonl")):
        lines = [ln for ln in f.read_text().splitlines() if ln.strip()]
        if lines:
            out[f.stem.removeprefix("req_rate_")] = json.loads(lines[-1])
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


def equal_by_rate(runs: dict[str, dict[str, dict]]) -> dict[str, list[int]] | None:
    """rate -> [requests whose token ids are equal on both servers, requests compared]
    (None: a run without ids). Why per rate: the servers' batches differ most at rate inf,
    and bf16 GEMMs round by batch shape, so a difference there and none at rate 1 says
    where it comes from."""
    out: dict[str, list[int]] = {}
    for rate in sorted(set(runs["no-offload"]) & set(runs["offload"])):
        a = runs["no-offload"][rate].get("output_ids")
        b = runs["offload"][rate].get("output_ids")
        if not a or not b or len(a) != len(b) or any(x is None for x in [*a, *b]):
            return None
        out[rate] = [sum(x == y for x, y in zip(a, b, strict=True)), len(a)]
    return out or None


def _equal_across_rates(runs: dict[str, dict[str, dict]]) -> dict[str, list[int]] | None:
    """engine -> [requests whose token ids are equal at its lowest rate and at rate inf,
    requests compared] (None: a run without ids, or no two rates). Why: the same prompts
    on the same server at another load differ only by batch composition, so this is the
    size of batch-dependent rounding on each engine, beside ``outputs_equal_by_rate``."""
    out: dict[str, list[int]] = {}
    for eng in ENGINES:
        rates = sorted((r for r in runs[eng] if r != "inf"), key=float)
        if not rates or "inf" not in runs[eng]:
            return None
        a = runs[eng][rates[0]].get("output_ids")
        b = runs[eng]["inf"].get("output_ids")
        if not a or not b or len(a) != len(b) or any(x is None for x in [*a, *b]):
            return None
        out[eng] = [sum(x == y for x, y in zip(a, b, strict=True)), len(a)]
    return out


def step_ratio_by_batch(echo: dict | None, noff: dict | None) -> dict[str, float] | None:
    """batch -> ECHO's device ms per decode step over no-offload's at that batch (batches
    both ran 20+ steps at). Why: at rate 1 the inter-token latency is the decode step's,
    so this says how much of ``itl_p50_ratio_rate1`` the device step itself explains (the
    cache's fixed per-layer work) and how much is left to the rest of the server."""
    if not echo or not noff:
        return None
    e_s, e_n = echo.get("decode_device_seconds_by_batch"), echo.get("decode_device_steps_by_batch")
    n_s, n_n = noff.get("decode_device_seconds_by_batch"), noff.get("decode_device_steps_by_batch")
    if not (e_s and e_n and n_s and n_n):
        return None
    out = {}
    for batch in sorted(set(e_n) & set(n_n), key=int):
        if min(e_n[batch], n_n[batch]) >= 20 and e_s[batch] > 0 and n_s[batch] > 0:
            out[batch] = round((e_s[batch] / e_n[batch]) / (n_s[batch] / n_n[batch]), 4)
    return out or None


def _outputs_equal(runs: dict[str, dict[str, dict]]) -> bool | None:
    """Whether every request of every rate got the same token ids from both servers."""
    by_rate = equal_by_rate(runs)
    return None if by_rate is None else all(eq == n for eq, n in by_rate.values())


def _from_admission(study_metrics: dict) -> dict | None:
    """The study's hit rate over every decode step since admission (mean over layers) and
    the steps it spans; None for a study that predates it."""
    seen = study_metrics.get("hit_rate_from_admission")
    if not seen:
        return None
    per_layer = seen["per_layer"]
    return {
        "hit_rate": round(statistics.fmean(per_layer), 4),
        "decode_steps": seen["decode_steps"],
    }


def hit_rate_at_ages(curve: dict | None, output_lens: list[int] | None) -> dict | None:
    """The study's hit rate at the served requests' ages: each served request of L output
    tokens decodes L - 1 steps, and counts as the study's requests did over their first
    L - 1 steps (its cumulative hits and misses there, ``hit_curve_from_admission``).
    Why: the workload's locality grows with a request's age, so a served run of short
    outputs hits less than the study's long-lived requests, with no fault of the server;
    this is the study's figure at the same ages. Requests older than the curve count at
    its last step (``past_curve`` of them). None without a curve or the lengths."""
    if not curve or not curve.get("rows") or not output_lens:
        return None
    rows = curve["rows"]
    by_step = {step: (hits, misses) for step, hits, misses in rows}
    last = rows[-1][0]
    hits = misses = past = 0
    for n in output_lens:
        age = n - 1
        if age < 1:
            continue
        past += age > last
        h, m = by_step[min(age, last)]
        hits, misses = hits + h, misses + m
    if not hits + misses:
        return None
    return {"hit_rate": round(hits / (hits + misses), 4), "curve_steps": last, "past_curve": past}


def admission_parts(engine: dict, clock: str = "seconds") -> dict[str, float] | None:
    """Engine-thread ms per admission by part over a run (None: a server without parts);
    ``clock="cpu_seconds"``: the thread's CPU ms instead of wall (wall minus CPU is the
    time it waited)."""
    admissions = engine.get("admissions")
    prefix = f"admission_part_{clock}."
    parts = {k[len(prefix) :]: v for k, v in engine.items() if k.startswith(prefix)}
    if not admissions or not parts:
        return None
    return {k: round(1e3 * v / admissions, 3) for k, v in parts.items()}


STUDY_ENGINES = {"no-offload": "noff_paper", "offload": "echo_paper"}


def batch_limits(served: dict) -> dict | None:
    """What held one engine's decode batch back at rate inf, from the run's counter series
    (``counter_series``): its decode steps split by what they had beside them, each with
    its share of the steps and its mean batch. ``no_request_waiting``: nothing left to
    admit (the ramp, the drain, or requests reaching the engine slower than it admits);
    ``memory``: requests waiting and fewer free token locations than the run's mean
    prompt; ``other``: requests waiting and room for one (admission or arrivals). None
    without a series (a run without ``--poll-counters-s``, or an older record)."""
    series = served.get("counter_series") or {}
    lens = served.get("input_lens") or []
    if not series.get("rows") or not lens:
        return None
    prompt = statistics.fmean(lens)
    classes: dict[str, list[tuple[float, float]]] = {
        "no_request_waiting": [],
        "memory": [],
        "other": [],
    }
    for row in series["rows"]:
        r = dict(zip(series["columns"], row, strict=True))
        steps, batch, waiting = r["decode_steps"], r["mean_decode_batch"], r["waiting"]
        if not steps or batch is None or waiting is None:
            continue
        if waiting < 0.5:
            name = "no_request_waiting"
        elif r["free_tokens"] is not None and r["free_tokens"] < prompt:
            name = "memory"
        else:
            name = "other"
        classes[name].append((steps, batch))
    total = sum(steps for rows in classes.values() for steps, _ in rows)
    if not total:
        return None
    return {
        name: {
            "step_share": round(sum(s for s, _ in rows) / total, 3),
            "mean_batch": (
                round(sum(s * b for s, b in rows) / sum(s for s, _ in rows), 2) if rows else None
            ),
        }
        for name, rows in classes.items()
    }


def ingress(served: dict) -> dict | None:
    """How fast one engine's rate-inf prompts reached it, from the run's counter series:
    the sample times (seconds from the run's start, to the poll interval) by which the
    engine had taken in half and all of them, and all over that time. Why: at rate inf the
    client sends every prompt at once, and an ECHO batch can only grow as fast as prompts
    get through the front (HTTP, parsing) and their transfers land; a slow front shows
    here before it shows as a small batch. None without a series."""
    series = served.get("counter_series") or {}
    total = len(served.get("input_lens") or [])
    if not series.get("rows") or not total or "received" not in series.get("columns", []):
        return None
    seen, half, whole = 0.0, None, None
    for row in series["rows"]:
        r = dict(zip(series["columns"], row, strict=True))
        seen += r["received"] or 0.0
        if half is None and seen >= total / 2:
            half = r["t_s"]
        if whole is None and seen >= total:
            whole = r["t_s"]
    return {
        "prompts": total,
        "received_half_s": half,
        "received_all_s": whole,
        "received_per_s": round(total / whole, 1) if whole else None,
    }


def throughput_factors(study: dict, served: dict) -> dict | None:
    """One engine's served throughput against the study's, as the product of its decode
    batch, its device time per step and the share of wall time the device decoded (None:
    a record without the counters). Why: served over study below 1 can come from smaller
    batches (ramp, drain, arrivals not yet in place), slower steps at the same batch (the
    transfer's writes beside the decode, a lower hit rate) or host time between steps,
    and each asks for a different fix."""
    full = [r for r in study if r.get("phase") == "full" and r.get("step_ms_device")]
    eng = served.get("server_engine") or {}
    steps, device_s = eng.get("decode_steps"), eng.get("decode_device_seconds")
    batch, eff = served.get("mean_decode_batch"), served.get("served_efficiency")
    if not full or not steps or not device_s or not batch or not eff:
        return None
    study_batch = statistics.median(r["batch"] for r in full)
    study_step_ms = statistics.median(r["step_ms_device"] for r in full)
    study_tps = statistics.median(r["tokens_per_s_device"] for r in full)
    served_step_ms = 1e3 * device_s / steps
    parts = {
        "batch": batch / study_batch,
        "step": study_step_ms / served_step_ms,
        "efficiency": eff,
    }
    out = {k: round(v, 4) for k, v in parts.items()}
    out["product"] = round(parts["batch"] * parts["step"] * parts["efficiency"], 4)
    out["measured"] = _ratio(served.get("output_throughput"), study_tps)
    out["study_batch"], out["served_batch"] = study_batch, round(batch, 2)
    held = served.get("mean_step_requests")
    if held:  # the batch factor's parts: admitted, and of those decodable
        out["served_running"] = held.get("running")
        out["served_arriving"] = held.get("arriving")
        out["served_waiting"] = held.get("waiting")
        out["served_free_tokens"] = served.get("mean_free_tokens")
    out["study_step_ms"], out["served_step_ms"] = study_step_ms, round(served_step_ms, 3)
    return out


def _summed(runs: dict[str, dict[str, dict]], counter: str) -> float | None:
    """An engine counter's run deltas summed over both servers and every rate; None where
    no run's server exposed it (records from before it existed)."""
    deltas = [
        (r.get("server_engine") or {}).get(counter) for eng in ENGINES for r in runs[eng].values()
    ]
    known = [d for d in deltas if d is not None]
    return sum(known) if known else None


def combine(study: dict, runs: dict[str, dict[str, dict]]) -> dict:
    noff, echo = runs["no-offload"], runs["offload"]
    m = study.get("metrics", {})
    study_ratio = m.get("ratio_paper_all_hbm")
    hit = m.get("hit_rate_per_layer") or []
    inf_n, inf_e = noff.get("inf", {}), echo.get("inf", {})
    served = _ratio(inf_e.get("output_throughput"), inf_n.get("output_throughput"))
    served_hit = (inf_e.get("server_echo") or {}).get("hit_rate")
    captures = _summed(runs, "graph_captures_during_run") or 0
    latency = {
        eng: {
            rate: {
                k: r.get(k)
                for k in ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms")
            }
            for rate, r in runs[eng].items()
        }
        for eng in ENGINES
    }
    return {
        "study_ratio": study_ratio,
        "served_ratio_inf": served,
        "served_over_study": _ratio(served, study_ratio),
        "steady_ratio_inf": _ratio(
            inf_e.get("steady_output_throughput"), inf_n.get("steady_output_throughput")
        ),
        "mean_decode_batch_inf": {
            "no-offload": inf_n.get("mean_decode_batch"),
            "offload": inf_e.get("mean_decode_batch"),
        },
        "itl_p50_ratio_rate1": _ratio(
            echo.get("1", {}).get("median_itl_ms"), noff.get("1", {}).get("median_itl_ms")
        ),
        "decode_step_ratio_rate1_by_batch": step_ratio_by_batch(echo.get("1"), noff.get("1")),
        "echo_served_efficiency": inf_e.get("served_efficiency"),
        "no_offload_served_efficiency": inf_n.get("served_efficiency"),
        "served_hit_rate": served_hit,
        # over the run's steady window (the servers' counters sampled during it)
        "served_hit_rate_steady": inf_e.get("steady_hit_rate"),
        "mean_decode_batch_steady_inf": {
            "no-offload": inf_n.get("steady_mean_decode_batch"),
            "offload": inf_e.get("steady_mean_decode_batch"),
        },
        "study_hit_rate": round(statistics.fmean(hit), 4) if hit else None,
        # the study's requests from their first decode step (a served run sees every step)
        "study_hit_rate_from_admission": _from_admission(m),
        # the study's at the served ECHO requests' ages (their output lengths at rate inf)
        "study_hit_rate_at_served_ages": hit_rate_at_ages(
            m.get("hit_curve_from_admission"), inf_e.get("output_lens")
        ),
        "admission_ms_p50": inf_e.get("admission_ms_p50"),
        "admission_ms_mean_inf": inf_e.get("admission_ms_mean"),
        "admission_ms_parts_inf": admission_parts(inf_e.get("server_engine") or {}),
        "admission_cpu_ms_parts_inf": admission_parts(
            inf_e.get("server_engine") or {}, "cpu_seconds"
        ),
        "graph_captures_during_run": captures,
        "triton_compiles_during_run": _summed(runs, "triton_compiles"),
        "outputs_equal": _outputs_equal(runs),
        "outputs_equal_by_rate": equal_by_rate(runs),
        "outputs_equal_across_rates": _equal_across_rates(runs),
        "server_schedule": {
            eng: runs[eng].get("inf", {}).get("server_schedule") for eng in ENGINES
        },
        "latency": latency,
        "throughput_factors": {
            eng: throughput_factors(
                [r for r in study.get("runs", []) if r.get("engine") == STUDY_ENGINES[eng]],
                runs[eng].get("inf", {}),
            )
            for eng in ENGINES
        },
        "batch_limits_inf": {eng: batch_limits(runs[eng].get("inf", {})) for eng in ENGINES},
        "ingress_inf": {eng: ingress(runs[eng].get("inf", {})) for eng in ENGINES},
        "schedule_bound_inf": schedule_bound(
            {eng: runs[eng].get("inf", {}) for eng in ENGINES}, study_ratio, served
        ),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--study", required=True, type=Path, help="the study's --out folder")
    ap.add_argument("--sweep", required=True, type=Path, help="the e2e sweep's OUTDIR")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--commit", default="", help="the sha the runs were made on, literally")
    ap.add_argument("--command", default="", help="the command that made the runs")
    args = ap.parse_args(argv)
    study_file = args.study / "e2e_study.json"
    study = json.loads(study_file.read_text()) if study_file.is_file() else {}
    runs = {eng: runs_of(args.sweep, eng) for eng in ENGINES}
    if not study or not all(runs.values()):
        print(f"missing input: study {study_file.is_file()}, runs {list(runs)}", file=sys.stderr)
    record = {
        "name": "served_vs_study",
        "commit": args.commit,
        "device": study.get("device") or device_name(),
        "date": time.strftime("%Y-%m-%d"),
        "command": args.command or " ".join(sys.argv),
        "metrics": combine(study, runs),
    }
    shown = {k: v for k, v in record["metrics"].items() if k != "latency"}
    return write_record(args.out, record, shown)


def device_name() -> str:
    try:
        import torch

        return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "unknown"


if __name__ == "__main__":
    main()
