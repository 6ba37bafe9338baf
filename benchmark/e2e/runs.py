"""Reading the study's measurements: every run of an (engine, phase), in run order, and
ECHO's throughput over its no-offload baseline's, each side the median of its repeats with
the range over every pair (one H200's steps drift ~15% run to run, so one pair alone says
little)."""

from __future__ import annotations

import statistics


def find_all(runs: list[dict], engine: str, phase: str = "full") -> list[dict]:
    """Every measurement of (engine, phase), in run order (repeat 0 first)."""
    return [r for r in runs if r["engine"] == engine and r["phase"] == phase]


def find(runs: list[dict], engine: str, phase: str = "full") -> dict | None:
    found = find_all(runs, engine, phase)
    return found[0] if found else None


def med(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def ratio_range(echo: list[dict], noff: list[dict]) -> tuple[float, float, float]:
    """(median ratio, min, max) of device tokens/s, ECHO side over no-offload side. The
    min and max are over every cross pair, so they bound the ratio of the medians."""
    pairs = [e["tokens_per_s_device"] / n["tokens_per_s_device"] for e in echo for n in noff]
    mid = med(echo, "tokens_per_s_device") / med(noff, "tokens_per_s_device")
    return mid, min(pairs), max(pairs)


def paired_cost(side: list[dict], base: list[dict]) -> dict | None:
    """The cost of ``side`` against ``base`` (1 - throughput ratio, i.e. 1 - base step time
    / side step time) from steps they took side by side (measure.run_joint: their timed
    steps alternated, step i of one beside step i of the other, repeat by repeat). The
    median over every pair; the range of the repeats' own medians (widened to hold the
    median over every pair); the pairs' p10-p90. None without alternated steps."""
    costs, medians = [], []
    for s, b in zip(side, base, strict=False):
        ss, bs = s.get("step_ms_device_steps"), b.get("step_ms_device_steps")
        if not ss or not bs or len(ss) != len(bs) or s["repeat"] != b["repeat"]:
            continue
        these = [1 - bt / st for st, bt in zip(ss, bs, strict=True)]
        costs += these
        medians.append(statistics.median(these))
    if not costs:
        return None
    q = statistics.quantiles(costs, n=10) if len(costs) > 1 else [costs[0]] * 9
    cost = statistics.median(costs)
    return {
        "cost": round(cost, 4),
        "repeat_medians": [round(m, 4) for m in medians],
        "range": [round(min(*medians, cost), 4), round(max(*medians, cost), 4)],
        "step_p10_p90": [round(q[0], 4), round(q[-1], 4)],
        "pairs": len(costs),
    }


def ratio(runs: list[dict], echo: str, noff: str, phase: str = "full") -> dict | None:
    """ECHO's throughput over no-offload's (at its "full" phase), each side the median
    of its repeats, with the range over every (ECHO, no-offload) pair of measurements:
    it holds the median ratio and shows how far one pair alone could have strayed."""
    es, ns = find_all(runs, echo, phase), find_all(runs, noff)
    if not es or not ns:
        return None
    mid, lo, hi = ratio_range(es, ns)
    return {
        "ratio": round(mid, 3),
        "ratio_min": round(lo, 3),
        "ratio_max": round(hi, 3),
        "ratio_wall": round(med(es, "tokens_per_s_wall") / med(ns, "tokens_per_s_wall"), 3),
        "repeats": {"echo": len(es), "no_offload": len(ns)},
        "echo_batch": es[0]["batch"],
        "no_offload_batch": ns[0]["batch"],
        "echo_step_ms": round(med(es, "step_ms_device"), 3),
        "no_offload_step_ms": round(med(ns, "step_ms_device"), 3),
        "echo_hit_rate_mean": round(
            statistics.median(statistics.mean(e["hit_rate_per_layer"]) for e in es), 4
        ),
    }


def sweep(runs: list[dict]) -> dict:
    """Ratio and hit rate against the stable fraction (the knob's calibration)."""
    out = {}
    for r in runs:
        phase = r["phase"]
        swept = phase in ("full", "random") or phase.startswith("p")
        if r["engine"] != "echo_paper" or not swept or r["locality_source"] in out:
            continue
        rat = ratio(runs, "echo_paper", "noff_paper", phase=r["phase"])
        out[r["locality_source"]] = rat and {
            "hit_rate_mean": rat["echo_hit_rate_mean"],
            "hit_rate_min": min(r["hit_rate_per_layer"]),
            "ratio": rat["ratio"],
            "echo_step_ms": rat["echo_step_ms"],
            "evictions_per_step": r["evictions_per_step"],
        }
    return out
