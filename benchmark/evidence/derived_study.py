"""Derived values (``{@name}``) of the end-to-end study's records (benchmark/e2e_study.py)
and the plugin harness's: pool sizes, same-pool ratios, the lossless check's scope, the
profile difference, equal-HBM runs. They compute what no single field holds."""

from __future__ import annotations

from .formats import ratio, tokens
from .records import STUDY, Records
from .template import derived


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
