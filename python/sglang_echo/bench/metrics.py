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


def summarize(results: list[RequestResult], duration: float) -> dict:
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
    return record
