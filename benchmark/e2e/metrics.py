"""The record's ``metrics``: the headline ratios (paper settings, same pools, equal HBM,
the HiSparse-like baseline), the low-load cost, hit rates, step breakdowns, the spread
over repeats, the 61-layer estimate and the details behind them (lossless checks, the
locality sweep, every repeat's step time). benchmark/evidence/ and the README read these
keys: their names and shapes are the record's contract."""

from __future__ import annotations

import statistics

from benchmark.e2e.components import component_at
from benchmark.e2e.extrapolate import estimate_61_layers
from benchmark.e2e.lossless import lossless_check, low_load_agreement
from benchmark.e2e.plan import PREFETCH_OFF, PREFETCH_ON, StudyPlan
from benchmark.e2e.runs import find, find_all, med, paired_cost, ratio, ratio_range, sweep


def summed_curve(echo_runs: list[dict]) -> dict | None:
    """[steps since admission, hits, misses] of the paper-setting ECHO runs' warm-up and
    fill, summed over the repeats at the steps they all reached (None: no run has one)."""
    curves = [r["hit_curve_from_admission"] for r in echo_runs if r.get("hit_curve_from_admission")]
    if not curves:
        return None
    n = min(len(c) for c in curves)
    rows = [
        [curves[0][i][0], sum(c[i][1] for c in curves), sum(c[i][2] for c in curves)]
        for i in range(n)
    ]
    return {"columns": ["step", "hits", "misses"], "rows": rows, "runs": len(curves)}


def metrics(setup: StudyPlan, runs: list[dict], components: dict) -> dict:
    """The record's metrics from the measurements so far (any may be missing: the record
    is rewritten after every phase)."""
    plan = setup.plan
    paper = ratio(runs, "echo_paper", "noff_paper")
    pools = {pool: ratio(runs, f"echo_{pool}", f"noff_{pool}") for pool in plan.same_pools}
    equal = {b: ratio(runs, f"echo_equal_hbm_b{b}", "noff_paper") for b in plan.equal_hbm_batches}
    equal_best = max((v for v in equal.values() if v), key=lambda v: v["ratio"], default=None)
    hisparse = {
        b: ratio(runs, f"hisparse_equal_hbm_b{b}", "noff_paper") for b in plan.equal_hbm_batches
    }
    hisparse_best = max((v for v in hisparse.values() if v), key=lambda v: v["ratio"], default=None)
    low, low_range, low_spread, low_how = {}, {}, {}, {}
    inline, inline_gain = {}, {}
    for b in plan.low_load_batches:
        phase = f"b{b}"
        es, ns = find_all(runs, "echo_paper", phase), find_all(runs, "noff_low", phase)
        paired = paired_cost(es, ns)
        if paired:  # steps taken side by side: the GPU's drift cancels
            low[b], low_range[b] = paired["cost"], paired["range"]
            low_spread[b], low_how[b] = paired["step_p10_p90"], f"paired steps ({paired['pairs']})"
        elif es and ns:  # phases run one after the other: medians, every cross pair's range
            mid, lo, hi = ratio_range(es, ns)
            low[b] = round(1 - mid, 4)
            low_range[b] = [round(1 - hi, 4), round(1 - lo, 4)]
            low_how[b] = "phase medians"
        ins = find_all(runs, "echo_inline", phase)
        inline[b] = paired_cost(ins, ns)
        inline_gain[b] = paired_cost(ins, es)  # the defaults' gain: inline's cost over them
    echo_runs = find_all(runs, "echo_paper")
    echo_run = echo_runs[0] if echo_runs else None
    low_phase = f"b{min(plan.low_load_batches)}"  # the profiled one
    lossless, low_diff, low_tokens = low_load_agreement(
        runs, plan.low_load_batches, setup.min_compared
    )
    pressure = lossless_check(runs, "echo_pressure", setup.pressure_batch, setup.min_compared)
    pressure_hisparse = lossless_check(
        runs, "hisparse_pressure", setup.pressure_batch, setup.min_compared
    )
    rand = ratio(runs, "echo_paper", "noff_paper", phase="random")
    same = plan.same_pools
    p200 = pools.get(same[0]) if same else None
    p110 = pools.get(same[1]) if len(same) > 1 else None
    hit = None
    if echo_runs:  # per layer, the median over the repeats
        hit = [round(statistics.median(v), 4) for v in zip(*(r["hit_rate_per_layer"] for r in echo_runs), strict=True)]  # fmt: skip
    from_admission = [r for r in echo_runs if "hit_rate_from_admission" in r]
    hit_admitted = from_admission and {
        "per_layer": [
            round(statistics.median(v), 4)
            for v in zip(*(r["hit_rate_from_admission"] for r in from_admission), strict=True)
        ],
        # the repeats' fills may differ by a step or two: their median
        "decode_steps": round(
            statistics.median(r["decode_steps_from_admission"] for r in from_admission)
        ),
    }
    return {
        "decode_prefetch_auto": prefetch_auto(runs),
        "echo_decode_prefetch": echo_decode_prefetch(runs),
        "ratio_paper_all_hbm": paper and paper["ratio"],
        "ratio_paper_200k": p200 and p200["ratio"],
        "ratio_paper_110k": p110 and p110["ratio"],
        "ratio_equal_hbm_380k": equal_best and equal_best["ratio"],
        "hisparse_ratio_equal_hbm_380k": hisparse_best and hisparse_best["ratio"],
        "hisparse_device_buffer_size": setup.buffer_size,
        "low_load_cost": {
            "per_batch": low,
            "mean": round(statistics.mean(low.values()), 4) if low else None,
            "per_batch_range": low_range,
            "per_batch_step_p10_p90": low_spread,
            "method": low_how,
            # ECHO without this two defaults (decode tokens host-only, resolve in
            # line), alternated in the same steps: its cost over noff_low, and over ECHO.
            "inline_per_batch": {b: v and v["cost"] for b, v in inline.items()},
            "inline_over_default_per_batch": {b: v and v["cost"] for b, v in inline_gain.items()},
            "inline_details": {"vs_no_offload": inline, "vs_default": inline_gain},
        },
        "hit_rate_per_layer": hit,
        # every step since admission (the timed steps follow a long fill): a served run's peer
        "hit_rate_from_admission": hit_admitted or None,
        "hit_curve_from_admission": summed_curve(echo_runs),
        "locality_source": echo_run and echo_run["locality_source"],
        "breakdown": {
            "no_offload": breakdown(find_all(runs, "noff_paper"), components, plan.layers),
            "echo": breakdown(echo_runs, components, plan.layers),
        },
        "breakdown_low_load": {
            "no_offload": breakdown(find_all(runs, "noff_low", low_phase), components, plan.layers),
            "echo": breakdown(find_all(runs, "echo_paper", low_phase), components, plan.layers),
        },
        "repeats": setup.args.repeats,
        "spread": {
            key: {"ratio_min": v["ratio_min"], "ratio_max": v["ratio_max"], **v["repeats"]}
            for key, v in (
                ("ratio_paper_all_hbm", paper),
                ("ratio_paper_200k", p200),
                ("ratio_paper_110k", p110),
                ("ratio_equal_hbm_380k", equal_best),
                ("hisparse_ratio_equal_hbm_380k", hisparse_best),
            )
            if v
        },
        "estimate_61_layers": estimate_61_layers(setup, runs, components),
        "details": {
            "repeats": repeats(setup, runs),
            "paper_all_hbm": paper,
            "same_pools": pools,
            "equal_hbm_380k": equal,
            "hisparse_equal_hbm_380k": hisparse,
            "greedy_outputs_equal_at_low_load": lossless,
            "first_difference_at_low_load": low_diff,
            "tokens_compared_at_low_load": low_tokens,
            "lossless_under_eviction": pressure,
            "lossless_under_eviction_hisparse": pressure_hisparse,
            "locality_sweep_paper_all_hbm": sweep(runs),
            "random_keys_paper_all_hbm": rand
            and {
                **rand,
                "locality_source": "random",
                "hit_rate_per_layer": find(runs, "echo_paper", "random")["hit_rate_per_layer"],
            },
        },
        "per_layer_note": "ratios are of the measured L-layer steps (all layers identical, "
        "the step's fixed part small); estimate_61_layers scales the per-layer device time "
        "to DeepSeek-V3.2's 61 layers",
    }


def breakdown(runs: list[dict], components: dict, layers: int) -> dict | None:
    """Step and per-layer times from the median of the repeats; host times and the
    profiler from the first (the only profiled) measurement."""
    if not runs:
        return None
    run, step = runs[0], med(runs, "step_ms_device")
    layer_us = step * 1e3 / layers
    comp = component_at(components, run["batch"])
    out = {
        "batch": run["batch"],
        "step_ms_device": step,
        "layer_us_device": round(layer_us, 2),
        "host_ms": run["host_ms"],
        "step_ms_wall": run["step_ms_wall"],
    }
    if comp is not None:
        out["per_layer_us_by_difference"] = {
            "moe_ffn": comp["moe_us"],
            "attention_weights": comp["attn_weights_us"],
            "attention_side_rest": round(layer_us - comp["moe_us"] - comp["attn_weights_us"], 2),
            "component_batch": comp["batch"],
        }  # fmt: skip
    if "breakdown" in run:
        out["profiler"] = run["breakdown"]
    return out


def repeats(setup: StudyPlan, runs: list[dict]) -> dict[str, list[float]]:
    """Device step ms of every measurement of each repeated phase, in run order; keyed
    by engine for its "full" phase, else engine/phase."""
    out = {}
    for eng in setup.engines():
        for ph in eng.phases:
            own = find_all(runs, eng.label, ph.label) if ph.repeated else []
            if own:
                key = eng.label if ph.label == "full" else f"{eng.label}/{ph.label}"
                out[key] = [round(r["step_ms_device"], 4) for r in own]
    return out


def run_before(in_order: list[dict], phase_runs: list[dict]) -> dict:
    """An engine's counters are cumulative over its life: a phase's share is its last
    run's value less this run's, the engine's run just before the phase's first ({} if
    none; ``in_order``: the engine's runs in run order)."""
    first = next(i for i, r in enumerate(in_order) if r is phase_runs[0])
    return in_order[first - 1] if first > 0 else {}


def phase_share(in_order: list[dict], phase_runs: list[dict], key: str) -> int:
    """A phase's share of the cumulative counter ``key`` (see run_before)."""
    return (phase_runs[-1].get(key) or 0) - (run_before(in_order, phase_runs).get(key) or 0)


def echo_decode_prefetch(runs: list[dict]) -> dict | None:
    """The decode prefetch mode echo_paper ran (the product's default unless an A/B set
    it) and, under ``auto``, in how many of each phase's decode steps its rule ran it:
    [on, all]. None when echo_paper did not run."""
    in_order = [r for r in runs if r.get("engine") == PREFETCH_ON]
    if not in_order:
        return None
    steps = {}
    for phase in dict.fromkeys(r["phase"] for r in in_order):
        own = find_all(runs, PREFETCH_ON, phase)
        if own[-1].get("prefetch_steps"):
            before = run_before(in_order, own).get("prefetch_steps") or [0, 0]
            steps[phase] = [a - b for a, b in zip(own[-1]["prefetch_steps"], before, strict=True)]
    return {"mode": in_order[0]["echo_options"]["fuse_decode"], "steps_on_all": steps}


def prefetch_auto(runs: list[dict]) -> dict | None:
    """ECHO with the decode prefetch under its rule (PREFETCH_ON, auto) against ECHO
    without it (PREFETCH_OFF), phase by phase (interleaved repeats): throughput ratio with
    its range, the hit rate, the decode steps the rule ran it in, and whether their greedy
    outputs agree token for token. None when the A/B did not run (``--decode-prefetch``)."""
    out = {}
    in_order = [r for r in runs if r.get("engine") == PREFETCH_ON]
    for phase in ("full", "random"):
        autos, offs = find_all(runs, PREFETCH_ON, phase), find_all(runs, PREFETCH_OFF, phase)
        if not autos or not offs:
            continue
        mid, lo, hi = ratio_range(autos, offs)
        staged = phase_share(in_order, autos, "prefetched_rows")
        used = phase_share(in_order, autos, "prefetch_hits")
        out[phase] = {
            "ratio": round(mid, 3),
            "ratio_min": round(lo, 3),
            "ratio_max": round(hi, 3),
            "repeats": len(autos),
            "hit_rate_mean": round(statistics.mean(autos[0]["hit_rate_per_layer"]), 4),
            "prefetch_steps_on_all": autos[-1].get("prefetch_steps"),
            "prefetched_rows": autos[-1].get("prefetched_rows"),
            "prefetch_hits": autos[-1].get("prefetch_hits"),
            "phase_staged_rows": staged,
            "phase_staged_used": used,
            "phase_precision": round(used / staged, 4) if staged > 0 else None,
            "outputs_equal": all(
                a["outputs"] == o["outputs"] for a, o in zip(autos, offs, strict=False)
            ),
        }
    return out or None
