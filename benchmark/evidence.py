"""``python -m benchmark.evidence [--write FILE... | --check FILE...]``: the generated blocks
of README.md and docs/, from the records under ``benchmark/results/`` and the code's checks.

A block sits between ``<!-- NAME:begin ... -->`` and ``<!-- NAME:end -->``; three names:

- ``results`` (README.md): ``RESULTS``, one short table, a row per headline number, each
  read from one field of one record.
- ``evidence`` (docs/EVIDENCE.md): ``EVIDENCE``, every measured claim; a row is a list of
  facts, each a sentence with the values of named fields of a record.
- ``errors`` (docs/ERRORS.md): ``ERRORS``, the messages a user meets for a bad setting,
  each produced by calling the code path that checks it (nothing is copied by hand).

Every block is a table in this file, and every number in it is read from a record by
name: a fact is a sentence whose placeholders name a record's field and its format
(``{metrics.logits_us:us}``: the field ``metrics.logits_us``, in microseconds; FORMATS)
or a value derived from the record (``{@name.field:format}``: DERIVED, for ratios,
ranges, loops over a record's entries, another record's field beside it); a fact that
starts with "?" is left out where its record lacks the field; a row names the record (and
any other it reads, named in its record column). An error row names the check it calls
and that call's arguments (``CHECKS``). Labels: *measured* (timed or
counted on the device the record names), *simulated* (a CPU simulation over measured
traces), *estimate* (a roofline or bound derived from measured numbers, not itself
timed). Published numbers of others (ECHO's figures, DeepSeek-V3.2's hit rates) are not
records: the prose names them as such.

``--write FILE`` replaces every block FILE holds with the generator's; ``--check FILE``
exits 1 and lists every number of a block that disagrees with the generator (and any row
added, missing or reworded), and every measured-looking figure in FILE's prose outside the
blocks (``prose_figures``: times, speedups, bandwidths, percentages, fractions,
approximate or counted quantities, less code, versions and ``ALLOWED_FIGURES``), so the
documents and the records cannot drift apart. tests/repo/test_evidence.py runs both over
README.md and docs/*.md.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sglang_echo.bench.datasets import INFINITEBENCH_INPUT_RANGE

NUMBER = re.compile(r"-?\d+(?:[.,]\d+)*(?:e[-+]?\d+)?")
RESULTS_DIR = "benchmark/results"


# ---- formats: one rule per kind of number ------------------------------------------------


def us(x: float) -> str:
    """Microseconds: whole above 100, one decimal below."""
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}"


def ms(x: float) -> str:
    return f"{x:.2f}"


def ratio(x: float) -> str:
    return f"{x:.2f}x"


def f2(x: float) -> str:
    return f"{x:.2f}"


def f3(x: float) -> str:
    return f"{x:.3f}"


def count(x: float | str) -> str:
    return f"{float(x):,.0f}"


def yes(flag: bool) -> str:
    return "yes" if flag else "NO"


def tokens(x: float) -> str:
    """A token count as the documents write pool sizes: 200K, 1.8M; else exact."""
    if x >= 1_000_000 and x % 100_000 == 0:
        return f"{x / 1e6:g}M"
    if x >= 1000 and x % 1000 == 0:
        return f"{x / 1e3:g}K"
    return count(x)


def span(values, fmt: Callable[[Any], str]) -> str:
    """min-max of ``values`` (one value if they agree at this precision)."""
    values = list(values)
    lo, hi = fmt(min(values)), fmt(max(values))
    return lo if lo == hi else f"{lo}-{hi}"


def slashed(values, fmt: Callable[[Any], str]) -> str:
    return "/".join(fmt(v) for v in values)


# By name, for facts; a name followed by "-" writes a list (or a dict's values) as its
# range, followed by "/" as a/b/c (a dict's values in key order).
FORMATS: dict[str, Callable[[Any], str]] = {
    "": str,
    "us": us,
    "ms": ms,
    "x": ratio,
    "f0": lambda v: f"{v:.0f}",
    "f1": lambda v: f"{v:.1f}",
    "f2": f2,
    "f3": f3,
    "g": lambda v: f"{v:g}",
    "sci": lambda v: f"{v:.1e}",
    "n": count,
    "tok": tokens,
    "yes": yes,
    "M": lambda v: f"{v / 1e6:.1f}M",  # millions, one decimal
    "MB": lambda v: f"{v / 1e6:.0f} MB",
    "keys": lambda v: "/".join(sorted(v)),  # a dict's keys, a/b/c
}


def formatter(name: str) -> Callable[[Any], str]:
    if name[-1:] == "-":
        one = FORMATS[name[:-1]]
        return lambda v: span(v.values() if isinstance(v, dict) else v, one)
    if name[-1:] == "/":
        one = FORMATS[name[:-1]]
        return lambda v: slashed([v[k] for k in sorted(v)] if isinstance(v, dict) else v, one)
    return FORMATS[name]


# ---- records, their fields, and the facts read from them --------------------------------


class Records:
    """Loads records relative to the repository root (cached)."""

    def __init__(self, root: Path):
        self.root = root
        self.cache: dict[str, dict] = {}

    def __call__(self, rel: str) -> dict:
        if rel not in self.cache:
            self.cache[rel] = json.loads((self.root / rel).read_text())
        return self.cache[rel]


def rec(name: str) -> str:
    """A record's path from the repository root, by its path under benchmark/results/."""
    return f"{RESULTS_DIR}/{name}"


def field(d: Any, path: str) -> Any:
    """The value at a dotted path of a record (``metrics.runs.offload.inf``); a number
    indexes a list. A missing key raises KeyError naming the whole path."""
    value = d
    for key in path.split("."):
        try:
            value = value[int(key)] if isinstance(value, list) else value[key]
        except (KeyError, IndexError, ValueError, TypeError):
            raise KeyError(f"no field {path!r} (stopped at {key!r})") from None
    return value


# Values derived from a record (ratios, ranges, loops over its entries, another record's
# field beside it): ``{@name}`` in a fact calls DERIVED[name](record, records).
DERIVED: dict[str, Callable[[dict, Records], Any]] = {}


def derived(fn: Callable[[dict, Records], Any]) -> Callable[[dict, Records], Any]:
    DERIVED[fn.__name__] = fn
    return fn


PLACEHOLDER = re.compile(r"\{([^{}:]+)(?::([^{}]*))?\}")


def fill(template: str, d: dict, r: Records) -> str:
    """``template`` with each ``{field.path:format}`` (or ``{@derived:format}``) replaced by
    the record's value, written in that format (none: as it is)."""

    def value(m: re.Match) -> str:
        path, fmt = m.group(1), m.group(2) or ""
        if path.startswith("@"):  # {@name.sub.path}: a field of the derived value
            name, _, sub = path[1:].partition(".")
            v = DERIVED[name](d, r)
            v = field(v, sub) if sub else v
        else:
            v = field(d, path)
        return formatter(fmt)(v)

    return PLACEHOLDER.sub(value, template)


# A fact: a template read from the row's record, or (record, template) for another record.
# A template starting with "?" is left out when one of its fields is missing or None (fields
# that only some runs write).
Fact = str | tuple[str, str]


def render_fact(fact: Fact, d: dict, r: Records) -> str | None:
    rel, template = fact if isinstance(fact, tuple) else (None, fact)
    d = r(rel) if rel else d
    if not template.startswith("?"):
        return fill(template, d, r)
    try:
        return fill(template[1:], d, r)
    except (KeyError, TypeError):
        return None


def source(d: dict, rel: str, kind: str = "measured") -> str:
    return f"`{rel}` ({kind}; {d['device']}, {d['date']})"


@dataclass(frozen=True)
class Row:
    """A claim of docs/EVIDENCE.md: its facts, joined by "; ", read from ``record`` (and
    ``also``, named beside it in the record column)."""

    claim: str
    record: str
    facts: tuple[Fact, ...]
    kind: str = "measured"
    also: tuple[str, ...] = ()

    def render(self, r: Records) -> tuple[str, str, str]:
        d = r(self.record)
        text = "; ".join(t for f in self.facts if (t := render_fact(f, d, r)) is not None)
        srcs = ", ".join(source(r(rel), rel, self.kind) for rel in (self.record, *self.also))
        return self.claim, text, srcs


@dataclass(frozen=True)
class Result:
    """A row of README's results table: one value of one record."""

    label: str
    record: str
    value: str  # a fact's template

    def render(self, r: Records) -> tuple[str, str, str]:
        d = r(self.record)
        return fill(self.label, d, r), fill(self.value, d, r), f"`{self.record}` ({d['date']})"


# ---- derived values ---------------------------------------------------------------------


@derived
def harness_prefetch(d: dict, r: Records) -> dict | None:
    """The harness configuration that ran the plugin's decode prefetch (None: none did)."""
    return next((x for x in d.get("results", []) if x.get("decode_prefetch")), None)


def _engines(d: dict) -> dict[str, dict]:
    """The study's engines by label (pool, dev_cache and host are token counts)."""
    return {e["label"]: e for e in d["config"]["engines"]}


@derived
def paper_pools(d: dict, _r: Records) -> str:
    no, echo = _engines(d)["noff_paper"], _engines(d)["echo_paper"]
    return (
        f"no-offload pool {tokens(no['pool'])}, ECHO {tokens(echo['dev_cache'])} device slots + "
        f"{tokens(echo['host'])} host tokens"
    )


@derived
def paper_pool(d: dict, _r: Records) -> int:
    return _engines(d)["noff_paper"]["pool"]


@derived
def same_pools(d: dict, _r: Records) -> str:
    """Both backends at the same pool sizes: each size and its ratio."""
    pools = d["metrics"]["details"]["same_pools"]
    return ", ".join(f"{tokens(int(size))} {ratio(v['ratio'])}" for size, v in pools.items())


@derived
def compared(d: dict, _r: Records) -> str:
    """How many requests the lossless check compared, each over at least how many tokens
    (records from before the study counted them say nothing)."""
    c = d["metrics"]["details"]["lossless_under_eviction"]
    if "requests_compared" not in c:
        return ""
    return (
        f" over all {c['requests_compared']} requests, at least {c['min_tokens_per_request']} each"
    )


@derived
def profile_difference(d: dict, _r: Records) -> str:
    """ECHO minus no-offload, ms per step by kernel category, at the low-load batch."""
    low = d["metrics"]["breakdown_low_load"]
    pn, pe = (low[k]["profiler"]["ms_per_step"] for k in ("no_offload", "echo"))
    extra = {k: pe.get(k, 0.0) - pn.get(k, 0.0) for k in sorted(set(pn) | set(pe))}
    return ", ".join(f"{k} {v:+.3f}" for k, v in extra.items() if abs(v) >= 0.005)


@derived
def bf16_steps(_d: dict, r: Records) -> dict:
    """The bf16 study's step times, beside the fp8 study's."""
    return r(STUDY)["metrics"]["breakdown"]


@derived
def equal_hbm(d: dict, _r: Records) -> dict:
    """The equal-HBM runs with the highest ratio: ECHO's and the HiSparse-like one's."""
    det = d["metrics"]["details"]
    best = {k: max(det[k].values(), key=lambda v: v["ratio"]) for k in ("equal_hbm_380k",)}
    best["hisparse"] = max(det["hisparse_equal_hbm_380k"].values(), key=lambda v: v["ratio"])
    return {"echo": best["equal_hbm_380k"], "hisparse": best["hisparse"]}


def _oracle(d: dict, kind: str) -> dict[str, dict]:
    return {
        k.split("/")[1]: v for k, v in d.items() if k.startswith("oracle/") and k.endswith(kind)
    }


@derived
def oracle(d: dict, _r: Records) -> dict:
    """The oracle's configs: float32's worst differences, bfloat16's errors per config."""
    f32, b16 = _oracle(d, "/float32").values(), _oracle(d, "/bfloat16").values()
    return {
        "configs": "/".join(_oracle(d, "/float32")),
        "n": len(f32),
        "max_abs": max(v["max_abs_logit_diff"] for v in f32),
        "max_rel_l2": max(v["rel_l2"] for v in f32),
        "topk_mismatches": [v["topk_mismatch_positions"] for v in f32],
        "ours": [v["rel_l2_vs_fp32_ours"] for v in b16],
        "transformers": [v["rel_l2_vs_fp32_transformers"] for v in b16],
    }


@derived
def pivot_equal(d: dict, _r: Records) -> bool:
    p = d["metrics"]["topk_pivot"]
    return all(p[f"{s}_equal"] for s in ("steady", "drift", "one_new_row", "all_new"))


@derived
def topk_over_torch(d: dict, _r: Records) -> float:
    g = d["metrics"]["graph_replayed_us"]
    return g["topk"] / g["torch_topk"]


@derived
def flashinfer_modes(d: dict, _r: Records) -> str:
    modes = []
    for name, f in d["metrics"]["flashinfer"].items():
        ties = "same set on ties" if f.get("same_set_tie_heavy") else "another set on ties"
        modes.append(
            f"{name} {us(f['us'])} ({us(f['us_b1'])}; {ties})" if "us" in f else f"{name} missing"
        )
    return "; ".join(modes)


def _adapters(d: dict) -> dict[str, dict]:
    return {k: v for k, v in d["metrics"]["serving_adapter"].items() if isinstance(v, dict)}


@derived
def adapters(d: dict, _r: Records) -> str:
    """FlashInfer in our contract: equal to the radix select's tensor?, then each form's times."""
    cells = []
    for name, v in _adapters(d).items():
        checks = [x for k, x in v.items() if k.startswith("equal_")]
        timed = f"{us(v['us'])} ({us(v['us_b1'])})" if "us" in v else "not timed"
        cells.append(
            f"{name} {timed}"
            if all(checks)
            else f"{name}: equal {sum(checks)} of {len(checks)} checks, {timed}"
        )
    equal = all(x for v in _adapters(d).values() for k, x in v.items() if k.startswith("equal_"))
    return f"in our contract (sorted, ties low; our very tensor: {yes(equal)}): {'; '.join(cells)}"


@derived
def adapter_wins(d: dict, _r: Records) -> str:
    """Where in rows x context the best adapter beats ours, if anywhere."""
    sweep, parts = d["metrics"]["by_rows"], []
    for context in sorted({row["context"] for row in sweep}, reverse=True):
        rows = [row for row in sweep if row["context"] == context]
        wins = []
        for row in rows:
            best = min(v for k, v in row.items() if k.endswith("_us") and k != "ours_us")
            if best < row["ours_us"]:
                wins.append(f"{row['rows']} ({us(best)} vs {us(row['ours_us'])})")
        parts.append(
            f"{count(context)} keys, {rows[0]['rows']}-{rows[-1]['rows']} rows: the best adapter "
            f"beats ours at {', '.join(wins) if wins else 'no row count'}"
        )
    return "; ".join(parts)


@derived
def stages(d: dict, _r: Records) -> str:
    return ", ".join(f"{k} {us(v)}" for k, v in d["metrics"]["resolve_stage_us"].items())


@derived
def launch_shapes(d: dict, _r: Records) -> str:
    """The look-back resolve's launch-shape sweep: fastest, slowest and the default shape,
    with the ticket against program-ordered tiles at the default, all from one sweep."""
    rows = [r for r in d["metrics"]["launch_shape_sweep"] if r["exact"]]

    def name(r: dict) -> str:
        order = ", program-ordered" if r.get("ordered_tiles") else ""
        return f"{r['lane_block']} lanes x {r['num_warps']} warps{order}"

    def at(lanes: int, warps: int, ordered: bool) -> dict | None:
        hits = [
            r for r in rows
            if (r["lane_block"], r["num_warps"], bool(r.get("ordered_tiles"))) == (lanes, warps, ordered)
        ]  # fmt: skip
        return hits[0] if hits else None

    fast, slow = min(rows, key=lambda r: r["us"]), max(rows, key=lambda r: r["us"])
    # Records before the look-back had its own shape ran it at 1024 lanes x 8 warps.
    shape = d["metrics"].get("lookback_default_shape", {"lane_block": 1024, "num_warps": 8})
    lanes, warps = shape["lane_block"], shape["num_warps"]
    default, ordered = at(lanes, warps, False), at(lanes, warps, True)
    parts = [
        f"{len(rows)} shapes, each checked against the reference first: fastest {name(fast)} "
        f"{us(fast['us'])} us, slowest {name(slow)} {us(slow['us'])} us"
    ]
    if default:
        parts.append(f"the default ({lanes} lanes x {warps} warps, ticket) {us(default['us'])} us")
    if ordered:
        parts.append(f"with program-ordered tiles {us(ordered['us'])} us")
    return "; ".join(parts)


@derived
def victim_policies(d: dict, _r: Records) -> str:
    t = d["metrics"]["trained"]
    names = {
        "lru_bucketed": "bucketed LRU",
        "lru_exact": "exact LRU",
        "clock": "CLOCK",
        "fifo": "FIFO",
    }
    policies = (
        f"{label} {slashed([t[s]['mean'][key] for s in t], f3)}" for key, label in names.items()
    )
    return f"{'/'.join(f'{float(s):g}' for s in t)} x batch x top-k: {', '.join(policies)}"


@derived
def cases(d: dict, _r: Records) -> dict:
    """The record's cases, one list per key (and the distinct values of the settings)."""
    out = {k: [c[k] for c in d["cases"]] for k in d["cases"][0]}
    out["n"] = len(d["cases"])
    for k in ("history", "queries", "hit_rate"):
        if k in out:
            out[f"{k}_set"] = sorted(set(out[k]))
    out["history_K"] = [f"{h // 1024}K" for h in out.get("history_set", [])]
    return out


@derived
def decode_prefetch(d: dict, _r: Records) -> dict:
    """The staged prefetch's gains by hit rate (with the range of the interleaved rounds),
    the allocating design's and Figure 18's in the same run, and the case at hit 0.9
    (else the middle one)."""
    m = d["metrics"]
    by_hit = {c["hit_rate"]: c for c in d["cases"]}
    hits = [h for h in sorted(by_hit) if h < 1.0]

    def at(values: dict, keys) -> str:
        return f"{' / '.join(ratio(values[k]) for k in keys)} at hit {' / '.join(f'{h:g}' for h in hits)}"

    keys = [f"hit_{h}" for h in hits]
    out = {
        "speedup": at({f"hit_{h}": by_hit[h]["speedup"] for h in hits}, keys),
        "slowdown": f"{ratio(m['slowdown_at_hit_1.0'])} at hit 1.0",
        # Records before the allocating and in-kernel designs left the package timed them.
        "alloc": at(m["alloc_speedup"], keys) if "alloc_speedup" in m else "not timed",
        "fig18": at(m["fig18_speedup"], keys) if "fig18_speedup" in m else "not timed",
        # Records before 58a4eb4 timed one staged design (chunked) and had no per-design keys.
        "in_kernel": at(m["in_kernel_speedup"], keys) if "in_kernel_speedup" in m else "not timed",
        "fig18_chunked": (
            at(m["fig18_chunked_speedup"], keys) if "fig18_chunked_speedup" in m else "not timed"
        ),
        "ranges": "; ".join(f"{'-'.join(f2(x) for x in m['speedup_range'][k])}" for k in keys),
    }
    c = by_hit[0.9 if 0.9 in by_hit else sorted(by_hit)[len(by_hit) // 2]]
    out["case"] = c
    return out


@derived
def recall_widths(d: dict, _r: Records) -> str:
    m = d["metrics"]
    widths = sorted(int(k.rsplit("_", 1)[1]) for k in m if k.startswith("recall_GBps_"))
    misses = sorted({d["detail"][str(w)]["misses"] for w in widths})
    parts = [
        f"{m[f'recall_GBps_{w}']:.1f} GB/s at {w} B rows ({f2(m[f'ratio_{w}'])} of H2D; "
        f"`index_select` {m[f'torch_index_select_GBps_{w}']:.1f})"
        for w in widths
    ]
    return f"UVA gather of {'/'.join(count(x) for x in misses)} random rows: " + "; ".join(parts)


@derived
def mla(d: dict, _r: Records) -> dict:
    """Sparse MLA's ratios: torch over the kernel, the kernel over its roofline, fp8 over bf16."""
    m = d["metrics"]
    return {
        "decode_speedup": m["decode_torch_us"] / m["decode_us"],
        "decode_over_roofline": m["decode_us"] / m["decode_roofline_us"],
        "prefill_speedup": m["prefill_torch_us"] / m["prefill_us"],
        "prefill_over_roofline": m["prefill_us"] / m["prefill_roofline_us"],
        "fp8_over_bf16": m["decode_fp8_us"] / m["decode_default_us"],
        "configs": len(m["runs"]["decode"]["configs"]),
    }


@derived
def mla_batch_sweep(d: dict, _r: Records) -> str:
    """Decode at the study's batches, graph-replayed, peers beside."""
    sweep, parts = d["metrics"]["batch_sweep"], []
    for b, row in sweep["batches"].items():
        cells = [
            f"{k.removeprefix('ours_')} {us(v['us'])}"
            + ("" if v["slot_invariant"] else " (NOT slot-invariant)")
            + (" (eager)" if "graph_error" in v else "")
            for k, v in row.items()
            if isinstance(v, dict) and v.get("us")
        ]
        cells += [
            f"{k} failed ({v['error'][:80]})"
            for k, v in row.items()
            if isinstance(v, dict) and "error" in v
        ]
        parts.append(f"batch {b}: " + ", ".join(cells))
    missing = [f"; {peer} not measured ({why})" for peer, why in sweep["missing_peers"].items()]
    return "; ".join(parts) + "".join(missing)


BEFORE_ISSUE_15 = "history/2026-12-01-kernels-a0f072b"  # the records issue 15 started from
KERNEL_RECORDS = ("indexer", "sparse_mla", "cache_ops")


def per_request_ops(r: Records, folder: str = "") -> tuple[int, dict[str, float]]:
    """Each decode op's batch time (us) at the kernel records' common batch; sparse MLA's
    default graph-replayed from the batch sweep where the record has it, else eager."""
    ix, mla_, co = (r(rec(f"{folder}{n}.json"))["metrics"] for n in KERNEL_RECORDS)
    batch = ix["batch"]
    if not (mla_["sizes"]["batch"] == co["batch"] == batch):
        raise ValueError("the kernel records were timed at different batches")
    replayed = mla_.get(f"decode_b{batch}_ours_default_us")
    return batch, {
        "indexer logits": ix["logits_us"],
        "top-k": ix["topk_us"],
        "sparse MLA (the default config)" + ("" if replayed else ", eager"): (
            replayed or mla_["decode_default_us"]
        ),
        "cache management": co["us_per_layer_step"],
        "recall": co["us_per_layer_step_with_recall"] - co["us_per_layer_step"],
    }


@derived
def per_request(_d: dict, r: Records) -> dict:
    """Each op's cost per request and layer, beside the same from ``BEFORE_ISSUE_15``."""
    batch, ops = per_request_ops(r)
    _, before = per_request_ops(r, BEFORE_ISSUE_15 + "/")
    parts = []
    for (name, v), (old_name, old_v) in zip(ops.items(), before.items(), strict=True):
        how = old_name[len(name) :] if old_name.startswith(name) else ""  # ", eager"
        parts.append(f"{name} {us(v / batch)} (was {us(old_v / batch)}{how})")
    total, was = sum(ops.values()) / batch, sum(before.values()) / batch
    return {"batch": batch, "ops": ", ".join(parts), "total": total, "was": was}


@derived
def sm90(d: dict, _r: Records) -> dict:
    m = d["metrics"]
    free = [c for c in m["configs"] if c["spill_store_bytes"] == 0]
    fp8, dft = m["fp8_default"], m["default"]
    stores = (
        f"element by element ({fp8['shared_stores_scalar']} scalar stores against {dft['shared_stores_scalar']} at bf16)"
        if fp8["shared_stores_scalar"]
        else f"as 16-byte vectors ({fp8['shared_stores_v4']} vector stores, as at bf16)"
    )
    merges = m["merge"]
    return {
        "configs": len(m["configs"]),
        "spill_free": len(free),
        "spill_free_wgmma": sum(c["wgmma"] > 0 for c in free),
        "fp8_stores": stores,
        "merge_splits": "/".join(str(x["splits"]) for x in merges),
        "merge_registers": [x["registers"] for x in merges],
        "merge_spills": max(x["spill_store_bytes"] for x in merges),
        "merge": merges[0],
    }


@derived
def trained(d: dict, _r: Records) -> dict:
    """The trained-vs-untrained pairs (``{@trained.KEY}``: "a vs b") and the hit rates at
    each cache size."""
    sbs = d["metrics"]["side_by_side"]
    prefix = "echo_shared_hit_rate_x"
    mults = sorted((k.removeprefix(prefix) for k in sbs if prefix in k), key=float)
    out = {
        k: f"{f2(v['trained'])} vs {f2(v['untrained'])}"
        for k, v in sbs.items()
        if isinstance(v, dict) and "untrained" in v
    }
    out["mults"] = "/".join(mults)
    for which in ("trained", "untrained"):
        out[f"hits_{which}"] = slashed([sbs[f"{prefix}{x}"][which] for x in mults], f2)
    return out


# ---- serving sweeps (bench.plot --record) -----------------------------------------------

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
def history_serving(_d: dict, r: Records) -> str:
    return "; ".join(f"{rel.split('/')[-2]}: {serving(r(rel), r)}" for rel in SERVING_HISTORY)


# ---- the records ------------------------------------------------------------------------

STUDY = rec("e2e_study.json")
STUDY_FP8 = rec("e2e_study_fp8.json")
SWEEP = rec("e2e_sweep/e2e_sweep.json")
INDEXER = rec("indexer.json")
SERVING_HISTORY = (
    rec("history/serving/h200-2026-11-29/serving_sweep.json"),
    rec("history/serving/h200-before-prefill-fix/serving_sweep.json"),
)

# ---- docs/EVIDENCE.md: every claim, fact by fact ----------------------------------------
# Each fact names its fields: {metrics.x:us} is the record's metrics.x in microseconds
# (FORMATS), {@name...} a value derived from the record (DERIVED).

SAME_POOLS = (
    "the same decode node with both KV pools at the same size (no-offload pool, ECHO's "
    "NSA_DEV_CACHE_SIZE), {@knobs.NUM_PROMPTS} prompts"
)


def rate_latency(rate: str) -> str:
    runs = "{metrics.runs.%s." + rate + ".%s:ms}"
    return (
        f"at rate {rate}: median TTFT {runs % ('offload', 'median_ttft_ms')} vs "
        f"{runs % ('no-offload', 'median_ttft_ms')} ms, median E2E "
        f"{runs % ('offload', 'median_e2e_latency_ms')} vs "
        f"{runs % ('no-offload', 'median_e2e_latency_ms')} ms"
    )


EVIDENCE: tuple[Row, ...] = (
    Row(
        "end-to-end decode study (issue 14)",
        STUDY,
        (
            "{config.layers} layers at DeepSeek-V3.2's attention dims + one DP worker's routed MoE at equal bytes, bf16 KV, "
            "fake-transfer decode node, prompts {config.prompt_tokens.0:n}-{config.prompt_tokens.1:n} tokens, locality "
            "`{metrics.locality_source}` (real indexer + exact top-k), rate inf (closed batch)",
            "ECHO / no-offload output throughput at the paper settings ({@paper_pools}) {metrics.ratio_paper_all_hbm:x} "
            "(batch {metrics.details.paper_all_hbm.echo_batch} vs {metrics.details.paper_all_hbm.no_offload_batch})",
            "?range {metrics.spread.ratio_paper_all_hbm.ratio_min:f2}-{metrics.spread.ratio_paper_all_hbm.ratio_max:f2}x "
            "over {metrics.repeats} interleaved repeats of each side",
            "at pools of {@same_pools}",
            "at equal HBM ({@paper_pool:tok}) {metrics.ratio_equal_hbm_380k:x}",
            "random keys (pessimistic, hit {metrics.details.random_keys_paper_all_hbm.echo_hit_rate_mean:f2}) "
            "{metrics.details.random_keys_paper_all_hbm.ratio:x}",
            "ECHO hit rate per layer {metrics.hit_rate_per_layer:f3-}",
            "?ECHO's decode prefetch `{metrics.echo_decode_prefetch.mode}`: on in "
            "{metrics.echo_decode_prefetch.steps_on_all.full.0:n} of {metrics.echo_decode_prefetch.steps_on_all.full.1:n} "
            "decode steps at the paper's setting, {metrics.echo_decode_prefetch.steps_on_all.random.0:n} of "
            "{metrics.echo_decode_prefetch.steps_on_all.random.1:n} on random keys",
            "batch {metrics.low_load_cost.per_batch:keys} cost {metrics.low_load_cost.per_batch:f3/} "
            "(mean {metrics.low_load_cost.mean:f3}, project target 0.015)",
            "?medians of steps alternated with no-offload's; ECHO with decode tokens host-only and the "
            "resolve in line (`echo_inline`, in the same alternation) {metrics.low_load_cost.inline_per_batch:f3/}",
            "step {metrics.breakdown.no_offload.step_ms_device:ms} ms (no-offload, batch {metrics.breakdown.no_offload.batch}) "
            "vs {metrics.breakdown.echo.step_ms_device:ms} ms (ECHO, batch {metrics.breakdown.echo.batch})",
            "greedy outputs equal under eviction ({metrics.details.lossless_under_eviction.evictions_per_step:n} evictions per step, {metrics.details.lossless_under_eviction.tokens_compared} tokens{@compared}): {metrics.details.lossless_under_eviction.greedy_outputs_equal:yes}",
            "without pressure at batch {metrics.details.greedy_outputs_equal_at_low_load:keys}: "
            "{metrics.details.greedy_outputs_equal_at_low_load:yes/}",
            "without pressure at batch {metrics.breakdown_low_load.echo.batch}: step {metrics.breakdown_low_load.echo.step_ms_device:ms} vs {metrics.breakdown_low_load.no_offload.step_ms_device:ms} ms, ECHO minus no-offload by kernel category (profiler, ms per step): "
            "{@profile_difference}; kernels per step {metrics.breakdown_low_load.echo.profiler.kernels} vs {metrics.breakdown_low_load.no_offload.profiler.kernels}",
            "HiSparse-like under eviction ({metrics.details.lossless_under_eviction_hisparse.evictions_per_step:n} evictions per step): {metrics.details.lossless_under_eviction_hisparse.greedy_outputs_equal:yes}",
        ),
    ),
    Row(
        "end-to-end study at fp8 KV (issues 14, 15)",
        STUDY_FP8,
        (
            "the same study with `--kv-cache-dtype fp8_e4m3` ({config.kv_row_bytes}-byte rows in every pool): ECHO / "
            "no-offload at the paper settings {metrics.ratio_paper_all_hbm:x}",
            "at pools of {@same_pools}",
            "hit rate per layer {metrics.hit_rate_per_layer:f3-}",
            "batch {metrics.low_load_cost.per_batch:keys} cost {metrics.low_load_cost.per_batch:f3/}",
            "steps at fp8 vs bf16 KV: no-offload batch {metrics.breakdown.no_offload.batch} "
            "{metrics.breakdown.no_offload.step_ms_device:ms} vs {@bf16_steps.no_offload.step_ms_device:ms} ms, ECHO batch "
            "{metrics.breakdown.echo.batch} {metrics.breakdown.echo.step_ms_device:ms} vs "
            "{@bf16_steps.echo.step_ms_device:ms} ms (the fp8 sparse-MLA kernel: see its row)",
            "the equal-HBM engines are not run at fp8",
        ),
        also=(STUDY,),
    ),
    Row(
        "ECHO vs a HiSparse-like per-request buffer (issue 14)",
        STUDY,
        (
            "same run, equal HBM to a {@paper_pool:tok}-token no-offload pool: ECHO (one shared cache per layer) "
            "{@equal_hbm.echo.ratio:x} at batch {@equal_hbm.echo.echo_batch}, hit {@equal_hbm.echo.echo_hit_rate_mean:f3}",
            "HiSparse-like (private {metrics.hisparse_device_buffer_size:n}-row buffers per request and layer, LRU inside; "
            "cache management in torch ops, not a fused kernel) {@equal_hbm.hisparse.ratio:x} at batch "
            "{@equal_hbm.hisparse.echo_batch}, hit {@equal_hbm.hisparse.echo_hit_rate_mean:f3}",
            "steps {@equal_hbm.echo.echo_step_ms:ms} / {@equal_hbm.hisparse.echo_step_ms:ms} / "
            "{@equal_hbm.echo.no_offload_step_ms:ms} ms (ECHO / HiSparse-like / no-offload batch "
            "{@equal_hbm.echo.no_offload_batch})",
        ),
    ),
    Row(
        "request-rate sweep, decode node (issue 14, Figure 12)",
        rec("e2e_sweep/e2e_sweep.json"),
        (
            "the study's {@knobs.LAYERS}-layer worker through the HTTP server as a fake-transfer decode node, "
            "{@knobs.NUM_PROMPTS} InfiniteBench-like prompts (synthetic, {@infinitebench_prompts}): {@serving}",
        ),
    ),
    Row(
        "served against the engine, one device call (issue 49)",
        rec("served_vs_study/served_vs_study.json"),
        (
            "the in-process study at the paper's setting ({metrics.study_ratio:x}) and the served Figure-12 sweep "
            "(96 prompts, rates 1 and inf) in one call on commit `{commit}`: served ECHO / no-offload at rate inf "
            "{metrics.served_ratio_inf:x}, served over study {metrics.served_over_study:f2} (goal 0.90); over the "
            "steady window {metrics.steady_ratio_inf:x}",
            "decode device time over wall time at rate inf: ECHO {metrics.echo_served_efficiency:f2}, no-offload "
            "{metrics.no_offload_served_efficiency:f2} (goals 0.90 / 0.93); mean decode batch "
            "{metrics.mean_decode_batch_inf:f1/} (no-offload / ECHO)",
            "ECHO's median ITL over no-offload's at rate 1 {metrics.itl_p50_ratio_rate1:f3} (goal 1.02)",
            "hit rate served {metrics.served_hit_rate:f3}, in the study {metrics.study_hit_rate:f3}",
            "admission (engine thread, per 100K-token request) p50 {metrics.admission_ms_p50:f1} ms, mean at rate inf "
            "{metrics.admission_ms_mean_inf:f1} ms (goal 2)",
            "graph captures during the runs {metrics.graph_captures_during_run:n} (all at start-up)",
            "greedy tokens equal between the servers at every rate: {metrics.outputs_equal:yes}",
            "?per rate (equal, compared) {metrics.outputs_equal_by_rate:}",
        ),
    ),
    Row(
        "request-rate sweep at pools of 200K (issue 14, Figure 13)",
        rec("e2e_sweep_200k/e2e_sweep.json"),
        (SAME_POOLS + ": {@serving}",),
    ),
    Row(
        "request-rate sweep at pools of 110K (issue 14, Figure 13)",
        rec("e2e_sweep_110k/e2e_sweep.json"),
        (
            SAME_POOLS
            + " (no-offload refuses, with a 400 that says why, the prompts whose tokens and output exceed its "
            "pool): {@serving}",
            rate_latency("2"),
        ),
    ),
    Row(
        "ShareGPT-like latency sweep (issue 14, Figure 15)",
        rec("e2e_sweep_sharegpt/e2e_sweep.json"),
        (
            "the same worker on one server that prefills and decodes, {@knobs.NUM_PROMPTS} ShareGPT-like chats "
            "(synthetic): {@serving}",
            rate_latency("inf"),
        ),
    ),
    Row(
        "task mixes (issue 14, Figure 14)",
        rec("e2e_sweep_tasks/e2e_sweep.json"),
        (
            "Figure 14's task mixes on the decode node (synthetic at InfiniteBench's task lengths and output lengths, "
            "{@knobs.TASK_NUM_PROMPTS} prompts each, rate {@knobs.TASK_RATES}), ECHO / no-offload output throughput: "
            "{@task_ratios}",
        ),
    ),
    Row(
        "model = transformers on the GPU",
        rec("gpu_checks.json"),
        (
            "float32 ({@oracle.n} configs): max abs logit difference at most {@oracle.max_abs:sci}, rel. L2 at most "
            "{@oracle.max_rel_l2:sci}, top-k mismatches {@oracle.topk_mismatches:n-}",
            "bfloat16 logits' rel. L2 to the float32 reference ({@oracle.configs}): ours {@oracle.ours:f2/}, "
            "transformers' {@oracle.transformers:f2/}",
        ),
    ),
    Row(
        "fp8 indexer logits (decode)",
        INDEXER,
        (
            "batch {metrics.batch} x {metrics.context:n} keys x {metrics.heads} heads x {metrics.dim} dims: logits "
            "{metrics.logits_us:us} us replayed ({metrics.eager_us.logits:us} us eager)",
            "roofline {metrics.roofline_us:us} us (estimate: keys read once at the {metrics.hbm_GBps:n} GB/s measured in "
            "the run) -> {metrics.logits_over_roofline:x}",
            "per-request `_scaled_mm` loop {metrics.torch_loop_us:us} us (the kernel {metrics.speedup_vs_torch_loop:x} "
            "faster)",
            "top-k sets equal to float64: {metrics.topk_sets_equal_vs_float64:yes}",
            "packed 132-byte rows {metrics.logits_packed_rows_us:us} us eager, 144-byte rows "
            "{metrics.graph_replayed_us.logits_padded_rows_144:us} us replayed "
            "({metrics.eager_us.logits_padded_rows_144:us} us eager)",
        ),
    ),
    Row(
        "top-k (decode)",
        INDEXER,
        (
            "radix-select kernel (the default) {metrics.graph_replayed_us.topk:us} us, `torch.topk` "
            "{metrics.graph_replayed_us.torch_topk:us} us ({@topk_over_torch:x}), tie-stable sort "
            "{metrics.graph_replayed_us.stable_sort_topk:us} us (replayed; eager {metrics.eager_us.topk:us} / "
            "{metrics.eager_us.torch_topk:us} / {metrics.eager_us.stable_sort_topk:us} us)",
            "kernel's sets equal the reference: {metrics.topk_kernel_sets_equal_reference:yes}",
            "?keys kept as candidates after the first digit {metrics.topk_candidate_share:f3} of all",
            "?pivot top-k (opt-in, `SGLANG_ECHO_TOPK_PIVOT=1`) {metrics.topk_pivot.steady_us:us} us settled, "
            "{metrics.topk_pivot.drift_us:us} us on a drifted query's pivots ({metrics.topk_pivot.drift_rows_served} of "
            "{metrics.topk_pivot.rows} rows served), {metrics.topk_pivot.one_new_row_us:us} us with one new row, "
            "{metrics.topk_pivot.all_new_us:us} us with none served; batch 1: {metrics.topk_pivot.steady_b1_us:us} / "
            "{metrics.topk_pivot.all_new_b1_us:us} us; the same tensor as the radix select in every state: "
            "{@pivot_equal:yes}",
        ),
    ),
    Row(
        "top-k peer (FlashInfer, issue 15)",
        rec("topk_peers.json"),
        (
            "{metrics.batch} x {metrics.context:n} keys, k {metrics.topk}, graph-replayed: radix select "
            "{metrics.ours.us:us} us (batch 1: {metrics.ours.us_b1:us}); FlashInfer alone, in any order: "
            "{@flashinfer_modes}",
            "{@adapters}",
            "the contract's sort {metrics.serving_adapter.finish_us:us} us ({metrics.serving_adapter.finish_us_b1:us}), "
            "the plain form's mask {metrics.serving_adapter.mask_us:us} us",
            "{@adapter_wins}",
        ),
    ),
    Row(
        "cache-management kernels",
        rec("cache_ops.json"),
        (
            "batch {metrics.batch} x top-k {metrics.topk}, {metrics.slots:n} slots, {metrics.evictions_per_step:n} "
            "evictions per step, hit rate {metrics.hit_rate:f3}: {metrics.us_per_layer_step:us} us per layer-step "
            "replayed ({metrics.us_per_layer_step_with_recall:us} us with recall), project target {metrics.target_us:us} us",
            "?the resolve's four look-back launches against the five-launch pipeline in the same run: "
            "{metrics.us_per_layer_step:us} vs {metrics.us_per_layer_step_pipeline:us} us "
            "({metrics.speedup_over_pipeline:f2}x)",
            "?{metrics.layer_steps_per_replay} layer-steps per graph replay, as a decode graph holds one per layer "
            "(one per replay, the earlier records' definition: {metrics.us_per_layer_step_single_replay:us} us; a "
            "replay of a one-kernel graph alone {metrics.graph_replay_floor_us:us} us); the floor of the launches: "
            "{metrics.launch_floor_us.1:us} us for one no-op launch per layer-step, {metrics.launch_floor_us.5:us} "
            "us for five chained",
            "?batch 1 with every selection resident (a decode node's placed prompt at low load): "
            "{metrics.us_per_layer_step_batch_1_resident:us} us per layer-step "
            "({metrics.us_per_layer_step_batch_1_resident_with_recall:us} us with the write and the recall), "
            "target {metrics.target_us_batch_1_no_eviction:us} us",
            "torch reference {metrics.torch_reference_us_per_layer_step:us} us; one sort of all priorities "
            "{metrics.exact_lru_sort_us:us} us; stages {@stages} us",
            "a decode step's management is the resolve's (its new tokens go to the host pool); with the append's "
            "allocation as before {metrics.us_per_layer_step_with_append:us} us",
            "eviction reserve {metrics.eviction_reserve:n} slots (the default)",
            "?batch 1 with nothing evicted (the default path: one program up to {metrics.one_program_lanes:n} lanes): "
            "{metrics.us_per_layer_step_batch_1_no_eviction:us} us per layer-step, target "
            "{metrics.target_us_batch_1_no_eviction:us} us; the resolve in one program against the launches past it: "
            "{metrics.one_program_study.batch_1.one_program_no_pressure_us:us} vs "
            "{metrics.one_program_study.batch_1.pipeline_no_pressure_us:us} us at batch 1, "
            "{metrics.one_program_study.batch_2.one_program_no_pressure_us:us} vs "
            "{metrics.one_program_study.batch_2.pipeline_no_pressure_us:us} us at batch 2, "
            "{metrics.one_program_study.batch_8.one_program_no_pressure_us:us} vs "
            "{metrics.one_program_study.batch_8.pipeline_no_pressure_us:us} us at batch 8",
            "?at batch 1 without pressure, append + resolve: {metrics.launch_chaining.unchained_acq_rel.batch_1_no_pressure_management_us:us}"
            " us with plain launches and ordered atomics, {metrics.launch_chaining.unchained_relaxed.batch_1_no_pressure_management_us:us}"
            " us relaxed, {metrics.launch_chaining.chained_relaxed.batch_1_no_pressure_management_us:us} us chained and relaxed (the "
            "default); the decode path {metrics.launch_chaining.chained_relaxed.batch_1_no_pressure_resolve_us:us} us ({metrics.launch_chaining.chained_relaxed.batch_1_no_pressure_decode_step_us:us} us with writes and recall, against {metrics.launch_chaining.unchained_acq_rel.batch_1_no_pressure_step_us:us} us before)",
            "?the look-back resolve's launch shapes (cache_ops_bench.py --sweep, one run): {@launch_shapes}",
            "?requests selecting in pairs (every id twice: the look-back's two-wait path): "
            "{metrics.us_per_layer_step_repeats:us} vs {metrics.us_per_layer_step_repeats_pipeline:us} us through the pipeline",
        ),
    ),
    Row(
        "batched release (issue 30)",
        rec("release.json"),
        (
            "a finished request's {details.config.tokens:n} tokens leave {details.config.layers} layers "
            "({details.config.slots:n} slots, {details.config.host:n} host tokens, {details.config.resident:n} resident "
            "per layer): one launch for all layers {metrics.batched_kernel_us:us} us, layer by layer in torch "
            "{metrics.per_layer_torch_us:us} us in {metrics.per_layer_torch_launches:n} launches "
            "({metrics.speedup_kernel_vs_per_layer:x} faster), a batched torch reference "
            "{metrics.batched_reference_us:us} us in {metrics.batched_reference_launches:n} launches",
            "the kernel {metrics.kernel_over_floor:x} its {metrics.floor_us:us} us floor (estimate)",
        ),
    ),
    Row(
        "plugin on the H200 without sglang's server (issue 31)",
        rec("plugin_gpu_harness.json"),
        (
            "sglang 0.5.23's pool, allocator and host-pool classes with the EchoCoordinator in sglang's decode "
            "choreography ({metrics.configs}): greedy tokens and logits bit-identical to the plain DSA pool's: "
            "{metrics.all_equal:yes} ({metrics.tokens_compared:n} tokens of {metrics.requests:n} requests)",
            "?{metrics.requests_aborted:n} of the requests aborted by their client mid-decode (released at once, "
            "outside result processing, while a step still decoding them may run)",
            "{metrics.steps:n} steps, all graph replays ({metrics.graph_replays:n}), {metrics.idle_steps:n} IDLE; "
            "{metrics.evictions_total:n} evictions in {metrics.steps_with_evictions:n} steps (at most "
            "{metrics.evictions_per_step_max:n} in one)",
            "ECHO launches per decode layer-step {metrics.launches_per_layer_step_total:n} "
            "({metrics.launches_per_layer_step:keys}); left clean: {metrics.left_clean:yes}",
            "?with the decode prefetch on ({@harness_prefetch.config}): {@harness_prefetch.prefetched_rows:n} rows "
            "staged from the indexer's logits, {@harness_prefetch.prefetch_hits:n} of them served misses, sglang's own "
            "indexer method hooked on that machine: {@harness_prefetch.indexer_hook_applied:yes}",
        ),
    ),
    Row(
        "allocation A/B (issue 29)",
        rec("alloc_ab.json"),
        (
            "current alloc.py against 617151e's, five interleaved rounds on one H200: batch 1 without eviction "
            "{metrics.cases.batch_1_no_eviction.current.median_us:us} vs "
            "{metrics.cases.batch_1_no_eviction.617151e.median_us:us} us, through the pipeline "
            "{metrics.cases.batch_1_no_eviction_pipeline.current.median_us:us} vs "
            "{metrics.cases.batch_1_no_eviction_pipeline.617151e.median_us:us} us, batch 48 full "
            "{metrics.cases.batch_48_full.current.median_us:us} vs {metrics.cases.batch_48_full.617151e.median_us:us} us",
        ),
    ),
    Row(
        "victim policies",
        rec("victim_policy.json"),
        ("mean hit rate over layers on the trained model's decode traces at {@victim_policies}",),
        kind="simulated on measured traces",
    ),
    Row(
        "prefill prefetch",
        rec("prefill_prefetch.json"),
        (
            "{@cases.n} cases ({@cases.history_K:/} history, {@cases.queries_set:/} queries, hit {@cases.hit_rate_set:g/}): "
            "prefetch on a side stream over the serial baseline {metrics.speedup:f2-}x replayed, pipelined "
            "{metrics.pipelined_speedup:f2-}x",
            "the recall it can hide {@cases.recall_ms:ms-} ms of a {@cases.baseline_graph_ms:ms-} ms baseline chunk",
            "all correct: {metrics.all_correct:yes}, wasted rows {metrics.total_wasted:n}",
        ),
    ),
    Row(
        "decode prefetch",
        rec("decode_prefetch.json"),
        (
            "batch {metrics.batch} x {metrics.context:n} context, {metrics.row_bytes}-byte rows: the staged prefetch "
            "in the default design ({metrics.default_design}: {metrics.stage_chunks} logits chunks, {metrics.stage_cap:n} "
            "staged rows per request) over none {@decode_prefetch.speedup} (ranges over {metrics.rounds} interleaved "
            "rounds {@decode_prefetch.ranges}), slowdown {@decode_prefetch.slowdown} (replayed)",
            "?the in-kernel design (the logits kernel stages and copies, {metrics.stage_block_n} keys a program), same "
            "run: {@decode_prefetch.in_kernel}; the allocating design: {@decode_prefetch.alloc}",
            "Figure 18's definition (logits + recall of every miss, top-k and cache management left out), the "
            "in-kernel design as ECHO's: {@decode_prefetch.fig18}; the chunked design: {@decode_prefetch.fig18_chunked}",
            "step at hit {@decode_prefetch.case.hit_rate:g}: logits {@decode_prefetch.case.logits_ms:ms} ms, top-k "
            "{@decode_prefetch.case.topk_ms:ms} ms, recall {@decode_prefetch.case.recall_ms:ms} ms of "
            "{@decode_prefetch.case.unfused_graph_ms:ms} ms; {@decode_prefetch.case.staged_rows:n} rows staged, "
            "{@decode_prefetch.case.staged_used:n} of them selected, {@decode_prefetch.case.staged_remaining:n} "
            "misses still recalled over PCIe",
            "all correct: {metrics.all_correct:yes}",
        ),
    ),
    Row(
        "decode prefetch end to end (auto)",
        rec("e2e_prefetch/e2e_study.json"),
        (
            "ECHO with SGLANG_NSA_FUSE_LOGITS_RECALL_DECODE=auto over ECHO without it, phases interleaved: "
            "{metrics.decode_prefetch_auto.full.ratio:x} at the paper's setting (hit "
            "{metrics.decode_prefetch_auto.full.hit_rate_mean:f3}, range {metrics.decode_prefetch_auto.full.ratio_min:f3}-"
            "{metrics.decode_prefetch_auto.full.ratio_max:f3}, {metrics.decode_prefetch_auto.full.repeats} repeats)",
            "{metrics.decode_prefetch_auto.random.ratio:x} on random keys (hit "
            "{metrics.decode_prefetch_auto.random.hit_rate_mean:f3}, range {metrics.decode_prefetch_auto.random.ratio_min:f3}-"
            "{metrics.decode_prefetch_auto.random.ratio_max:f3}, {metrics.decode_prefetch_auto.random.repeats} repeats; the "
            "rule ran the prefetch there: {metrics.decode_prefetch_auto.random.phase_staged_used:n} of "
            "{metrics.decode_prefetch_auto.random.phase_staged_rows:n} staged rows selected, "
            "{metrics.decode_prefetch_auto.random.phase_precision:f3})",
            "greedy outputs equal to ECHO without it: {metrics.decode_prefetch_auto.full.outputs_equal:yes} / "
            "{metrics.decode_prefetch_auto.random.outputs_equal:yes}",
        ),
    ),
    Row(
        "recall bandwidth",
        rec("recall.json"),
        (
            "{@recall_widths}",
            "pinned H2D copy {metrics.h2d_GBps:f1} GB/s in the same run",
            "?the default launch on 656 B rows {metrics.default_GBps_656:f1} GB/s packed, "
            "{metrics.default_GBps_656_on_768_byte_strides:f1} GB/s with every row starting a 128-byte line (768-byte "
            "strides)",
        ),
    ),
    Row(
        "sparse MLA kernel",
        rec("sparse_mla.json"),
        (
            "decode {metrics.sizes.batch} queries x {metrics.sizes.heads} heads x {metrics.sizes.topk} rows: "
            "{metrics.decode_us:us} us vs torch {metrics.decode_torch_us:us} us ({@mla.decode_speedup:x} faster), "
            "{@mla.decode_over_roofline:x} its {metrics.decode_roofline_us:us} us roofline (estimate)",
            "prefill {metrics.sizes.prefill_queries} queries: {metrics.prefill_us:us} us vs {metrics.prefill_torch_us:us} "
            "us ({@mla.prefill_speedup:x}), {@mla.prefill_over_roofline:x} its {metrics.prefill_roofline_us:us} us "
            "roofline (estimate)",
            "best of {@mla.configs} launch configs; bf16 rel. error to float64 {metrics.max_rel_err:sci} vs torch's bf16 "
            "{metrics.torch_bf16_rel_err:sci}; all correct: {metrics.all_correct:yes}",
            "fp8 KV rows (656 bytes, dequantized in registers): decode {metrics.decode_fp8_us:us} us, "
            "{@mla.fp8_over_bf16:x} the bf16 default's {metrics.decode_default_us:us} us, rel. error "
            "{metrics.fp8_rel_err:sci}",
            "graph-replayed decode, us (ours by config, peers by name): {@mla_batch_sweep}",
        ),
    ),
    Row(
        "per-request decode cost per layer (issue 15)",
        INDEXER,
        (
            "us per request per layer at batch {@per_request.batch} (each op's batch time / {@per_request.batch}; sparse "
            "MLA graph-replayed where the record's batch sweep has it; recall = cache management with recall minus "
            "without): {@per_request.ops}",
            "total {@per_request.total:us} (was {@per_request.was:us}, the records of a0f072b)",
        ),
        also=(
            rec("sparse_mla.json"),
            rec("cache_ops.json"),
            *(rec(f"{BEFORE_ISSUE_15}/{n}.json") for n in KERNEL_RECORDS),
        ),
    ),
    Row(
        "sparse MLA kernel resources (issue 15)",
        rec("sm90_resources.json"),
        (
            "{@sm90.configs} launch configs compiled for {metrics.target} as the JIT specializes the decode launch "
            "(compile only): the default ({metrics.default.block_h} heads x {metrics.default.block_k} rows, "
            "{metrics.default.num_warps} warps, {metrics.default.splits} splits) uses {metrics.default.registers} "
            "registers, spills {metrics.default.spill_store_bytes} B per thread, {metrics.default.shared_bytes:n} B of "
            "shared memory, {metrics.default.wgmma} wgmma",
            "{@sm90.spill_free} configs are spill-free, {@sm90.spill_free_wgmma} of them with wgmma",
            "KV-row tile loads in the default: {metrics.default.row_loads_async} asynchronous copies, "
            "{metrics.default.row_loads_sync} plain",
            "at fp8 KV the default stores its dequantized tiles to shared memory {@sm90.fp8_stores}, in "
            "{metrics.fp8_default.shared_bytes:n} B of shared memory",
            "the split merge ({@sm90.merge.block_h} heads x {@sm90.merge.block_c} columns, {@sm90.merge.num_warps} warps) "
            "at {@sm90.merge_splits} splits: {@sm90.merge_registers:-} registers, spills {@sm90.merge_spills} B per "
            "thread at most",
        ),
    ),
    Row(
        "trained model (issue 6)",
        rec("topk_traces.json"),
        (
            (
                rec("topk_train.json"),
                "{parameters.total:M} parameters, {checkpoint_bytes:MB}, trained in "
                "{metrics.train_seconds:f0} s ({metrics.steps_done} steps)",
            ),
            "trained vs untrained: held-out prefill loss {@trained.heldout_prefill_nll} nats/byte, consecutive-step top-k "
            "overlap {@trained.consecutive_overlap}, recall of attention's top-{setup.index_topk} "
            "{@trained.recall_of_attention_topk}, ECHO shared-cache hit rate at {@trained.mults} x batch x k "
            "{@trained.hits_trained} (untrained {@trained.hits_untrained}), per-request 2k LRU "
            "{@trained.hisparse_2k_hit_rate}, EMA k-th score error median {@trained.ema_rel_error_median}",
            "256-bin threshold bin (fp16 key) {metrics.side_by_side.bin_fp16_raw_median.trained:f1} keys raw vs "
            "{metrics.side_by_side.bin_fp16_offset_median.trained:f1} with the offset",
        ),
        also=(rec("topk_train.json"),),
    ),
    Row(
        "serving (toy model, issue 7)",
        rec("serving/h200/serving_sweep.json"),
        (
            "{@knobs.LAYERS}-layer random model, {@knobs.NUM_PROMPTS} InfiniteBench-like prompts (synthetic) at context "
            "{@knobs.CONTEXT:n}: {@serving}",
        ),
    ),
    Row(
        "serving, earlier runs (history)",
        SERVING_HISTORY[0],
        ("{@history_serving}",),
        kind="measured, superseded",
        also=SERVING_HISTORY[1:],
    ),
)

# ---- README.md: the headline numbers, one field each -------------------------------------

RESULTS: tuple[Result, ...] = (
    Result(
        "decode throughput, ECHO / no-offload, at the paper's pool sizes ({@paper_pools})",
        STUDY,
        "{metrics.ratio_paper_all_hbm:x}",
    ),
    Result(
        "the same at equal HBM (every byte of KV state counted)",
        STUDY,
        "{metrics.ratio_equal_hbm_380k:x}",
    ),
    Result("the same with fp8 KV rows", STUDY_FP8, "{metrics.ratio_paper_all_hbm:x}"),
    Result("ECHO's device-cache hit rate per layer", STUDY, "{metrics.hit_rate_per_layer:f3-}"),
    Result(
        "greedy outputs equal to no-offload's while every step evicts",
        STUDY,
        "{metrics.details.lossless_under_eviction.greedy_outputs_equal:yes}",
    ),
    Result(
        "ECHO's extra step time without memory pressure, batch 1 (fraction)",
        STUDY,
        "{metrics.low_load_cost.per_batch.1:f3}",
    ),
    Result(
        "through the HTTP server as a decode node, ECHO / no-offload output throughput at rate inf "
        "(the in-process study in the same device call)",
        rec("served_vs_study/served_vs_study.json"),
        "{metrics.served_ratio_inf:x} ({metrics.study_ratio:x})",
    ),
    Result(
        "decode cost per request and layer at batch {@per_request.batch}, all of ECHO's kernels, us",
        INDEXER,
        "{@per_request.total:us}",
    ),
)


# ---- docs/ERRORS.md: the messages, from the code that raises them -------------------------


class _Stub:
    """Stands in for the object whose method is called (only the attributes it reads)."""

    def __init__(self, **attrs):
        self.__dict__.update(attrs)


def _words(args: list[str]) -> dict[str, Any]:
    """``key=value`` words, values as Python literals where they parse (else strings)."""
    out = {}
    for word in args:
        key, _, raw = word.partition("=")
        try:
            out[key] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            out[key] = raw
    return out


def check_env(args: list[str]) -> object:
    from sglang_echo.config import EchoSettings

    return EchoSettings.from_env(dict(w.split("=", 1) for w in args))


def check_validate(args: list[str]) -> object:
    from sglang_echo.config import EchoConfig

    kw = _words(args)
    sizes = {k: kw.pop(k) for k in ("host_tokens", "max_running_requests", "topk", "chunk_size")}
    return EchoConfig(offload=True, **kw).validate(**sizes)


def check_request(args: list[str]) -> object:
    from sglang_echo.runtime.request import SamplingParams, ServeRequest
    from sglang_echo.runtime.scheduler import Scheduler

    kw = _words(args)
    req = ServeRequest([1] * kw["prompt"], params=SamplingParams(max_new_tokens=kw["new"]))
    return Scheduler.check(_Stub(context_length=kw["context"], capacity=kw["pool"], live={}), req)


def check_body(args: list[str]) -> object:
    """A request body as a client sends it: ``digits=N`` (a number of N digits) or
    ``depth=N`` (arrays nested N deep)."""
    from sglang_echo.runtime.protocol import parse_json

    kw = _words(args)
    if "digits" in kw:
        body = '{"input_ids": [1], "seed": ' + "7" * kw["digits"] + "}"
    else:
        body = '{"input_ids": ' + "[" * kw["depth"] + "]" * kw["depth"] + "}"
    return parse_json(body.encode())


def check_prompts(args: list[str]) -> object:
    import tempfile

    from sglang_echo.generate import read_prompts

    kw = _words(args)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "prompts.jsonl"
        path.write_text(json.dumps({"input_ids": [5] * kw["tokens"]}) + "\n")
        try:
            return read_prompts(path, None, 1000, kw["context"] - kw["new"], kw["context"])
        except ValueError as exc:  # the temporary folder differs between runs
            raise ValueError(str(exc).replace(str(path), "prompts.jsonl")) from None


def check_host_pool(args: list[str]) -> object:
    import torch

    from sglang_echo.offload.host_pool import HostKVPool

    kw = _words(args)
    return HostKVPool(kw["layers"], kw["tokens"], kw["row_bytes"], torch.uint8, pin=True)


def check_server(args: list[str]) -> object:
    from sglang_echo.runtime.server_args import parse_server_args

    return parse_server_args(["--model-path", "DIR", *args])


# What sglang's resolved arguments hold unless a row says otherwise (a non-PD server).
SGLANG_ARGS = {"disaggregation_mode": "null", "context_length": 131072, "max_total_tokens": 2000000}


def check_plugin(args: list[str]) -> object:
    """The plugin's plan for sglang's arguments (an attribute view, as sglang's), at
    DeepSeek-V3.2's top-k and ``NSA_DEV_CACHE_SIZE=260_000``."""
    from sglang_echo.config import EchoConfig
    from sglang_echo.sglang.args import plan_echo

    view = _Stub(**{**SGLANG_ARGS, **_words(args)})
    config = EchoConfig(offload=True, dev_cache_size=260_000)
    return plan_echo(view, config, top_k=2048, context_len=view.context_length)


def check_sizing(args: list[str]) -> object:
    """The plugin's start-up sizing (sglang/sizing.py) of fp8 DeepSeek-V3.2 (its published
    config.json, benchmark/configs/) as a PD decode node under DP attention on 8 GPUs of
    ``gpu_gib`` each, at ``fraction`` (sglang's --mem-fraction-static)."""
    from sglang_echo.sglang import sizing, sizing_budget, sizing_weights

    kw = _words(args)
    config = json.loads((Path(__file__).parent / "configs/deepseek-v3.2.json").read_text())
    sizes = sizing.EchoSizes(kw["dev_cache"], kw["host_tokens"], config["index_topk"], 0)
    shape = sizing.RankShape(
        config["num_hidden_layers"], sizing.kv_row_bytes(config, fp8=True),
        sizing.index_row_bytes(config), config["max_position_embeddings"],
    )  # fmt: skip
    weights = sizing_weights.weight_bytes(config, sizing_weights.Parallel(8, 8))
    budget = sizing_budget.Budget(int(kw["gpu_gib"] * 2**30), kw["fraction"], weights, 8)
    result = sizing.check(sizes, shape, budget)
    if not result.fits:
        raise ValueError(result.message())
    return result


CHECKS: dict[str, tuple[str, Callable[[list[str]], object]]] = {
    "env": ("`EchoSettings.from_env`", check_env),
    "validate": ("`EchoConfig.validate`", check_validate),
    "request": ("`Scheduler.check`", check_request),
    "body": ("`protocol.parse_json`", check_body),
    "prompts": ("`generate.read_prompts`", check_prompts),
    "host_pool": ("`HostKVPool` (pinned)", check_host_pool),
    "server": ("`parse_server_args`", check_server),
    "plugin": ("`sglang.args.plan_echo`", check_plugin),
    "sizing": ("`sglang.sizing.check`", check_sizing),
}

# what the user does | where it fails | the call: a CHECKS name and its arguments
ERRORS = """
`NSA_KV_OFFLOAD=2` | start-up (server, `generate`, plugin) | env NSA_KV_OFFLOAD=2
`NSA_DEV_CACHE_SIZE=260k` | start-up | env NSA_DEV_CACHE_SIZE=260k
`NSA_DEV_CACHE_SIZE=0` | start-up | env NSA_DEV_CACHE_SIZE=0
`SGLANG_ECHO_TOPK=bitonic` (an internal knob) | start-up (server, `generate`) | env SGLANG_ECHO_TOPK=bitonic
a device cache smaller than one decode step's selections | start-up (server, `generate`) | validate dev_cache_size=65536 host_tokens=1800000 max_running_requests=64 topk=2048 chunk_size=8192
an eviction reserve above half the device cache | start-up | validate dev_cache_size=16384 eviction_reserve=10000 host_tokens=1800000 max_running_requests=4 topk=2048 chunk_size=8192
an empty host pool | start-up | validate host_tokens=0 max_running_requests=4 topk=2048 chunk_size=8192
a prompt + `max_new_tokens` longer than the context | server: that request fails (HTTP 400) | request prompt=130000 new=4096 context=131072 pool=2000000
a request longer than the KV pool (`--max-total-tokens`) | server: that request fails (HTTP 400) | request prompt=100000 new=1000 context=131072 pool=100000
a request body with a number of 5,000 digits | server: that request fails (HTTP 400) | body digits=5000
a request body of arrays nested 100,000 deep | server: that request fails (HTTP 400) | body depth=100000
a prompts-file line longer than the context less `--max-new-tokens` | `generate` | prompts tokens=4000 new=256 context=4096
a host pool the machine cannot pin (DeepSeek-V3.2's 61 layers of 656-byte fp8 rows, `--max-total-tokens 100_000_000`) | start-up (server, `generate`) | host_pool layers=61 tokens=100000000 row_bytes=656
`--tp 8` on this runtime | server start-up | server --tp 8
`--disaggregation-mode prefill` on this runtime | server start-up | server --disaggregation-mode prefill
`--disaggregation-mode decode` without the fake transfer backend | server start-up | server --disaggregation-mode decode
`--fake-kv-locality 0.9` on the server | server start-up | server --fake-kv-locality 0.9
`--hisparse-config` without `--enable-hisparse` | server start-up | server --hisparse-config {}
`--model-loader` that is not MODULE:FUNCTION | server start-up | server --model-loader benchmark/study/loader.py
plugin: no `--max-total-tokens` | `sglang.launch_server` with `NSA_KV_OFFLOAD=1` | plugin max_total_tokens=None
plugin: more running requests than the device cache serves | `sglang.launch_server` with `NSA_KV_OFFLOAD=1` | plugin max_running_requests=256
plugin: the same under DP attention (8 ranks) | `sglang.launch_server` with `NSA_KV_OFFLOAD=1` | plugin max_running_requests=2048 dp_size=8 enable_dp_attention=True
plugin: flags ECHO cannot run with | `sglang.launch_server` with `NSA_KV_OFFLOAD=1` | plugin speculative_algorithm=EAGLE page_size=32 dp_size=8 kv_cache_dtype=fp8_e5m2
plugin: a prefill node | `sglang.launch_server` with `NSA_KV_OFFLOAD=1` | plugin disaggregation_mode=prefill
plugin: pools that do not fit the GPUs (fp8 DeepSeek-V3.2, PD decode, DP attention on 8 x H200 at `--mem-fraction-static 0.85`, `--max-total-tokens 4000000`) | `sglang.launch_server` with `NSA_KV_OFFLOAD=1`, before the weights load | sizing dev_cache=260000 host_tokens=4000000 gpu_gib=140.4 fraction=0.85
plugin: GPUs the weights alone fill (the same on 8 x 80 GB) | `sglang.launch_server` with `NSA_KV_OFFLOAD=1`, before the weights load | sizing dev_cache=260000 host_tokens=2000000 gpu_gib=79.6 fraction=0.9
"""


def error_rows() -> list[tuple[str, str, str, str]]:
    """(what, where, the check, the message it raised) per line of ``ERRORS``; torch's own
    words in a message are replaced (they differ by machine and version)."""
    rows = []
    for line in ERRORS.strip().splitlines():
        what, where, call = (c.strip() for c in line.split(" | "))
        name, *args = shlex.split(call)
        check, fn = CHECKS[name]
        try:
            fn(args)
        except (ValueError, RuntimeError) as exc:
            message = str(exc)
            if exc.__cause__ is not None and str(exc.__cause__) in message:
                message = message.replace(str(exc.__cause__), "the allocator's reason")
        else:
            message = "NOT REFUSED: the check accepted this setting"
        rows.append((what, where, check, message))
    return rows


# ---- the blocks -------------------------------------------------------------------------


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", "<br>")


def _table(header: tuple[str, ...], rows) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    return lines + ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]


def render_results(r: Records) -> list[str]:
    return _table(("result", "value", "record"), (x.render(r) for x in RESULTS))


def render_evidence(r: Records) -> list[str]:
    return _table(("claim", "numbers", "record"), (row.render(r) for row in EVIDENCE))


def render_errors(_r: Records) -> list[str]:
    return _table(("what the user does", "where it fails", "the check", "message"), error_rows())


@dataclass(frozen=True)
class Block:
    render: Callable[[Records], list[str]]
    doc: str  # the file that holds it
    source: str  # what it is generated from

    def header(self, name: str) -> str:
        return (
            f"<!-- {name}:begin (generated by `python -m benchmark.evidence --write {self.doc}` "
            f"from {self.source}; do not edit by hand) -->"
        )


BLOCKS = {
    "results": Block(render_results, "README.md", "the records"),
    "evidence": Block(render_evidence, "docs/EVIDENCE.md", "the records"),
    "errors": Block(render_errors, "docs/ERRORS.md", "the code's checks"),
}
BEGIN = "<!-- evidence:begin"  # the evidence block's markers and header
END = "<!-- evidence:end -->"
HEADER = BLOCKS["evidence"].header("evidence")


def begin(name: str) -> str:
    return f"<!-- {name}:begin"


def end(name: str) -> str:
    return f"<!-- {name}:end -->"


def render(root: Path, name: str = "evidence") -> str:
    """Block ``name``, markers included."""
    block = BLOCKS[name]
    lines = [block.header(name), "", *block.render(Records(root)), "", end(name)]
    return "\n".join(lines)


def extract(text: str, name: str = "evidence") -> str | None:
    """Block ``name`` of ``text`` (markers included), or None without markers."""
    start = text.find(begin(name))
    stop = text.find(end(name), start)
    if start < 0 or stop < 0:
        return None
    return text[start : stop + len(end(name))]


def blocks_in(text: str) -> list[str]:
    """The names of the generated blocks ``text`` holds."""
    return [name for name in BLOCKS if extract(text, name) is not None]


def _rows(block: str) -> dict[str, str]:
    out = {}
    lines = [ln for ln in block.splitlines() if ln.startswith("| ")]
    for ln in lines[2:]:  # after the header and its rule
        out[ln.split(" | ", 1)[0][2:]] = ln
    return out


def block_differences(text: str, root: Path, name: str = "evidence") -> list[str]:
    """Every way block ``name`` of ``text`` disagrees with the generator (empty: agrees)."""
    block = extract(text, name)
    if block is None:
        return [f"no {name} block (markers {begin(name)!r} ... {end(name)!r})"]
    want = render(root, name)
    if block == want:
        return []
    got_rows, want_rows = _rows(block), _rows(want)
    problems = []
    for key, line in want_rows.items():
        if key not in got_rows:
            problems.append(f"{name} row {key!r}: missing")
            continue
        have, need = NUMBER.findall(got_rows[key]), NUMBER.findall(line)
        bad = [f"{a} (generated: {b})" for a, b in zip(have, need, strict=False) if a != b]
        if len(have) != len(need):
            bad.append(f"{len(have)} numbers in the file, {len(need)} generated")
        if bad:
            problems.append(f"{name} row {key!r}: " + "; ".join(bad))
        elif got_rows[key] != line:
            problems.append(f"{name} row {key!r}: same numbers, different text")
    problems += [f"{name} row {k!r}: not generated" for k in got_rows if k not in want_rows]
    if not problems:
        problems.append(f"the {name} block differs from the generator's outside the rows")
    return problems


def differences(text: str, root: Path, names: list[str] | None = None) -> list[str]:
    """Every disagreement of the blocks ``names`` (default: those ``text`` holds; none at
    all is one)."""
    names = blocks_in(text) if names is None else names
    if not names:
        return [f"no generated block (markers {', '.join(map(begin, BLOCKS))})"]
    return [p for name in names for p in block_differences(text, root, name)]


def write(text: str, root: Path) -> str:
    """``text`` with every block it holds regenerated."""
    for name in blocks_in(text):
        text = text.replace(extract(text, name), render(root, name), 1)
    return text


# ---- prose: no measured figure outside the generated blocks ------------------------------

_UNITS = (
    r"us|µs|μs|ms|s|sec|seconds?|minutes?|min|hours?|"
    r"GB/s|GiB/s|MB/s|tok/s|tokens/s|TB|GB|GiB|MB|MiB|KB|KiB|B"
)
_NUM = r"~?\d[\d,_]*(?:\.\d+)?"
FIGURE_RULES = {
    "time or size": re.compile(
        rf"(?<![\w.]){_NUM}(?:\s*(?:-|to)\s*{_NUM})?[ -]?(?:{_UNITS})(?![\w/])"
    ),
    "speedup": re.compile(r"(?<![\w.])\d+(?:\.\d+)?[x×](?!\w)"),
    "percentage": re.compile(r"\d+(?:\.\d+)?\s*%"),
    "decimal": re.compile(r"(?<![\w.])\d+\.\d+(?![\w.])"),
    "approximate": re.compile(r"~\s?\d"),
    "count": re.compile(
        r"(?<![\w.])\d[\d,]*(?:\.\d+)?\s+(?:evictions|kernels|registers|instructions|cycles|"
        r"decode steps)\b"
    ),
}
# Version numbers are not figures: a decimal right after these words (or a range's start).
_VERSION = re.compile(
    r"(?:python|cpython|torch|transformers|triton|sglang|flashinfer\S*|>=)\s*(?:\d+\.\d+-)?$",
    re.IGNORECASE,
)
# Design constants and configuration (facts of the code, not measurements), and others'
# published figures, named as such in the text. Matched with any whitespace between words.
ALLOWED_FIGURES = (
    "the e2e scripts use 0.9",  # a knob's value
    "p = 0.9",
    "default 32 MiB",
    "the global batch 8x the local one",  # the paper's deployment: 8 DP ranks
    "656 B",  # the fp8 KV row
    "10-minute device calls",  # the device machine's limit
    "656 B: ~80 GB at T = 2M",  # arithmetic on the row size, not a measurement
    "~16 GB at T = 2M",
    "about 4 B per host token and 16 B per slot",
    "alpha 0.5",
    ">= 7% of",  # the decode-prefetch rule's threshold (offload/prefetch_rule.py), a knob
    "or above 7% the",
    "0.88 on CUDA, 0.25 on the CPU",
    "interval to 0.5 ms",
    "ECHO's published 2.15x / 3.10x / 4.12x",  # published by others
    "0.88-0.99 per layer that ECHO publishes",
    "0.88-0.99 hit rates published",
    "the 1.6x speedup and 1.03 slowdown ECHO publishes",
)
_GENERATED = re.compile(r"<!-- ([\w-]+):begin.*?<!-- \1:end -->", re.DOTALL)
_FENCE = re.compile(r"^[ \t]*```.*?^[ \t]*```[^\n]*$", re.DOTALL | re.MULTILINE)
_CODE = re.compile(r"`[^`\n]*`")


def _blank(text: str, rx: re.Pattern) -> str:
    """``text`` with ``rx``'s matches overwritten by spaces (newlines kept, so positions
    and line numbers stay)."""
    return rx.sub(lambda m: re.sub(r"[^\n]", " ", m.group()), text)


def prose_figures(text: str) -> list[str]:
    """Measured-looking figures in a markdown document's prose: outside its generated
    blocks (``<!-- NAME:begin ... <!-- NAME:end -->``), fenced and inline code, version
    numbers and ``ALLOWED_FIGURES``. Each as ``line N: 'figure' (rule): context``."""
    prose = text
    for rx in (_GENERATED, _FENCE, _CODE):
        prose = _blank(prose, rx)
    allowed = [
        m.span()
        for phrase in ALLOWED_FIGURES
        for m in re.finditer(r"\s+".join(map(re.escape, phrase.split())), prose)
    ]
    found = []
    for rule, rx in FIGURE_RULES.items():
        for m in rx.finditer(prose):
            if any(a <= m.start() and m.end() <= b for a, b in allowed):
                continue
            if rule == "decimal" and _VERSION.search(prose[max(0, m.start() - 40) : m.start()]):
                continue
            line = text.count("\n", 0, m.start()) + 1
            context = " ".join(text[max(0, m.start() - 40) : m.end() + 20].split())
            found.append((line, m.start(), f"line {line}: {m.group()!r} ({rule}): ...{context}..."))
    return [f for _, _, f in sorted(found)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmark.evidence", description=__doc__)
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--write", type=Path, nargs="+", metavar="FILE", help="regenerate the blocks FILE holds"
    )
    g.add_argument(
        "--check",
        type=Path,
        nargs="+",
        metavar="FILE",
        help="exit 1 if a block of FILE differs, or its prose holds a measured figure",
    )
    p.add_argument(
        "--block", choices=sorted(BLOCKS), default="evidence", help="the block printed otherwise"
    )
    p.add_argument("--root", type=Path, default=Path("."), help="repository root (default: cwd)")
    args = p.parse_args(argv)
    if args.check is not None:
        failed = False
        for path in args.check:  # a file without blocks: its prose only
            text = path.read_text()
            problems = differences(text, args.root) if blocks_in(text) else []
            problems += [
                f"a measured figure outside the generated blocks (put it in a row or drop it): {f}"
                for f in prose_figures(text)
            ]
            for line in problems:
                print(f"{path}: {line}", file=sys.stderr)
            if not problems:
                names = ", ".join(blocks_in(text))
                what = f"the {names} block matches the generator" if names else "no block"
                print(f"{path}: {what}; no measured figure in the prose")
            failed |= bool(problems)
        return 1 if failed else 0
    if args.write is not None:
        for path in args.write:
            text = path.read_text()
            if not blocks_in(text):
                print(f"error: no generated block in {path}", file=sys.stderr)
                return 2
            path.write_text(write(text, args.root))
            print(f"wrote the {', '.join(blocks_in(text))} block(s) of {path}")
        return 0
    print(render(args.root, args.block))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
