"""Derived values (``{@name}``) of the component records: the GPU oracle, the indexer
and top-k (and FlashInfer beside them), cache management, the decode prefetch, recall,
sparse MLA, the per-request cost per layer, the victim-policy simulation and the trained
model. Each loops over a record's entries or forms a ratio no single field holds."""

from __future__ import annotations

from .formats import count, f2, f3, ratio, slashed, us, yes
from .records import Records, rec
from .template import derived


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
