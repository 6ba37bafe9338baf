"""The plugin's GPU-only behaviour without sglang's server: its coordinator and kernels over
sglang 0.5.23's own pool, allocator and host-pool classes, in sglang's decode
choreography (benchmark/harness/decode_loop.py), against the same loop without offload.

Runs where sglang is installed (the CPU test environment) and on a GPU machine where it
cannot be: there ``--sglang-pack`` names the archive of sglang's pure-Python modules
(``python -m benchmark.harness.sglang_pack``) and the third-party modules sglang imports
but the machine lacks get import stand-ins (benchmark/harness/standins.py); the record
lists what was stood in for. Greedy tokens and logits are compared with ``torch.equal``
under eviction; the record has the evictions per step and ECHO's launches per
layer-step (CUDA profiler over one replayed step).

    python benchmark/plugin_gpu_harness.py --out OUT [--sglang-pack .harness/sglang-py.tar.xz]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "python"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

# Stood in on the GPU machine at run time, whatever the import chain: sgl_kernel's
# host<->device KV copy (benchmark/harness/kv_sides.py: torch_backup).
RUNTIME_STANDINS = {
    "sgl_kernel.kvcacheio.transfer_kv_all_layer_mla": "torch index copies through the host "
    "pool's UVA alias on the stream sglang calls it on (decode backup, prefill staging)",
}
WIDE = dict(
    fp8=True, mode="pd", top_k=2048, dev_cache=3 * 2048, max_running=3, max_prompt=6144,
    max_context=8192, graph_sizes=(1, 2, 3),
)  # fmt: skip
CONFIGS = {
    "fp8-pd": dict(fp8=True, mode="pd"),
    "bf16-pd": dict(fp8=False, mode="pd"),
    "fp8-local": dict(fp8=True, mode="local"),
    "bf16-local": dict(fp8=False, mode="local"),
    # The decode prefetch's switch on: staged from the toy indexer's logits through the
    # plugin's hook (side stream, stage kernels and the recall's staged path in the graphs).
    "fp8-pd-prefetch": dict(fp8=True, mode="pd", prefetch=True),
    # Real shape: top-k 2048 and three requests, 6,144 lanes a layer-step, past the one-
    # program allocation (4,096 lanes), so the multi-launch resolve runs, in the graphs
    # (the launches are counted at a step of all three: launches_profiled_batch).
    "fp8-pd-wide": WIDE,
    # The same with the decode prefetch: its step time against fp8-pd-wide's is the hook's
    # cost or gain on this shape (prefetch_step_ratio in the record).
    "fp8-pd-wide-prefetch": {**WIDE, "prefetch": True},
    # DP-attention-like: every step replays the largest graph, the rest padding rows.
    "fp8-pd-dp-padded": dict(fp8=True, mode="pd", pad_to_max=True),
}


def prepare_imports(pack: str | None) -> dict:
    """sglang from the environment, or from the pack with stand-ins for what is missing."""
    from benchmark.harness.sglang_pack import has_sglang, use_pack
    from benchmark.harness.standins import WHY

    info: dict = {"sglang_from": "environment", "import_standins": [], "import_standin_why": {}}
    if pack:
        info["sglang_from"] = f"pack {pack}"
        info["import_standins"] = use_pack(pack)
        info["import_standin_why"] = {k: WHY.get(k, "") for k in info["import_standins"]}
    if not has_sglang():
        raise SystemExit(
            "sglang is not importable: run in the sglang environment (make sglang-env), or "
            "pass --sglang-pack (python -m benchmark.harness.sglang_pack)"
        )
    return info


def run_config(name: str, cfg, device: str, group) -> dict:
    import torch

    from benchmark.harness.decode_loop import DecodeLoop, make_specs
    from benchmark.harness.kv_sides import EchoSide, PlainSide

    specs = make_specs(cfg)
    start = time.perf_counter()
    echo = DecodeLoop(EchoSide, cfg, device, group)
    try:
        echo_out = echo.run(specs, profile_at=3)
        clean = _clean(echo)
    finally:
        # Unregister the pinned host pool as sglang does at shutdown: the next config's
        # pool may be given the same addresses, and registering them twice fails.
        echo.side.coord.destroy()
    plain = DecodeLoop(PlainSide, cfg, device, group)
    plain_out = plain.run(specs)
    echo_ms, plain_ms = echo.step_ms(), plain.step_ms()
    tokens = logits_rows = 0
    first_difference = None
    for spec in specs:
        a, b = echo_out[spec.rid], plain_out[spec.rid]
        tokens += len(a.tokens)
        logits_rows += len(a.logits)
        same = a.tokens == b.tokens and all(
            torch.equal(x, y) for x, y in zip(a.logits, b.logits, strict=True)
        )
        if not same and first_difference is None:
            step = next(
                (
                    i
                    for i, (x, y) in enumerate(zip(a.logits, b.logits, strict=False))
                    if not torch.equal(x, y)
                ),
                None,
            )
            first_difference = {"request": spec.rid, "decode_step": step}
    per_step = echo.counters_per_step()
    evictions = per_step[:, 0]
    misses, hits = int(per_step[:, 1].sum()), int(per_step[:, 2].sum())
    launches = {k: v / cfg.layers for k, v in (echo.launch_counts or {}).items()}
    coord = echo.side.coord
    return {
        "config": name,
        "settings": {**asdict(cfg), "graph_sizes": list(cfg.graph_sizes)},
        "requests": len(specs),
        "requests_aborted": sum(1 for s in specs if s.abort_at),
        "equal": first_difference is None,
        "first_difference": first_difference,
        "tokens_compared": tokens,
        "logits_rows_compared": logits_rows,
        "steps": echo.stats,
        "evictions_total": int(evictions.sum()),
        "steps_with_evictions": int((evictions > 0).sum()),
        "evictions_per_step_max": int(evictions.max()) if evictions.numel() else 0,
        "evictions_per_step_mean": float(evictions.float().mean()) if evictions.numel() else 0,
        "hit_rate": hits / (hits + misses) if hits + misses else None,
        "misses": misses,
        "launches_per_layer_step": launches or None,
        "launches_profiled_batch": echo.launch_batch or None,
        "release_errors": int(coord.manager.release_errors.item()),
        "decode_prefetch": cfg.prefetch,
        # Whether sglang's own Indexer._get_topk_paged took the hook on this machine (the
        # loop calls the hook function itself, as the wrapped method would).
        "indexer_hook_applied": bool(
            coord.decode_prefetch is not None and coord.decode_prefetch.hook_applied
        ),
        "prefetched_rows": int(coord.manager.prefetched_rows.sum()),
        "prefetch_hits": int(coord.manager.prefetch_hits.sum()),
        "left_clean": clean,
        # Device time per graph-replayed decode step (CUDA events; the GPU only).
        "step_ms_p50": _median(echo_ms),
        "plain_step_ms_p50": _median(plain_ms),
        "timed_steps": len(echo_ms),
        "seconds": round(time.perf_counter() - start, 2),
    }


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def _clean(loop) -> bool:
    """Every request gone: no newest row, no host id, nothing in ECHO's cache."""
    import torch

    coord = loop.side.coord
    cache = coord.cache
    return bool(
        torch.all(coord.ring_rows == 0)
        and torch.all(coord.req_to_host_pool == -1)
        and torch.all(cache.free_count == cache.num_slots)
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for plugin_gpu_harness.json")
    ap.add_argument("--sglang-pack", help="tar.xz of sglang's .py modules (GPU machine)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="subset of " + ",".join(CONFIGS))
    ap.add_argument("--requests", type=int, default=10, help="requests per config")
    ap.add_argument("--no-graphs", action="store_true", help="eager steps only")
    args = ap.parse_args(argv)
    unknown = set(args.configs.split(",")) - set(CONFIGS)
    if unknown:
        ap.error(f"unknown config(s) {sorted(unknown)}; choose from {','.join(CONFIGS)}")

    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    imports = prepare_imports(args.sglang_pack)
    if device == "cpu":
        from benchmark.harness.kv_sides import cpu_shims

        cpu_shims()
    import torch.distributed as dist

    from benchmark.harness.decode_loop import HarnessConfig

    if not dist.is_initialized():
        dist.init_process_group(
            "gloo", init_method=f"file://{tempfile.mkdtemp()}/pg", rank=0, world_size=1
        )
    from sglang.srt.runtime_context import get_parallel

    # One rank, no decode-context parallelism: what sglang publishes at start-up.
    get_parallel().override_permanently(attn_dcp_size=1, attn_dcp_rank=0)
    results = []
    for name in args.configs.split(","):
        cfg = replace(HarnessConfig(**CONFIGS[name]), requests=args.requests,
                      graphs=not args.no_graphs)  # fmt: skip
        print(f"[harness] {name} ...", flush=True)
        result = run_config(name, cfg, device, dist.group.WORLD)
        print(
            f"[harness] {name}: equal={result['equal']} tokens={result['tokens_compared']} "
            f"evictions={result['evictions_total']} hit_rate={result['hit_rate']} "
            f"launches/layer-step={result['launches_per_layer_step']} ({result['seconds']} s)",
            flush=True,
        )
        results.append(result)
    launches = next(
        (r["launches_per_layer_step"] for r in results if r["launches_per_layer_step"]), None
    )
    by_name = {r["config"]: r for r in results}
    wide, wide_prefetch = by_name.get("fp8-pd-wide"), by_name.get("fp8-pd-wide-prefetch")
    prefetch_ratio = None
    if wide and wide_prefetch and wide["step_ms_p50"] and wide_prefetch["step_ms_p50"]:
        prefetch_ratio = round(wide_prefetch["step_ms_p50"] / wide["step_ms_p50"], 4)
    record = {
        "name": "plugin_gpu_harness",
        "command": "python " + " ".join([os.path.relpath(__file__, ROOT), *sys.argv[1:]]),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": _commit(),
        "torch": torch.__version__,
        "metrics": {
            "all_equal": all(r["equal"] for r in results),
            "configs": ", ".join(r["config"] for r in results),
            "requests": sum(r["requests"] for r in results),
            "requests_aborted": sum(r["requests_aborted"] for r in results),
            "tokens_compared": sum(r["tokens_compared"] for r in results),
            "steps": sum(r["steps"]["steps"] for r in results),
            "graph_replays": sum(r["steps"]["graph_replays"] for r in results),
            "eager_steps": sum(r["steps"]["eager_steps"] for r in results),
            "idle_steps": sum(r["steps"]["idle_steps"] for r in results),
            "evictions_total": sum(r["evictions_total"] for r in results),
            "steps_with_evictions": sum(r["steps_with_evictions"] for r in results),
            "evictions_per_step_max": max(r["evictions_per_step_max"] for r in results),
            "launches_per_layer_step": launches,
            "launches_per_layer_step_total": sum(launches.values()) if launches else None,
            # The real shape's resolve (6,144 lanes: the multi-launch allocation).
            "wide_launches_per_layer_step": wide["launches_per_layer_step"] if wide else None,
            "wide_launches_per_layer_step_total": (
                sum(wide["launches_per_layer_step"].values()) if wide else None
            ),
            # Decode prefetch on / off, median step device time at the real shape (< 1: it
            # pays there; the plugin keeps it off by default).
            "prefetch_step_ratio": prefetch_ratio,
            "left_clean": all(r["left_clean"] for r in results),
            "release_errors": sum(r["release_errors"] for r in results),
        },
        "stood_in": {**imports, "runtime": RUNTIME_STANDINS, "attention": "torch stand-in over "
                     "the rows the resolve returns (benchmark/harness/toy_model.py)"},
        "results": results,
    }  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plugin_gpu_harness.json").write_text(json.dumps(record, indent=2) + "\n")
    ok = record["metrics"]["all_equal"] and record["metrics"]["left_clean"]
    print(f"[harness] all equal and clean: {ok}; record {out / 'plugin_gpu_harness.json'}")
    return 0 if ok else 1


def _commit() -> str | None:
    """ECHO_COMMIT where the caller knows better (a copied tree's git may be stale)."""
    if os.environ.get("ECHO_COMMIT"):
        return os.environ["ECHO_COMMIT"]
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
            check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None


if __name__ == "__main__":
    sys.exit(main())
