"""Graph-replayed timings of the threshold-pivot decode top-k (kernels/topk_pivot.py), for
indexer_bench.py's record.

Four threshold states, each checked to give the radix select's exact tensor first:
- steady: the threshold the kernel itself leaves on these scores (a count of exactly AIM
  candidates: the hit path every row of a settled decode batch takes);
- drift: thresholds left by the previous step's scores, here the logits of a perturbed
  query over the same keys; the record says how many rows still hit;
- one new row: row 0 has no threshold yet (a request's first decode step), so its
  program runs the full-row select while the others take the hit path;
- all miss: every row runs the full-row select (the worst case).
States other than steady are restored inside the captured graph before each top-k (a
copy or fill of 48 floats, included in the time), since the top-k rewrites them.
"""

from __future__ import annotations

import torch
from common import graph_us

from sglang_echo.kernels.topk import topk_positions
from sglang_echo.kernels.topk_pivot import AIM_PER_TOPK, pivot_cap, topk_positions_pivot

SELECT_WARPS = (8, 16)


def _rows_in_window(logits: torch.Tensor, thresholds: torch.Tensor, topk: int) -> int:
    n = (logits >= thresholds.view(-1, 1)).sum(dim=1)
    return int(((n >= topk) & (n <= pivot_cap(topk))).sum())


def pivot_timings(
    logits: torch.Tensor, qpos: torch.Tensor, topk: int, drift_logits: torch.Tensor
) -> dict:
    rows = logits.shape[0]
    want = topk_positions(logits, qpos, topk)
    ix = torch.arange(rows, device=logits.device)
    aim = AIM_PER_TOPK * topk
    steady = logits.sort(dim=1, descending=True).values[:, aim - 1].contiguous()
    drift = drift_logits.sort(dim=1, descending=True).values[:, aim - 1].contiguous()
    table = torch.empty(rows, device=logits.device)
    states = {
        "steady": None,
        "drift": drift,
        "one_new_row": torch.cat((torch.full((1,), float("-inf"), device=logits.device),
                                  steady[1:])),
        "all_miss": torch.full((rows,), float("-inf"), device=logits.device),
    }  # fmt: skip
    out: dict = {
        "aim_rank": aim,
        "window": [topk, pivot_cap(topk)],
        "drift_rows_in_window": _rows_in_window(logits, drift, topk),
        "rows": rows,
    }
    for warps in SELECT_WARPS:
        for name, start in states.items():

            def run(start=start, n=rows, warps=warps):
                if start is not None:
                    table[:n].copy_(start[:n])
                return topk_positions_pivot(
                    logits[:n], qpos[:n], topk, table, ix[:n], select_num_warps=warps
                )

            table.copy_(steady if start is None else start)
            equal = torch.equal(run()[0], want)
            key = f"{name}_w{warps}"
            out[f"{key}_equal"] = equal
            if not equal:  # never time a wrong answer
                continue
            table.copy_(steady)
            out[f"{key}_us"] = graph_us(run)
            if name in ("steady", "all_miss"):
                table.copy_(steady)
                out[f"{key}_b1_us"] = graph_us(lambda run=run: run(n=1))
            print(f"pivot top-k {key}: {out[f'{key}_us']:.1f} us", flush=True)
    return out
