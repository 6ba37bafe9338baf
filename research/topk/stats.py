"""Summary metrics of one model's decode traces (arrays as ``TopkTracer.arrays`` gives them)."""

from __future__ import annotations

import itertools
import math

import numpy as np

from research.topk.cache_sim import per_request_hit_rate, shared_cache_hit_rate

POSITION_BUCKETS = (0, 1024, 2048, 4096, 8192, 16384, 1 << 30)
CACHE_MULTIPLES = (1.25, 1.5, 2.0, 4.0, 8.0)  # ECHO cache size / (requests x k)
HISPARSE_MULTIPLE = 2  # HiSparse-like buffer: 2k slots per request and layer


def consecutive_overlap(sel: np.ndarray) -> float:
    """Mean over steps t >= 1 and requests of |S_t & S_{t-1}| / |S_t|; sel [S, R, K]."""
    ratios = []
    for t in range(1, sel.shape[0]):
        for r in range(sel.shape[1]):
            cur, prev = sel[t, r], sel[t - 1, r]
            cur, prev = cur[cur >= 0], prev[prev >= 0]
            if cur.size:
                ratios.append(np.isin(cur, prev, assume_unique=True).mean())
    return float(np.mean(ratios)) if ratios else float("nan")


def _q(x: np.ndarray, q: float) -> float:
    return float(np.quantile(x, q)) if x.size else float("nan")


def threshold_metrics(arr: dict, layer: int, k: int) -> dict:
    kth, theta = arr["kth"][layer].ravel(), arr["theta"][layer].ravel()
    rel = np.abs(theta - kth) / np.maximum(np.abs(kth), 1e-6)
    ratio = arr["n_above"][layer].ravel() / k
    corr = float(np.corrcoef(kth, theta)[0, 1]) if kth.size > 1 and kth.std() > 0 else float("nan")
    out = {
        "ema_rel_error_median": _q(rel, 0.5),
        "ema_rel_error_p90": _q(rel, 0.9),
        "ema_corr": corr,
        "above_theta_over_k_median": _q(ratio, 0.5),
        "above_theta_over_k_p10": _q(ratio, 0.1),
        "above_theta_over_k_p90": _q(ratio, 0.9),
        "frac_steps_above_theta_ge_k": float((ratio >= 1).mean()) if ratio.size else float("nan"),
    }
    for key in ("fp16", "fp32"):
        for kind in ("raw", "offset"):
            sizes = arr[f"bin_{key}_{kind}"][layer].ravel().astype(np.float64)
            out[f"bin_{key}_{kind}_median"] = _q(sizes, 0.5)
            out[f"bin_{key}_{kind}_p90"] = _q(sizes, 0.9)
    return out


def layer_metrics(
    arr: dict,
    layer: int,
    prompt_lens: np.ndarray,
    k: int,
    multiples: tuple[float, ...] = CACHE_MULTIPLES,
) -> dict:
    sel = arr["sel"][layer].astype(np.int64)  # [S, R, K]
    init = arr["prefill_sel"][layer].astype(np.int64)  # [R, K]
    n_req = sel.shape[1]
    shared = {}
    for m in multiples:
        capacity = round(m * n_req * k)
        shared[f"{m:g}"] = shared_cache_hit_rate(sel, prompt_lens, init, capacity).hit_rate
    hisparse = per_request_hit_rate(sel, prompt_lens, init, HISPARSE_MULTIPLE * k).hit_rate
    return {
        "layer": layer,
        "consecutive_overlap": consecutive_overlap(sel),
        "recall_of_attention_topk": float(arr["recall"][layer].mean()),
        "attention_mass_selected": float(arr["attn_mass"][layer].mean()),
        "echo_shared_hit_rate": shared,
        "hisparse_2k_hit_rate": hisparse,
        **threshold_metrics(arr, layer, k),
    }


def loss_metrics(prefill_nll: list[np.ndarray], decode_nll: np.ndarray) -> dict:
    """Held-out NLL (nats/token; tokens are bytes) overall and by query position."""
    all_nll = np.concatenate(prefill_nll) if prefill_nll else np.zeros(0)
    positions = np.concatenate([np.arange(x.size) for x in prefill_nll]) if prefill_nll else all_nll
    buckets = {}
    for lo, hi in itertools.pairwise(POSITION_BUCKETS):
        m = (positions >= lo) & (positions < hi)
        if m.any():
            label = f"{lo}-{hi if hi < (1 << 30) else 'end'}"
            buckets[label] = {"nll": float(all_nll[m].mean()), "tokens": int(m.sum())}
    prefill = float(all_nll.mean()) if all_nll.size else float("nan")
    decode = float(decode_nll.mean()) if decode_nll.size else float("nan")
    return {
        "prefill_nll": prefill,
        "prefill_bits_per_byte": prefill / math.log(2),
        "prefill_tokens": int(all_nll.size),
        "decode_nll": decode,
        "decode_bits_per_byte": decode / math.log(2),
        "decode_tokens": int(decode_nll.size),
        "prefill_nll_by_position": buckets,
    }


def summarize(arr: dict, prompt_lens: np.ndarray, k: int) -> dict:
    layers = [layer_metrics(arr, i, prompt_lens, k) for i in range(arr["sel"].shape[0])]

    def mean(key: str) -> float:
        return float(np.mean([m[key] for m in layers]))

    n_req = arr["sel"].shape[2]
    return {
        "requests": n_req,
        "k": k,
        "echo_shared_capacity_slots": {f"{m:g}": round(m * n_req * k) for m in CACHE_MULTIPLES},
        "hisparse_slots_per_request": HISPARSE_MULTIPLE * k,
        "per_layer": layers,
        "mean_over_layers": {
            "consecutive_overlap": mean("consecutive_overlap"),
            "recall_of_attention_topk": mean("recall_of_attention_topk"),
            "attention_mass_selected": mean("attention_mass_selected"),
            "hisparse_2k_hit_rate": mean("hisparse_2k_hit_rate"),
            "echo_shared_hit_rate": {
                size: float(np.mean([m["echo_shared_hit_rate"][size] for m in layers]))
                for size in layers[0]["echo_shared_hit_rate"]
            },
            "ema_rel_error_median": mean("ema_rel_error_median"),
            "above_theta_over_k_median": mean("above_theta_over_k_median"),
            "bin_fp16_raw_median": mean("bin_fp16_raw_median"),
            "bin_fp16_offset_median": mean("bin_fp16_offset_median"),
            "bin_fp32_raw_median": mean("bin_fp32_raw_median"),
            "bin_fp32_offset_median": mean("bin_fp32_offset_median"),
        },
    }
