"""Our radix top-k beside FlashInfer's (topk_peers.py) at batch 48 x 100K context, k 2048.

The scores are the fp8 indexer's logits over the bench's keys (indexer_bench.make_inputs),
so the distribution is the one the indexer bench times; a tie-heavy copy (the logits on a
0.25 grid) checks the tie order. Correct first: each peer mode's set is compared with
ours on both inputs (``same_set``), and only then timed, replayed from a CUDA graph where
the mode captures (eager otherwise, and the record says which), at the bench's batch and
at batch 1. Then the serving adapter (kernels/topk_flashinfer.py: FlashInfer's ragged
top-k, sorted to our form) must return our very tensor (``torch.equal``) on the logits, the
tie-heavy copy and rows shorter than k, eagerly and replayed from a graph, before it is
timed in each variant (``serving_adapter``). The first FlashInfer call builds its top-k module (JIT, about 4 minutes on a
fresh H200 machine, skipped where stage topk_peer installs a module built before); it
is timed apart as ``build_and_first_call_s``.

    python benchmark/kernels/topk_peer_bench.py --out benchmark/results
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import capture, graph_us, save_record, time_us
from indexer_bench import make_inputs
from topk_peers import FLASHINFER_MODES, flashinfer_topk, same_set, tie_heavy

from sglang_echo.kernels.indexer import fp8_index_logits
from sglang_echo.kernels.topk import topk_positions
from sglang_echo.kernels.topk_flashinfer import (
    ascending_picks,
    flashinfer_unavailable,
    topk_positions_flashinfer,
)

# kernels/topk_flashinfer.py's adapter (FlashInfer's top-k, ties low, then sorted to our
# form) in the variants SGLANG_ECHO_TOPK=flashinfer could take: the ragged transform (per-row
# lengths) or the plain top-k after the mask, each on its graph-safe path or not.
SERVING_VARIANTS = {
    "graph_safe": dict(graph_safe=True, deterministic=False, ragged=True),
    "graph_safe_deterministic": dict(graph_safe=True, deterministic=True, ragged=True),
    "default_path": dict(graph_safe=False, deterministic=False, ragged=True),
    "plain_graph_safe": dict(graph_safe=True, deterministic=False, ragged=False),
    "plain_default_path": dict(graph_safe=False, deterministic=False, ragged=False),
}


def timings(fn, rows: int) -> dict:
    """Graph-replayed us at ``rows`` and at one row (eager where capture fails)."""
    out = {}
    for name, n in (("us", rows), ("us_b1", 1)):
        try:
            out[name] = graph_us(lambda n=n: fn(n))
            out[f"{name}_basis"] = "CUDA-graph replay (device time)"
        except RuntimeError as exc:
            out[name] = time_us(lambda n=n: fn(n))
            out[f"{name}_basis"] = f"eager (graph capture failed: {str(exc)[:120]})"
    return out


def replay_equal(fn, static: torch.Tensor, inputs: dict, ours: dict) -> bool:
    """Captured once on ``static``, replayed on each input copied into it: the replay's
    output must equal ours on every input (what a decode step's graph relies on)."""
    graph, got = capture(lambda: fn(static), warmup=1)
    ok = True
    for name, x in inputs.items():
        static.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        ok = ok and torch.equal(got, ours[name])
    return ok


def serving(logits: torch.Tensor, qpos: torch.Tensor, k: int, ours_us: dict) -> dict:
    """The adapter's variants: the whole tensor must equal ours (torch.equal) on the
    logits, the tie-heavy copy and rows shorter than k, eagerly and replayed from a graph;
    only then timed."""
    reason = flashinfer_unavailable()
    if reason is not None:
        return {"missing": reason}
    short = qpos.clone()
    short[::3] = torch.arange(0, len(short[::3]), device=qpos.device) * (k // 8)
    cases = {"logits": (logits, qpos), "tie_heavy": (tie_heavy(logits), qpos),
             "short_rows": (logits, short)}  # fmt: skip
    ours = {name: topk_positions(x, p, k) for name, (x, p) in cases.items()}
    # What the contract adds to FlashInfer's own time: the gather, mask and sort of the picks
    # (timed on our picks reversed), and the plain form's mask pass.
    picks = ours["logits"].flip(1).to(torch.int32)
    cols = torch.arange(logits.shape[1], device=logits.device)
    rows = {
        "finish_us": graph_us(lambda: ascending_picks(logits, picks)),
        "finish_us_b1": graph_us(lambda: ascending_picks(logits[:1], picks[:1])),
        "mask_us": graph_us(lambda: logits.masked_fill(cols > qpos.view(-1, 1), float("-inf"))),
    }
    print(f"serving adapter, contract's own cost: {rows}", flush=True)
    for variant, kw in SERVING_VARIANTS.items():
        row = {
            f"equal_{name}": torch.equal(topk_positions_flashinfer(x, p, k, **kw), ours[name])
            for name, (x, p) in cases.items()
        }
        static = logits.clone()
        row["equal_on_replay"] = replay_equal(
            lambda s, kw=kw: topk_positions_flashinfer(s, qpos, k, **kw),
            static,
            {n: x for n, (x, p) in cases.items() if p is qpos},
            {n: ours[n] for n, (x, p) in cases.items() if p is qpos},
        )
        if all(row.values()):
            row.update(
                timings(
                    lambda n, kw=kw: topk_positions_flashinfer(logits[:n], qpos[:n], k, **kw),
                    len(qpos),
                )
            )
            row["ours_over_adapter"] = ours_us["us"] / row["us"]
            row["ours_over_adapter_b1"] = ours_us["us_b1"] / row["us_b1"]
        rows[variant] = row
        print(f"serving adapter {variant}: {row}", flush=True)
    return rows


# Rows (requests in a decode step) and contexts of the sweep that places the crossover
# between the radix select (faster at one row) and FlashInfer's (faster at 48).
SWEEP_ROWS = (1, 2, 4, 8, 12, 16, 24, 32, 48)
SWEEP_CONTEXTS = (100_000, 32_768)


def by_rows(logits: torch.Tensor, qpos: torch.Tensor, k: int, variants: list[str]) -> list:
    """Graph-replayed us of ours and of each adapter variant that returned our tensor, by
    row count and context (contiguous slices, made before timing)."""
    out = []
    for context in SWEEP_CONTEXTS:
        x = logits[:, :context].contiguous()
        p = qpos.clamp(max=context - 1)
        for rows in SWEEP_ROWS:
            if rows > len(x):
                continue
            xs, ps = x[:rows].contiguous(), p[:rows].contiguous()
            row = {"context": context, "rows": rows}
            row["ours_us"] = graph_us(lambda xs=xs, ps=ps: topk_positions(xs, ps, k))
            for v in variants:
                kw = SERVING_VARIANTS[v]
                row[f"{v}_us"] = graph_us(
                    lambda kw=kw, xs=xs, ps=ps: topk_positions_flashinfer(xs, ps, k, **kw)
                )
            out.append(row)
            print(f"by rows: {row}", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmark/results")
    p.add_argument("--batch", type=int, default=48)
    p.add_argument("--context", type=int, default=100_000)
    p.add_argument("--topk", type=int, default=2048)
    args = p.parse_args()
    B, L, k = args.batch, args.context, args.topk
    g = torch.Generator(device="cuda").manual_seed(0)
    q, w, keys, scales, locs, lens = make_inputs(B, L, 64, 128, g)
    logits = fp8_index_logits(q, w, keys, scales, locs, lens)
    qpos = lens.long() - 1
    inputs = {"logits": logits, "tie_heavy": tie_heavy(logits)}
    ours = {name: topk_positions(x, qpos, k) for name, x in inputs.items()}

    metrics: dict = {"batch": B, "context": L, "topk": k}
    metrics["ours"] = timings(lambda n: topk_positions(logits[:n], qpos[:n], k), B)
    print(f"ours: {metrics['ours']}", flush=True)
    peers = {}
    for mode in FLASHINFER_MODES:
        fn = flashinfer_topk(mode)
        if isinstance(fn, str):
            peers[mode] = {"missing": fn}
            print(f"flashinfer {mode}: {fn}", flush=True)
            continue
        start = time.perf_counter()
        got = {name: fn(x, k) for name, x in inputs.items()}
        torch.cuda.synchronize()
        row = {"build_and_first_call_s": time.perf_counter() - start}
        row.update({f"same_set_{name}": same_set(ours[name], got[name]) for name in inputs})
        row["repeatable_order"] = torch.equal(fn(logits, k), got["logits"])
        if row["same_set_logits"]:
            row.update(timings(lambda n, fn=fn: fn(logits[:n], k), B))
            row["ours_over_peer"] = metrics["ours"]["us"] / row["us"]
            row["ours_over_peer_b1"] = metrics["ours"]["us_b1"] / row["us_b1"]
        peers[mode] = row
        print(f"flashinfer {mode}: {row}", flush=True)
    metrics["flashinfer"] = peers
    metrics["serving_adapter"] = serving(logits, qpos, k, metrics["ours"])
    passed = [
        v for v, row in metrics["serving_adapter"].items() if isinstance(row, dict) and "us" in row
    ]
    if passed:
        metrics["by_rows"] = by_rows(logits, qpos, k, passed)
    path = save_record(args.out, "topk_peers", torch.cuda.get_device_name(), metrics)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
