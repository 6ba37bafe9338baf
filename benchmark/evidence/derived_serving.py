"""Derived values (``{@name}``) of the serving sweeps' records (``bench.plot --record``,
benchmark/serving_sweep.sh, benchmark/e2e_sweep.sh): the sweep's knobs, its prompt
lengths, pools, throughput ratios and ITL ranges, task mixes, and the earlier runs."""

from __future__ import annotations

import re

from sglang_echo.bench.datasets import INFINITEBENCH_INPUT_RANGE

from .formats import FORMATS, count, ratio, slashed, span, tokens
from .records import SERVING_HISTORY, Records
from .template import derived

CONFIG_POOLS = re.compile(
    r"no-offload pool (\d+) tokens; (?:offload|ECHO) host pool (\d+) tokens, "
    r"NSA_DEV_CACHE_SIZE (\d+)"
)
KNOB = re.compile(r"^([A-Z][A-Z0-9_]*)=(\S*)$")


def _config_lines(d: dict) -> list[str]:
    lines: list[str] = []
    for c in d.get("config", []):  # serving_sweep.sh: lines; bench.plot --record: files
        lines += [c] if isinstance(c, str) else c["lines"]
    return lines


@derived
def knobs(d: dict, _r: Records) -> dict[str, str]:
    """The environment knobs (``NAME=value`` words) of the record's first sweep command,
    or of its config lines (serving_sweep.sh writes them there)."""
    out: dict[str, str] = {}
    for ln in [*d.get("sweeps", [])[:1], *_config_lines(d)]:
        for word in ln.split():
            if m := KNOB.match(word):
                out.setdefault(m.group(1), m.group(2))
    return out


@derived
def infinitebench_prompts(d: dict, r: Records) -> str:
    """The synthetic InfiniteBench-like prompt lengths a sweep sent
    (``bench.datasets.synthetic_infinitebench``'s rule at its CONTEXT and MAX_OUTPUT_LEN)."""
    k = knobs(d, r)
    context, out = int(k["CONTEXT"]), int(k["MAX_OUTPUT_LEN"])
    cap = max(1, min(out, context // 4))
    lo, hi = INFINITEBENCH_INPUT_RANGE
    scale = min(1.0, (context - cap) / hi)
    return f"{tokens(round(lo * scale))}-{tokens(round(hi * scale))} tokens, outputs <= {cap}"


@derived
def serving(d: dict, _r: Records) -> str:
    """Pools, throughput ratios by rate, ITL ranges (and lost requests) of a sweep."""
    runs = d["metrics"]["runs"]
    ratios = d["metrics"]["offload_over_no_offload_output_throughput"]["all"]
    off, base = runs["offload"], runs["no-offload"]

    def over(key: str, fmt) -> str:
        a = [v[key] for v in off.values() if v.get(key) is not None]
        b = [v[key] for v in base.values() if v.get(key) is not None]
        return f"{span(a, fmt)} ms vs {span(b, fmt)} ms"

    pools = {m.groups() for ln in _config_lines(d) if (m := CONFIG_POOLS.search(ln))}
    pool = ""
    if len(pools) == 1:
        plain, host, dev = (int(x) for x in pools.pop())
        pool = f"no-offload {count(plain)} tokens vs ECHO {count(host)} host tokens + {count(dev)} device slots; "
    parts = [
        f"{pool}ECHO over no-offload output throughput {' / '.join(map(ratio, ratios.values()))}"
        f" at rates {' / '.join(ratios)}",
        f"median ITL {over('median_itl_ms', FORMATS['f1'])}",
    ]
    if all(v.get("p99_itl_ms") is not None for v in [*off.values(), *base.values()]):
        parts.append(f"p99 ITL {over('p99_itl_ms', FORMATS['f0'])}")
    done = [v.get("completed") for v in [*off.values(), *base.values()]]
    if None not in done and len(set(done)) > 1:  # some run lost requests: say which
        parts.append(
            f"requests completed per rate: ECHO {slashed([v['completed'] for v in off.values()], count)}, "
            f"no-offload {slashed([v['completed'] for v in base.values()], count)}"
        )
    return "; ".join(parts)


@derived
def task_ratios(d: dict, _r: Records) -> str:
    tasks = d["metrics"]["tasks"]
    return ", ".join(
        f"{name} {ratio(runs['offload']['tok_s'] / runs['no-offload']['tok_s'])}"
        for name, runs in tasks.items()
    )


@derived
def task_spread_ratios(d: dict, _r: Records) -> str:
    """Each task's ratio as median (min-max) over the runs: one run of a task lasts a few
    seconds, so a single ratio cannot tell an effect from the spread."""
    return ", ".join(
        f"{name} {ratio(t['median'])} ({ratio(t['min'])}-{ratio(t['max'])})"
        for name, t in d["metrics"]["tasks"].items()
    )


@derived
def history_serving(_d: dict, r: Records) -> str:
    return "; ".join(f"{rel.split('/')[-2]}: {serving(r(rel), r)}" for rel in SERVING_HISTORY)
