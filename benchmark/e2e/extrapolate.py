"""The 61-layer estimate: a cost model, not a measurement. The measured steps have L
identical layers (8 on the GPU); a step's fixed part (embedding, final norm, LM head,
sampling) is timed alone at each batch, the rest is L layers, and a 61-layer step is the
fixed part plus 61 such layers (DeepSeek-V3.2's 3 dense-FFN layers counted as MoE layers);
on a GPU also with a timed 129,280-entry LM head. Token capacities stay, bytes grow 61/L
times."""

from __future__ import annotations

from benchmark.e2e.plan import HOST_META_BYTES, SLOT_META_BYTES, Plan, StudyPlan, row_bytes
from benchmark.e2e.runs import find_all, med

# DeepSeek-V3.2's depth and vocabulary, for the 61-layer estimate.
DSV32_LAYERS = 61
DSV32_VOCAB = 129_280


def estimate_settings(plan: Plan) -> dict[str, tuple[str, str]]:
    """Headline metric -> (offloading engine, no-offload engine) of its ratio; the
    equal-HBM ones per batch target (the metric is the best of them)."""
    same = plan.same_pools
    out = {"ratio_paper_all_hbm": ("echo_paper", "noff_paper")}
    for key, pool in zip(("ratio_paper_200k", "ratio_paper_110k"), same, strict=False):
        out[key] = (f"echo_{pool}", f"noff_{pool}")
    for b in plan.equal_hbm_batches:
        out[f"ratio_equal_hbm_380k_b{b}"] = (f"echo_equal_hbm_b{b}", "noff_paper")
        out[f"hisparse_ratio_equal_hbm_380k_b{b}"] = (f"hisparse_equal_hbm_b{b}", "noff_paper")
    return out


def estimate_side(runs: list[dict], components: dict, layers: int, label: str) -> dict | None:
    """One backend's 61-layer step: its fixed part (timed alone at its batch) plus 61
    times the per-layer time left when that fixed part is taken off the measured step
    (median of the repeats). Without a timed fixed part, the whole step is layers."""
    own = find_all(runs, label)
    if not own:
        return None
    b, step = own[0]["batch"], med(own, "step_ms_device")
    fixed = (components.get("fixed_part") or {}).get("per_batch", {}).get(b)
    in_step = fixed["embed_norm_lm_head_ms"] if fixed else 0.0
    layer = (step - in_step) / layers
    if layer <= 0:
        return {"batch": b, "step_ms_measured": round(step, 4), "error": "fixed part >= step"}
    out = {
        "batch": b,
        "step_ms_measured": round(step, 4),
        "layer_ms": round(layer, 4),
        "fixed_ms": fixed and round(in_step + fixed["sampling_ms"], 4),
    }
    step61 = DSV32_LAYERS * layer + (in_step + fixed["sampling_ms"] if fixed else 0.0)
    out["step_ms_61"] = round(step61, 3)
    out["tokens_per_s_61"] = round(b / step61 * 1e3, 1)
    if fixed and "embed_norm_lm_head_129k_ms" in fixed:
        big = fixed["embed_norm_lm_head_129k_ms"] + fixed["sampling_129k_ms"]
        out["step_ms_61_lm_head_129k"] = round(DSV32_LAYERS * layer + big, 3)
    return out


def capacity_61(setup: StudyPlan, label: str) -> dict | None:
    """Token capacity and KV bytes of one engine at 61 layers: a pool token is one row
    in every layer, so the tokens (and the batches they admit) do not change, the
    bytes grow 61/L times."""
    eng = next((e for e in setup.engines() if e.label == label), None)
    if eng is None:
        return None
    kv, idx = row_bytes(setup.cfg, setup.plan.dtype, setup.plan.kv_cache_dtype)
    gib = DSV32_LAYERS / 2**30
    if eng.backend == "no-offload":
        return {
            "pool_tokens": eng.pool,
            "device_kv_gib_61": round(eng.pool * (kv + idx) * gib, 2),
        }
    device = eng.dev_cache * (kv + SLOT_META_BYTES) + eng.host * (idx + HOST_META_BYTES)
    return {
        "device_cache_tokens": eng.dev_cache,
        "host_pool_tokens": eng.host,
        "device_kv_gib_61": round(device * gib, 2),
        "host_kv_gib_61": round(eng.host * kv * gib, 2),
    }  # fmt: skip


def estimate_61_layers(setup: StudyPlan, runs: list[dict], components: dict) -> dict:
    """Every headline ratio at 61 layers, each side from ``estimate_side``, with both
    engines' capacities; labelled an estimate, its formula and approximations spelt out."""
    fixed = components.get("fixed_part")
    layers = setup.plan.layers
    settings, ratios, ratios_big = {}, {}, {}
    for key, (echo, noff) in estimate_settings(setup.plan).items():
        e = estimate_side(runs, components, layers, echo)
        n = estimate_side(runs, components, layers, noff)
        if not e or not n or "step_ms_61" not in e or "step_ms_61" not in n:
            continue
        entry = {
            "offload_engine": echo,
            "offload": e,
            "no_offload_engine": noff,
            "no_offload": n,
        }
        entry["ratio"] = round(e["tokens_per_s_61"] / n["tokens_per_s_61"], 3)
        ratios[key] = entry["ratio"]
        if "step_ms_61_lm_head_129k" in e and "step_ms_61_lm_head_129k" in n:
            big = (e["batch"] / e["step_ms_61_lm_head_129k"]) / (
                n["batch"] / n["step_ms_61_lm_head_129k"]
            )
            entry["ratio_lm_head_129k"] = ratios_big[key] = round(big, 3)
        entry["capacity"] = {
            "offload": capacity_61(setup, echo),
            "no_offload": capacity_61(setup, noff),
        }
        settings[key] = entry
    for best in ("ratio_equal_hbm_380k", "hisparse_ratio_equal_hbm_380k"):
        for table in (ratios, ratios_big):
            vals = [v for k, v in table.items() if k.startswith(best + "_b")]
            if vals:
                table[best] = max(vals)
    return {
        "estimate": True,
        "label": "ESTIMATE, not measured: a 61-layer step from this run's "
        f"{setup.plan.layers}-layer device times",
        "formula": "step_ms_61 = fixed_ms + 61 x layer_ms; layer_ms = (median measured "
        "step - embedding/norm/LM head timed alone at that batch) / L; fixed_ms = that "
        "embedding/norm/LM head time + greedy sampling (argmax) timed alone",
        "fixed_part": fixed["source"]
        if fixed
        else "left out (not measured in this run): step_ms_61 = 61 x step / L",
        "ratios": ratios,
        "ratios_lm_head_129k": ratios_big,
        "settings": settings,
        "notes": [
            "DeepSeek-V3.2's first 3 layers have a dense FFN; they are counted here as MoE "
            "layers (the approximation: every one of the 61 layers costs the measured "
            "attention + MoE layer).",
            f"the LM head is the study's {setup.plan.vocab}-entry one; "
            "ratios_lm_head_129k swap in a timed 129,280-entry LM head (DeepSeek-V3.2's, "
            "replicated on the worker: an upper bound on a vocab-parallel head) when the "
            "run is on a GPU",
            "token capacities: the pools are per worker and count tokens of all layers "
            "(one row per layer each), so the admitted batch sizes are the same at 61 "
            "layers; the bytes they take grow 61/L times (capacity: KV GiB at 61 layers)",
            "the fixed part is timed alone (its own CUDA graph), not inside the step's "
            "graph; the per-layer time absorbs any difference",
        ],
    }
