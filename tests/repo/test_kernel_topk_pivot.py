"""The threshold-pivot decode top-k (research/topk_pivot: out of the product, measured
slower than the radix select in every served setting) against the radix select and the plain-torch reference
(interpreter on CPU): the same positions and k-th scores whether the threshold hits the
candidate window, misses it low or high, or is not there yet."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from research.topk_pivot.kernel import (
    empty_pivots,
    pivot_cap,
    topk_pivot_reference,
    topk_positions_pivot,
)
from sglang_echo.kernels.topk import topk_positions

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOPK = 16  # candidate window [16, 64]


def _scores(kind: str, rows: int, n_cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "ties":
        return torch.randint(0, 6, (rows, n_cols), generator=g).float()
    if kind == "negative":
        return torch.randn(rows, n_cols, generator=g) * 1e3
    return torch.rand(rows, n_cols, generator=g)


def _rank_score(scores: torch.Tensor, rank: int) -> torch.Tensor:
    return scores.sort(dim=1, descending=True).values[:, rank - 1]


def _pivots(base: torch.Tensor, step: torch.Tensor | None = None) -> torch.Tensor:
    table = empty_pivots(base.shape[0], base.device)
    table[:, 0] = base
    if step is not None:
        table[:, 1] = step
    return table


def _check(scores, qpos, thresholds, rows, block=64):
    """thresholds [R, 2] -> the table after the call, and which rows the pivot served."""
    table = torch.full((int(rows.max()) + 3, 2), 7.0, device=scores.device)  # other rows
    table[rows] = thresholds
    before = table.clone()
    served = torch.empty(rows.shape[0], dtype=torch.int32, device=scores.device)
    pos, kth = topk_positions_pivot(scores, qpos, TOPK, table, rows, block=block, served=served)
    want_pos, want_kth = topk_pivot_reference(scores, qpos, TOPK)
    assert torch.equal(pos, topk_positions(scores, qpos, TOPK, block=block))
    assert torch.equal(pos, want_pos)
    assert torch.equal(kth, want_kth)
    assert torch.equal(table[rows, 0], want_kth)  # the next step's pivot
    untouched = torch.ones_like(table, dtype=torch.bool)
    untouched[rows] = False
    assert torch.equal(table[untouched], before[untouched])
    return table, served >= 0


@pytest.mark.parametrize("kind", ["random", "ties", "negative"])
def test_every_threshold_gives_the_exact_top_k(kind):
    rows, n_cols = 6, 400
    scores = _scores(kind, rows, n_cols, seed=n_cols)
    scores[2, 30:40] = float("-inf")
    qpos = torch.tensor([n_cols - 1, n_cols - 1, 300, 200, n_cols - 1, 120])
    # Per row: no threshold yet, one that hits (the k-th score of the same distribution's
    # other draw), too high for every rung (fewer than k candidates), too low for every
    # rung (more than the window holds), exactly the k-th score, and exactly the lowest.
    other = _scores(kind, rows, n_cols, seed=n_cols + 1)
    hit = _rank_score(other, TOPK)
    step = (hit - _rank_score(other, 2 * TOPK)).clamp(min=1e-3)
    base = torch.stack(
        [
            torch.tensor(float("-inf")),
            hit[1],
            _rank_score(scores, 1)[2].abs() * 8 + 1,
            _rank_score(scores, n_cols)[3] - _rank_score(scores, 1)[3].abs() * 8 - 1,
            _rank_score(scores, TOPK)[4],
            scores[5].min(),
        ]
    )
    # The step (gap to rank 2k) of the same draw for the guess that hits, none elsewhere;
    # exactly the k-th score serves without one too (its first multiplicative rung).
    thresholds = _pivots(base, torch.where(torch.arange(rows) == 1, step, float("-inf")))
    rows_ix = torch.tensor([4, 0, 2, 1, 3, 5])
    dev = [t.to(DEV) for t in (scores, qpos, thresholds, rows_ix)]
    _table, served = _check(*dev)
    # Both paths ran: the pivot served the guesses near the k-th score, the radix select
    # the row without one (400 visible keys > the window) and the two far off.
    assert served.tolist() == [False, True, False, False, True, False]


def test_short_rows_and_rows_with_fewer_visible_keys_than_k():
    """Fewer visible keys than k: -1 padding, k-th score -inf, and the window still hits
    when every visible key is a candidate."""
    rows, n_cols = 4, 50
    scores = _scores("random", rows, n_cols, seed=3)
    qpos = torch.tensor([0, 5, 10, n_cols - 1])
    thresholds = _pivots(torch.tensor([float("-inf"), float("-inf"), 0.5, float("-inf")]))
    table, served = _check(*(t.to(DEV) for t in (scores, qpos, thresholds, torch.arange(rows))))
    assert served[:2].all()  # every visible key is a candidate
    # Rows with fewer than k visible keys keep no pivot (every visible key fits the
    # window anyway); the full row learns its k-th score.
    assert bool((table[:3, 0] == float("-inf")).all()) and torch.isfinite(table[3:4, 0]).all()


def test_keys_narrower_than_top_k():
    scores = _scores("random", 3, 9, seed=5)
    qpos = torch.tensor([8, 4, 0])
    thresholds = empty_pivots(3, "cpu")
    _check(*(t.to(DEV) for t in (scores, qpos, thresholds, torch.arange(3))))


def test_thresholds_carried_over_steps_stay_exact():
    """The serving loop: each step's scores drift a little, the threshold each step leaves
    is the next step's input; every step equals the reference."""
    g = torch.Generator().manual_seed(11)
    rows, n_cols = 5, 700
    base = torch.rand(rows, n_cols, generator=g)
    table = empty_pivots(rows, DEV)
    ix = torch.arange(rows, device=DEV)
    served_steps = []
    for step in range(6):
        scores = (base + 0.05 * torch.rand(rows, n_cols, generator=g)).to(DEV)
        qpos = torch.full((rows,), n_cols - 1 - 50 + step * 10, device=DEV)
        served = torch.empty(rows, dtype=torch.int32, device=DEV)
        pos, kth = topk_positions_pivot(scores, qpos, TOPK, table, ix, block=128, served=served)
        want_pos, want_kth = topk_pivot_reference(scores, qpos, TOPK)
        assert torch.equal(pos, want_pos) and torch.equal(kth, want_kth)
        assert torch.equal(table[:, 0], want_kth)
        served_steps.append((served >= 0).tolist())
    # The first step has no pivot (the radix select serves it); a row the next ladder
    # misses gets it respaced, and from then on the last k-th score serves every row.
    assert not any(served_steps[0])
    assert all(all(s) for s in served_steps[3:]), served_steps
    assert torch.isfinite(table).all()


def test_the_stage_split_for_benchmarks_is_complete_once_every_row_is_served():
    """``launches`` lets a benchmark time the stages by differences; with every row served
    the radix fallback adds nothing, so three stages already give the whole answer, and
    with a row left for the fallback they do not."""
    g = torch.Generator().manual_seed(5)
    rows, n_cols = 3, 300
    scores = torch.rand(rows, n_cols, generator=g).to(DEV)
    qpos = torch.full((rows,), n_cols - 1, device=DEV)
    ix = torch.arange(rows, device=DEV)
    want, _kth = topk_pivot_reference(scores, qpos, TOPK)
    settled = _pivots(_rank_score(scores, TOPK).to(DEV))
    table = settled.clone()
    served = torch.empty(rows, dtype=torch.int32, device=DEV)
    pos, _ = topk_positions_pivot(
        scores, qpos, TOPK, table, ix, block=64, served=served, launches=3
    )
    assert (served >= 0).all() and torch.equal(pos, want)
    table = settled.clone()
    table[1] = float("-inf")  # no pivot: the fallback's row
    pos, _ = topk_positions_pivot(scores, qpos, TOPK, table, ix, block=64, launches=3)
    assert torch.equal(pos[[0, 2]], want[[0, 2]]) and not torch.equal(pos[1], want[1])
    with pytest.raises(ValueError, match="launches must be 1-4"):
        topk_positions_pivot(scores, qpos, TOPK, settled.clone(), ix, launches=0)


def test_rejects_bad_thresholds():
    scores = torch.rand(2, 32)
    with pytest.raises(ValueError, match="thresholds"):
        topk_positions_pivot(scores, torch.tensor([31, 31]), 4, torch.zeros(2), torch.arange(2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="counts compiled GPU variants")
def test_contexts_and_row_counts_of_any_size_reuse_one_compiled_variant() -> None:
    """Decode widths grow every step and batches change size: neither may compile a new
    variant of the pivot's kernels mid-serving. Every threshold state at full scale gives
    the radix select's exact tensor."""
    from research.topk_pivot import kernel as pivot_module

    kernels = (pivot_module._count_kernel, pivot_module._compact_kernel)
    kernels += (pivot_module._select_kernel,)
    device = torch.cuda.current_device()
    before = None
    shapes = ((3, 5000), (17, 9000), (1, 70000), (48, 100_003), (48, 100_000))
    for step, (rows, n_cols) in enumerate(shapes):
        scores = torch.randn(rows, n_cols, device=DEV)
        qpos = torch.full((rows,), n_cols - 1, device=DEV)
        qpos[0] = n_cols // 3
        table = empty_pivots(rows, DEV)
        ix = torch.arange(rows, device=DEV)
        want = topk_positions(scores, qpos, 2048)
        served = torch.empty(rows, dtype=torch.int32, device=DEV)
        fits = (qpos + 1).cpu() <= pivot_cap(2048)  # every visible key is a candidate
        for call in range(3):  # the radix select (no pivot), then the ladders it leaves
            pos, _kth = topk_positions_pivot(scores, qpos, 2048, table, ix, served=served)
            assert torch.equal(pos, want)
            assert torch.equal((served >= 0).cpu(), fits | (call > 0))
        torch.cuda.synchronize()
        counts = [len(k.device_caches[device][0]) for k in kernels]
        if step == 0:
            before = counts
    assert counts == before, f"variants per kernel grew from {before} to {counts}"


def test_the_rank_search_shifts_in_64_bits_when_compiled_for_sm90() -> None:
    """The 4-way search's first round spans 2^32 keys. In the interpreter ``1 << 32`` is a
    Python int, but compiled, a 32-bit shift by 32 is undefined: on the H200 it lost the
    first round and picked wrong rows (only the GPU variant test saw it). Compile-only."""
    import os
    import subprocess
    import sys

    script = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from research.topk_pivot.kernel import _select_kernel
sig = {"served_ptr": "*i32", "cand_scores_ptr": "*fp32", "cand_cols_ptr": "*i32",
       "out_ptr": "*i64", "kth_ptr": "*fp32", "thresholds_ptr": "*fp32", "rows_ptr": "*i64",
       "out_stride": "i32", "n_rows": "i32", "k": "i32", "topk": "i32",
       "CAP": "constexpr", "PDL": "constexpr"}
names = list(sig)
src = ASTSource(fn=_select_kernel, signature=sig,
                constexprs={(names.index("CAP"),): 8192, (names.index("PDL"),): False})
kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 16})
print("\\n".join(ln for ln in kernel.asm["ttir"].splitlines() if "arith.shli" in ln))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = str(Path(__file__).resolve().parents[2])  # research/ is a package at the root
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (root, env.get("PYTHONPATH"))))
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    shifts = [ln for ln in done.stdout.splitlines() if ln.strip()]
    assert shifts and all(ln.rstrip().split(" loc(")[0].endswith(": i64") for ln in shifts), shifts
