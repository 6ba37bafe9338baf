"""The server's counters as bench_serving reads them: ``/metrics`` parsed into the
engine's, ECHO's and the per-batch counters, and a run's server-side record fields from
two snapshots taken around it.

Why apart from the benchmark's driver: the counters' names, labels and arithmetic are one
job (the server's side of a record); sending requests and timing them is another.
"""

from __future__ import annotations

import math
import re

import aiohttp

ENGINE_COUNTERS = frozenset(
    {
        "engine_seconds",
        "engine_cpu_seconds",
        "decode_steps",
        "graph_captures",
        "graph_capture_seconds",
        "transfers",
        "transfer_seconds",
        "decode_device_seconds",  # CUDA-event time of the decode steps (absent on the CPU)
        "decode_batch_requests",  # the decode steps' batch sizes, summed
        "decode_step_requests",  # requests held at each step by state (``state`` folded in)
        "decode_step_free_tokens",  # free token locations at each step, summed
        "admissions",  # requests admitted, and the engine thread's seconds admitting them
        "admission_seconds",
        "admission_part_seconds",  # the same by part (``part`` label folded in)
        "admission_part_cpu_seconds",  # the engine thread's CPU seconds in those parts
        "spec_verify_rounds",  # MTP: request-rounds, and the tokens they committed
        "spec_accepted_tokens",
        "graph_captures_during_run",  # captures after start-up (0 on a server that captures all)
        "graph_capture_failures",
        "triton_compiles",  # Triton specializations compiled (runtime/jit_watch.py; goal 0)
        "requests_received",  # requests the engine queued (its ingress)
        "triton_compile_seconds",
    }
)
# The one label of an engine counter that is folded into its key (name.value).
FOLDED_LABELS = {"phase", "part", "state"}
# Decode device counters per ``batch_size`` label (CUDA only): sample name -> the key of
# parse_counters. Seconds come as decode_device_seconds_total{batch_size="16"} or as
# runtime/metrics.py's decode_device_seconds_by_batch_total{batch_size="16"}, beside
# decode_device_steps_by_batch_total{batch_size="16"}.
BY_BATCH = {
    "decode_device_seconds": "device_seconds",
    "decode_device_seconds_by_batch": "device_seconds",
    "decode_device_steps_by_batch": "device_steps",
}
# ECHO's per-layer counters (with ECHO on), summed over the ``layer`` label.
ECHO_COUNTERS = ("hits", "misses", "evictions", "recalled_bytes")
# A sample line of the text format: name, {labels} (optional), value (and a timestamp).
SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?$")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_counters(text: str) -> dict[str, dict[str, float]]:
    """The counters bench_serving keeps from a /metrics text: ``engine`` (ENGINE_COUNTERS,
    phase folded in), ``echo`` (ECHO_COUNTERS summed over layers; empty without ECHO),
    ``device_seconds`` and ``device_steps`` (the decode steps' device seconds and their
    count by ``batch_size`` label; BY_BATCH). Each empty where the server has none."""
    engine: dict[str, float] = {}
    echo: dict[str, float] = {}
    by_batch: dict[str, dict[str, float]] = {"device_seconds": {}, "device_steps": {}}
    admission: dict[str, float] = {}
    for line in text.splitlines():
        m = SAMPLE.match(line.strip())
        if m and m[1] == "sglang:admission_seconds_recent":  # a gauge: quantiles
            q = dict(LABEL.findall(m[2] or "")).get("quantile")
            if q is not None:
                admission[q] = float(m[3])
            continue
        if not m or not m[1].startswith("sglang:") or not m[1].endswith("_total"):
            continue
        name = m[1][len("sglang:") : -len("_total")]
        try:
            value = float(m[3])
        except ValueError:
            continue
        labels = dict(LABEL.findall(m[2] or ""))
        labels.pop("model_name", None)
        if name.startswith("echo_") and name[len("echo_") :] in ECHO_COUNTERS:
            if set(labels) <= {"layer"}:  # one sample per layer
                key = name[len("echo_") :]
                echo[key] = echo.get(key, 0.0) + value
        elif set(labels) == {"batch_size"}:
            if name in BY_BATCH:
                by_batch[BY_BATCH[name]][labels["batch_size"]] = value
        elif name not in ENGINE_COUNTERS:
            continue
        elif not labels:
            engine[name] = value
        elif len(labels) == 1 and set(labels) <= FOLDED_LABELS:
            engine[f"{name}.{next(iter(labels.values()))}"] = value
    return {"engine": engine, "echo": echo, **by_batch, "admission_quantiles": admission}


async def engine_counters(session: aiohttp.ClientSession, base: str) -> dict[str, dict[str, float]]:
    """The server's counters now (``parse_counters``; all empty when it exposes none)."""
    try:
        async with session.get(base + "/metrics") as resp:
            text = await resp.text() if resp.status == 200 else ""
    except (aiohttp.ClientError, TimeoutError):
        text = ""
    return parse_counters(text)


def engine_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float] | None:
    """What the run cost the server's engine thread, by phase (None: not exposed)."""
    if not after:
        return None
    return {k: round(v - before.get(k, 0.0), 4) for k, v in sorted(after.items())}


def echo_delta(before: dict[str, float], after: dict[str, float]) -> dict | None:
    """ECHO's counters over the run, summed over layers, and its hit rate over the run:
    hits / (hits + misses), None with no selection. None: no ECHO counters (no-offload,
    or a server without them)."""
    if not all(k in after for k in ECHO_COUNTERS):
        return None
    out: dict = {k: round(after[k] - before.get(k, 0.0)) for k in ECHO_COUNTERS}
    picked = out["hits"] + out["misses"]
    out["hit_rate"] = out["hits"] / picked if picked > 0 else None
    return out


def _mean_held(engine: dict[str, float], steps: float | None) -> dict[str, float] | None:
    """state -> the requests held in that state at a decode step on average (None: none)."""
    prefix = "decode_step_requests."
    held = {k[len(prefix) :]: v for k, v in engine.items() if k.startswith(prefix)}
    if not steps or not held:
        return None
    return {k: round(v / steps, 3) for k, v in held.items()}


def served_fields(before: dict, after: dict, duration: float) -> dict:
    """The record's server-side fields from two ``parse_counters`` snapshots taken around
    a run of ``duration`` seconds (the benchmark's wall time):

    - ``server_engine``: the engine counters' deltas (``engine_delta``);
    - ``server_echo``: ECHO's (``echo_delta``);
    - ``mean_decode_batch``: decode_batch_requests / decode_steps over the run, the mean
      number of requests in a decode step;
    - ``served_efficiency``: decode_device_seconds / ``duration``, the share of the run's
      wall time the device spent in decode steps;
    - ``decode_device_seconds_by_batch`` / ``decode_device_steps_by_batch``: the decode
      steps' device seconds / their count over the run, by batch size (those that ran);
    - ``admission_ms_mean``: the engine thread's milliseconds per admission over the run;
      ``admission_ms_p50`` / ``admission_ms_p99``: quantiles of the server's last 1024
      admissions when the run ended (its warm-up and earlier runs' included);
    - ``mean_step_requests``: the requests held at a decode step on average, by state
      (running, arriving, waiting: ``decode_step_requests`` / decode_steps), and
      ``mean_free_tokens``: the free token locations at a step on average;
    - ``spec_accept_length``: under MTP, the tokens a request's round committed on average
      over the run (accepted drafts + the target's token; 1..Q).

    Each is None where the server does not expose its counters.
    """
    engine = engine_delta(before["engine"], after["engine"])
    eng = engine or {}
    steps, batch = eng.get("decode_steps"), eng.get("decode_batch_requests")
    device = eng.get("decode_device_seconds")

    def by_batch(key: str) -> dict[str, float] | None:
        order = sorted(after[key], key=lambda k: int(k) if k.isdigit() else math.inf)
        delta = {k: round(after[key][k] - before[key].get(k, 0.0), 6) for k in order}
        return {k: v for k, v in delta.items() if v > 0} or None

    return {
        "server_engine": engine,
        "server_echo": echo_delta(before["echo"], after["echo"]),
        "mean_decode_batch": batch / steps if batch is not None and steps else None,
        "served_efficiency": device / duration if device is not None and duration > 0 else None,
        "decode_device_seconds_by_batch": by_batch("device_seconds"),
        "decode_device_steps_by_batch": by_batch("device_steps"),
        "admission_ms_mean": (
            1e3 * eng["admission_seconds"] / eng["admissions"]
            if eng.get("admissions") and "admission_seconds" in eng
            else None
        ),
        "mean_step_requests": _mean_held(eng, steps),
        "mean_free_tokens": (
            round(eng["decode_step_free_tokens"] / steps)
            if steps and "decode_step_free_tokens" in eng
            else None
        ),
        "spec_accept_length": (
            eng["spec_accepted_tokens"] / eng["spec_verify_rounds"]
            if eng.get("spec_verify_rounds")
            else None
        ),
        "admission_ms_p50": _ms(after.get("admission_quantiles", {}).get("0.5")),
        "admission_ms_p99": _ms(after.get("admission_quantiles", {}).get("0.99")),
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1e3 * seconds
