"""Aggregate per-request timings into SGLang bench_serving's result record."""

from __future__ import annotations

import statistics

from sglang_echo.bench.client import RequestResult


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _stats(prefix: str, values_s: list[float]) -> dict:
    ms = [v * 1000 for v in values_s]
    return {
        f"mean_{prefix}_ms": statistics.fmean(ms) if ms else 0.0,
        f"median_{prefix}_ms": statistics.median(ms) if ms else 0.0,
        f"std_{prefix}_ms": statistics.pstdev(ms) if ms else 0.0,
        f"p90_{prefix}_ms": _pct(ms, 90),
        f"p99_{prefix}_ms": _pct(ms, 99),
    }


STEADY_MIN_REQUESTS = 10


def steady_output_throughput(
    results: list[RequestResult], starts: list[float] | None
) -> tuple[float | None, list[float] | None]:
    """Output tok/s over the run's plateau, and its window ``[t_lo, t_hi]`` (seconds from
    the benchmark's start): ``(None, None)`` with fewer than 10 successful requests, no
    start times, or a window of zero length.

    The plateau is the stretch between the completion of the first tenth of the requests
    and the completion of nine tenths of them, leaving out the ramp up (the batch filling) and the
    drain (the last requests decoding alone). Concretely, with the ``n`` successful requests
    sorted by completion time ``c_1 <= ... <= c_n`` (completion = the request's send time
    ``starts[i]`` + its latency), ``lo = ceil(n / 10)`` and ``hi = ceil(9 n / 10)``: the
    output tokens of requests ``lo + 1 .. hi`` (those that completed after the ``lo``-th
    completion, up to and including the ``hi``-th) divided by ``c_hi - c_lo``. A request's
    tokens all count at its completion. ``starts`` is parallel to ``results``.
    """
    if starts is None:
        return None, None
    done = sorted(
        (start + r.latency, r.output_len)
        for r, start in zip(results, starts, strict=True)
        if r.success
    )
    n = len(done)
    if n < STEADY_MIN_REQUESTS:
        return None, None
    lo, hi = -(-n // 10), -(-9 * n // 10)
    t_lo, t_hi = done[lo - 1][0], done[hi - 1][0]
    if t_hi <= t_lo:
        return None, None
    tokens = sum(out for _, out in done[lo:hi])
    return tokens / (t_hi - t_lo), [t_lo, t_hi]


def summarize(
    results: list[RequestResult], duration: float, starts: list[float] | None = None
) -> dict:
    """SGLang bench_serving's fields, plus ``steady_output_throughput`` and its
    ``steady_window_s`` (``steady_output_throughput``'s docstring; None without ``starts``,
    each request's send time in seconds from the benchmark's start, parallel to ``results``)."""
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    itls = [x for r in ok for x in r.itl]
    record = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "total_output_tokens_retokenized": total_out,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "input_throughput": total_in / duration if duration else 0.0,
        "output_throughput": total_out / duration if duration else 0.0,
        "total_throughput": (total_in + total_out) / duration if duration else 0.0,
        **_stats("e2e_latency", [r.latency for r in ok]),
        **_stats("ttft", [r.ttft for r in ok]),
        **_stats("tpot", tpots),
        **_stats("itl", itls),
        "concurrency": sum(r.latency for r in ok) / duration if duration else 0.0,
    }
    steady, window = steady_output_throughput(results, starts)
    record["steady_output_throughput"] = steady
    record["steady_window_s"] = window
    return record
