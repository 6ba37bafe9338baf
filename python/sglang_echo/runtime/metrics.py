"""Prometheus text exposition of the scheduler and the KV backend (``GET /metrics``).

``snapshot`` runs on the engine thread between steps (ECHO's counters live on the device);
``render`` formats it on the HTTP side. Names follow SGLang's ``sglang:`` metrics where
one exists (running/queued requests, token counters, generation throughput, token usage);
ECHO's per-layer counters carry a ``layer`` label.
"""

from __future__ import annotations

import time

from sglang_echo.runtime import jit_watch
from sglang_echo.runtime.scheduler import Scheduler
from sglang_echo.runtime.scheduler_speculative import accept_stats

PREFIX = "sglang"


def graph_counts(sched: Scheduler) -> dict[str, float]:
    """The engine's CUDA-graph captures, summed over what captures them (the decode runner,
    and under MTP the rounds' step graphs, runtime/spec_graphs.py): ``captures``,
    ``seconds``, ``during_run`` (not at start-up) and ``failures``."""
    owners: list = [sched.steps.decode_runner]
    if sched.speculative is not None:
        owners.append(sched.speculative.rounds.graphs)
    owners = [o for o in owners if o is not None]
    return {
        "captures": sum(o.captures for o in owners),
        "seconds": sum(o.capture_s for o in owners),
        "during_run": sum(o.captures - o.startup_captures for o in owners),
        "failures": sum(o.capture_failures for o in owners),
    }


def snapshot(sched: Scheduler, kv_cache) -> dict:
    s = sched.stats
    free = sched.steps.allocator.num_free
    snap = {
        "time": time.time(),
        "num_running_reqs": len(sched.running),
        "num_queue_reqs": len(sched.waiting),
        "prompt_tokens_total": s.prompt_tokens,
        "generation_tokens_total": s.generation_tokens,
        "num_requests_total": s.finished_requests,
        "requests_received_total": s.received_requests,
        "num_aborted_requests_total": s.aborted_requests,
        "decode_steps_total": s.decode_steps,
        "prefill_steps_total": s.prefill_steps,
        "gen_throughput": sched.gen_throughput(),
        "token_usage": (sched.capacity - free) / sched.capacity,
        "max_total_num_tokens": sched.capacity,
    }
    snap["engine_seconds"] = dict(s.phase_s)
    snap["engine_cpu_seconds"] = dict(s.phase_cpu_s)
    snap["decode_batch_requests_total"] = s.decode_batch_requests
    snap["decode_step_requests"] = dict(s.step_requests)
    snap["decode_step_free_tokens_total"] = s.step_free_tokens
    snap["admission_seconds_total"] = s.admission_s
    snap["admissions_total"] = s.admissions
    snap["admission_seconds_quantiles"] = quantiles(list(s.recent_admission_s), (0.5, 0.99))
    parts, cpu_parts = dict(s.admission_part_s), dict(s.admission_part_cpu_s)
    if sched.prompt_source is not None:
        parts.update(sched.prompt_source.start_part_s)
        cpu_parts.update(sched.prompt_source.start_part_cpu_s)
    snap["admission_part_seconds"] = parts
    snap["admission_part_cpu_seconds"] = cpu_parts
    runner = sched.steps.decode_runner
    if runner is not None:
        graphs = graph_counts(sched)
        snap["graph_captures_total"] = graphs["captures"]
        snap["graph_capture_seconds_total"] = graphs["seconds"]
        snap["graph_captures_during_run_total"] = graphs["during_run"]
        snap["graph_capture_failures_total"] = graphs["failures"]
        runner.clock.poll()
        if runner.clock.enabled:
            snap["decode_device_seconds_total"] = runner.clock.total_seconds
            snap["decode_device_seconds_by_bs"] = dict(sorted(runner.clock.seconds.items()))
            snap["decode_device_steps_by_bs"] = dict(sorted(runner.clock.steps.items()))
    if jit_watch.WATCH.installed:
        jit = jit_watch.WATCH.counters()
        snap["triton_compiles_total"] = jit["compiles"]
        snap["triton_compile_seconds_total"] = jit["seconds"]
    source = sched.prompt_source
    if source is not None:
        snap["transfers_total"] = source.transfers
        snap["transfer_seconds_total"] = source.transfer_s
    if sched.speculative is not None:  # SGLang's names (avg_spec_accept_length in its states)
        snap.update(accept_stats(sched.speculative.accept_lens, sched.speculative.num_draft))
    telemetry = kv_cache.telemetry()
    if telemetry is not None:
        snap["echo"] = telemetry
    return snap


def quantiles(samples: list[float], qs: tuple[float, ...]) -> dict[float, float] | None:
    """Nearest-rank quantiles of ``samples`` (None when there are none)."""
    if not samples:
        return None
    ordered = sorted(samples)
    return {q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] for q in qs}


def _line(name: str, value: float, labels: dict | None = None) -> str:
    if labels:
        inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
        return f"{PREFIX}:{name}{{{inner}}} {float(value)!r}"
    return f"{PREFIX}:{name} {float(value)!r}"


def render(snap: dict, model_name: str) -> str:
    base = {"model_name": model_name}
    out: list[str] = []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[dict, float]]) -> None:
        # Text format 0.0.4: a counter's family and sample names both end in _total.
        sample = f"{name}_total" if kind == "counter" else name
        out.append(f"# HELP {PREFIX}:{sample} {help_text}")
        out.append(f"# TYPE {PREFIX}:{sample} {kind}")
        out.extend(_line(sample, v, {**base, **labels}) for labels, v in samples)

    def one(name: str, kind: str, help_text: str, key: str) -> None:
        metric(name, kind, help_text, [({}, snap[key])])

    one("num_running_reqs", "gauge", "Requests in the running batch.", "num_running_reqs")
    one("num_queue_reqs", "gauge", "Requests waiting for admission.", "num_queue_reqs")
    one("prompt_tokens", "counter", "Prompt tokens prefilled.", "prompt_tokens_total")
    one("generation_tokens", "counter", "Tokens generated.", "generation_tokens_total")
    one("num_requests", "counter", "Requests finished (not aborted).", "num_requests_total")
    one("num_aborted_requests", "counter", "Requests aborted.", "num_aborted_requests_total")
    one(
        "requests_received",
        "counter",
        "Requests the engine took into its waiting queue (its ingress: against admissions, "
        "whether requests reach it as fast as it could admit them).",
        "requests_received_total",
    )
    one("gen_throughput", "gauge", "Generated tokens per second (last 5 s).", "gen_throughput")
    one("token_usage", "gauge", "Share of the KV token pool in use.", "token_usage")
    one("max_total_num_tokens", "gauge", "KV token pool size.", "max_total_num_tokens")
    one("decode_steps", "counter", "Decode steps run.", "decode_steps_total")
    metric(
        "engine_seconds",
        "counter",
        "Engine-thread wall time by phase (runtime/scheduler_stats.py ENGINE_PHASES).",
        [({"phase": k}, v) for k, v in snap["engine_seconds"].items()],
    )
    metric(
        "engine_cpu_seconds",
        "counter",
        "Engine-thread CPU time by phase (wall minus CPU: waits on the device or the GIL).",
        [({"phase": k}, v) for k, v in snap["engine_cpu_seconds"].items()],
    )
    one(
        "decode_batch_requests",
        "counter",
        "Requests over all decode steps (mean decode batch = this / decode_steps).",
        "decode_batch_requests_total",
    )
    metric(
        "decode_step_requests",
        "counter",
        "Requests held at each decode step, summed over the steps (mean = this / "
        "decode_steps), by state: running (admitted), arriving (admitted, KV not yet in "
        "place) and waiting (not admitted).",
        [({"state": k}, v) for k, v in snap["decode_step_requests"].items()],
    )
    one(
        "decode_step_free_tokens",
        "counter",
        "Free token locations at each decode step, summed over the steps.",
        "decode_step_free_tokens_total",
    )
    one("admissions", "counter", "Requests admitted to the running batch.", "admissions_total")
    one(
        "admission_seconds",
        "counter",
        "Engine-thread seconds spent admitting them (a decode node's transfer start included).",
        "admission_seconds_total",
    )
    metric(
        "admission_part_seconds",
        "counter",
        "Those seconds by part: row (the table row); on a decode node alloc (token "
        "locations), place (their upload), seed (the first token), reserve (ECHO's prompt "
        "slots, stream order), submit (the writer thread's job).",
        [({"part": k}, v) for k, v in snap["admission_part_seconds"].items()],
    )
    metric(
        "admission_part_cpu_seconds",
        "counter",
        "The engine thread's CPU seconds in those parts: wall well above CPU is waiting "
        "(for the GIL, or on the device).",
        [({"part": k}, v) for k, v in snap["admission_part_cpu_seconds"].items()],
    )
    if snap["admission_seconds_quantiles"] is not None:
        metric(
            "admission_seconds_recent",
            "gauge",
            "Quantiles of the last 1024 admissions' engine-thread seconds.",
            [({"quantile": str(q)}, v) for q, v in snap["admission_seconds_quantiles"].items()],
        )
    if "decode_device_seconds_by_bs" in snap:
        one(
            "decode_device_seconds",
            "counter",
            "Device time of decode steps (CUDA events around each step).",
            "decode_device_seconds_total",
        )
        metric(
            "decode_device_seconds_by_batch",
            "counter",
            "Device time of decode steps by batch size.",
            [({"batch_size": str(b)}, v) for b, v in snap["decode_device_seconds_by_bs"].items()],
        )
        metric(
            "decode_device_steps_by_batch",
            "counter",
            "Decode steps timed on the device, by batch size.",
            [({"batch_size": str(b)}, v) for b, v in snap["decode_device_steps_by_bs"].items()],
        )
    for key, kind, text in (
        ("graph_captures_total", "counter", "Decode shapes captured in CUDA graphs."),
        ("graph_capture_seconds_total", "counter", "Host time of those captures."),
        (
            "graph_captures_during_run_total",
            "counter",
            "Captures after start-up (a shape the start-up capture did not cover).",
        ),
        (
            "graph_capture_failures_total",
            "counter",
            "Captures that failed (that shape then runs eagerly).",
        ),
        (
            "triton_compiles_total",
            "counter",
            "Triton kernel specializations compiled or loaded since start-up (each logged "
            "with its kernel; one during a run stalls every request behind it).",
        ),
        ("triton_compile_seconds_total", "counter", "Host time of those compiles."),
        ("transfers_total", "counter", "Decode-node transfers arrived (fake backend)."),
        ("transfer_seconds_total", "counter", "Their start-to-arrival times, summed."),
    ):
        if key in snap:
            one(key.removesuffix("_total"), kind, text, key)
    if "avg_spec_accept_length" in snap:
        for key, text in (
            ("avg_spec_accept_length", "Mean tokens a speculative round commits per request."),
            ("spec_accept_rate", "Share of proposed draft tokens accepted."),
            ("spec_num_steps", "Draft tokens per round (--speculative-num-steps)."),
            (
                "spec_num_draft_tokens",
                "Verified positions per round (--speculative-num-draft-tokens).",
            ),
        ):
            name = "spec_accept_length" if key == "avg_spec_accept_length" else key
            metric(name, "gauge", text, [({}, snap[key])])
        one("spec_verify_rounds", "counter", "Request-rounds verified.", "spec_verify_rounds_total")
        one(
            "spec_accepted_tokens",
            "counter",
            "Tokens the rounds committed (their accepted lengths, summed).",
            "spec_accepted_tokens_total",
        )
    echo = snap.get("echo")
    if echo is not None:
        layers = range(len(echo["hit_rate"]))

        def per_layer(key: str) -> list[tuple[dict, float]]:
            return [({"layer": str(i)}, echo[key][i]) for i in layers]

        metric(
            "echo_hit_rate",
            "gauge",
            "ECHO device-cache hit rate per layer.",
            per_layer("hit_rate"),
        )
        metric("echo_hits", "counter", "Selected tokens found resident.", per_layer("hits"))
        metric("echo_misses", "counter", "Selected tokens recalled from host.", per_layer("misses"))
        metric("echo_evictions", "counter", "Slots evicted on resolve.", per_layer("evictions"))
        metric(
            "echo_recalled_bytes",
            "counter",
            "Bytes recalled host -> device.",
            per_layer("recalled_bytes"),
        )
    return "\n".join(out) + "\n"
