"""Live decode prefetch (kernels/decode_stage_live.py): the publishing logits equal the
plain kernel's bit for bit; the copy stages exactly the reference's candidates (as a set
per request: ranks follow an atomic counter) and exactly their host rows; it leaves the
queue empty and the counters zero for the next step, and marks regions past the batch
empty, so an earlier step's entries are never read. Triton runs under the interpreter on
CPU; the H200 runs them too (kernels/ tests in benchmark/device_session.sh)."""

from __future__ import annotations

import pytest
import torch

from sglang_echo.kernels.decode_stage import StagedRows, staged_entries
from sglang_echo.kernels.decode_stage_live import (
    LiveStaging,
    copy_published,
    logits_and_publish,
    publish_and_copy_reference,
)
from sglang_echo.kernels.indexer import fp8_index_logits
from test_kernel_decode_prefetch import _inputs, _thetas

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ROW_BYTES = 48


def _setup(keys: torch.Tensor, theta, rows_of, cap: int, regions: int = 4):
    """The host rows, a threshold table naming ``rows_of``'s rows, and two empty stagings
    (kernels, reference)."""
    table = torch.full((regions + 1,), float("inf"), device=DEV)
    table[rows_of] = theta
    g = torch.Generator().manual_seed(5)
    host = torch.randint(0, 256, (keys.shape[0] + 2, ROW_BYTES), generator=g, dtype=torch.uint8)
    stagings = [
        LiveStaging(regions, cap, ROW_BYTES, torch.uint8, keys.shape[0], torch.device(DEV))
        for _ in range(2)
    ]
    return host.to(DEV), table, stagings


def _run_kernels(inputs, table, rows_of, host, st, total, grid, block):
    q, w, keys, scales, locs, lens, h2d = inputs
    out = logits_and_publish(
        q, w, keys, scales, locs, lens, table, rows_of, h2d, st,
        block_n=block[0], blocks_per_program=block[1],
    )  # fmt: skip
    copy_published(host, st, q.shape[0], total, grid=grid)
    return out


def _assert_staged(st, ref, host, batch, exact: bool) -> None:
    cap = st.cap
    assert torch.equal(st.counts, torch.zeros_like(st.counts))  # ready for the next step
    assert int(st.exited) == 0
    assert (st.queue == -1).all()
    assert (st.final[batch:] == 0).all()
    for b in range(batch):
        n = int(st.final[b])
        e = slice(b * cap, b * cap + n)
        got = st.ids[e].tolist()
        want = ref.ids[b * cap : b * cap + int(ref.final[b])].tolist()
        assert n == len(want)
        if exact:
            assert sorted(got) == sorted(want)
        assert torch.equal(st.rows[e], host[st.ids[e]])  # the host rows, byte for byte
        for token in got:  # the map points at an entry holding the token
            assert int(st.ids[int(st.stage_map[token])]) == token


@pytest.mark.parametrize("block", [(16, 1), (16, 2)])
@pytest.mark.parametrize("grid", [1, 3])
@pytest.mark.parametrize("cap", [200, 9], ids=["room", "overflow"])
def test_publish_and_copy_match_the_reference(cap, grid, block):
    inputs = _inputs(0, batch=3, length=150)
    q, w, keys, scales, locs, lens, h2d = inputs
    plain = fp8_index_logits(q, w, keys, scales, locs, lens, block_n=block[0],
                             blocks_per_program=block[1])  # fmt: skip
    theta = _thetas(plain, lens, 0.7)  # some, all visible, none
    rows_of = torch.tensor([2, 0, 1], device=DEV)  # lanes name request rows
    host, table, (st, ref) = _setup(keys, theta, rows_of, cap)
    totals = torch.zeros(2, dtype=torch.int64, device=DEV)
    out = _run_kernels(inputs, table, rows_of, host, st, totals[0:1], grid, block)
    assert torch.equal(out, plain)
    publish_and_copy_reference(plain, locs, lens, theta, h2d, host, ref, totals[1:2])
    assert torch.equal(st.final, ref.final)
    assert int(st.final[1]) == min(
        cap, int(lens[1]) - int((h2d[locs[1, : int(lens[1])]] != 2**31 - 1).sum())
    )
    assert int(st.final[2]) == 0  # theta +inf: nothing
    assert totals[0] == totals[1] == int(st.final.sum()) > 0
    _assert_staged(st, ref, host, 3, exact=cap == 200)


def test_a_second_step_starts_clean_and_hides_stale_regions():
    """Step 1 with four lanes, step 2 with two: region 2's and 3's entries of step 1 stay
    in the buffer but the recall's validity rule does not take them."""
    cap, block = 200, (16, 1)  # room for every candidate: the sets are exact
    first = _inputs(1, batch=3, length=150)
    keys, h2d = first[2], first[6]
    theta = torch.full((3,), -float("inf"), device=DEV)  # every visible miss
    rows_of = torch.arange(3, device=DEV)
    host, table, (st, ref) = _setup(keys, theta, rows_of, cap)
    total = torch.zeros(1, dtype=torch.int64, device=DEV)
    _run_kernels(first, table, rows_of, host, st, total, 2, block)
    assert int(st.final[2]) > 0
    stale = st.ids[2 * cap : 2 * cap + int(st.final[2])].clone()
    second = tuple(t[:2] if i in (0, 1, 4, 5) else t for i, t in enumerate(first))
    plain2 = fp8_index_logits(*second[:6], block_n=16)
    theta2 = _thetas(plain2, second[5], 0.5)
    table[:2] = theta2
    out = _run_kernels(second, table, rows_of[:2], host, st, total, 2, block)
    assert torch.equal(out, plain2)
    publish_and_copy_reference(plain2, second[4], second[5], theta2, h2d, host, ref, total)
    _assert_staged(st, ref, host, 2, exact=True)
    staged = StagedRows(st.rows, st.stage_map, st.ids, st.final, cap, cap, None)
    stale_now = [t for t in stale.tolist() if t not in st.ids[: 2 * cap].tolist()]
    assert stale_now  # tokens only region 2 held in step 1
    assert (staged_entries(torch.tensor(stale_now, device=DEV), staged) == -1).all()


def test_batch_larger_than_the_staging_is_refused():
    inputs = _inputs(2, batch=3, length=40)
    q, w, keys, scales, locs, lens, h2d = inputs
    st = LiveStaging(2, 8, ROW_BYTES, torch.uint8, keys.shape[0], torch.device(DEV))
    table = torch.zeros(4, device=DEV)
    with pytest.raises(ValueError, match="exceeds the staging's 2 regions"):
        logits_and_publish(q, w, keys, scales, locs, lens, table, torch.arange(3), h2d, st)
