"""Graph-replayed timings of the pivot decode top-k (kernels/topk_pivot.py), for
indexer_bench.py's record.

Four pivot states, each checked to give the radix select's exact tensor first, each with
how many rows the pivot served (the others run the radix select in the same call):
- steady: the pivots the kernel itself leaves on these scores (its settled state);
- drift: the pivots left by the previous step's scores, here the logits of a perturbed
  query over the same keys;
- one new row: row 0 has no pivot yet (a request's first decode step);
- all new: no row has one (the radix select serves every row, plus the pivot's launches).
States other than steady are restored inside the captured graph before each top-k (a copy
of 2 x 48 floats, included in the time), since the top-k rewrites them.
"""

from __future__ import annotations

import torch

from benchmark.kernels.common import graph_us
from research.topk_pivot.kernel import GRID, empty_pivots, pivot_cap, topk_positions_pivot
from sglang_echo.kernels.topk import topk_positions


def _settled(logits: torch.Tensor, qpos: torch.Tensor, topk: int) -> torch.Tensor:
    """The pivots after a few steps on ``logits``."""
    table = empty_pivots(logits.shape[0], logits.device)
    ix = torch.arange(logits.shape[0], device=logits.device)
    for _ in range(4):
        topk_positions_pivot(logits, qpos, topk, table, ix)
    return table


STAGES = ("count", "compact", "select", "fallback")


def _stage_times(logits, qpos, topk, table, steady, ix) -> dict:
    """The settled pivot's time split by stage: the first n of its launches, n = 1..4, each
    graph-replayed, and the differences (the pivots restored before each run: the select
    rewrites them)."""
    cumulative = []
    for n in range(1, len(STAGES) + 1):

        def run(n=n):
            table.copy_(steady)
            return topk_positions_pivot(logits, qpos, topk, table, ix, launches=n)

        cumulative.append(graph_us(run))
    table.copy_(steady)
    steps = [b - a for a, b in zip([0.0, *cumulative[:-1]], cumulative, strict=True)]
    return {"cumulative": dict(zip(STAGES, cumulative, strict=True)),
            "by_difference": dict(zip(STAGES, steps, strict=True))}  # fmt: skip


def pivot_timings(
    logits: torch.Tensor, qpos: torch.Tensor, topk: int, drift_logits: torch.Tensor
) -> dict:
    rows = logits.shape[0]
    want = topk_positions(logits, qpos, topk)
    ix = torch.arange(rows, device=logits.device)
    steady = _settled(logits, qpos, topk)
    one_new = steady.clone()
    one_new[0] = float("-inf")
    states = {
        "steady": None,
        "drift": _settled(drift_logits, qpos, topk),
        "one_new_row": one_new,
        "all_new": empty_pivots(rows, logits.device),
    }
    table = torch.empty_like(steady)
    served = torch.empty(rows, dtype=torch.int32, device=logits.device)
    out: dict = {"window": [topk, pivot_cap(topk)], "rungs": GRID, "rows": rows}
    for name, start in states.items():

        def run(start=start, n=rows):
            if start is not None:
                table[:n].copy_(start[:n])
            return topk_positions_pivot(logits[:n], qpos[:n], topk, table, ix[:n], served=served)

        table.copy_(steady if start is None else start)
        equal = torch.equal(run()[0], want)
        out[f"{name}_equal"] = equal
        out[f"{name}_rows_served"] = int((served >= 0).sum())
        if not equal:  # never time a wrong answer
            continue
        table.copy_(steady)
        out[f"{name}_us"] = graph_us(run)
        if name in ("steady", "all_new"):
            table.copy_(steady)
            out[f"{name}_b1_us"] = graph_us(lambda run=run: run(n=1))
        if name == "steady":  # where the settled time goes: each stage by difference
            out["steady_stages_us"] = _stage_times(logits, qpos, topk, table, steady, ix)
        print(f"pivot top-k {name}: {out[f'{name}_us']:.1f} us, "
              f"{out[f'{name}_rows_served']} of {rows} rows served", flush=True)  # fmt: skip
    return out
