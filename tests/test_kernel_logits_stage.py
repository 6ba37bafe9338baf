"""In-kernel decode prefetch (kernels/logits_stage.py): the staged logits kernel writes the
plain kernel's logits bit for bit, and it and the scores kernel stage exactly each
request's reference candidates into the request's region (as a set: the order within a
region follows the atomics; when a region overflows, a subset of the candidates of the
right size), with the map pointing at an entry holding each staged token, the staged rows equal to the
host rows, and the counters uncapped. Triton runs under the interpreter on CPU."""

from __future__ import annotations

import pytest
import torch

from sglang_echo.kernels.cache_layout import ABSENT
from sglang_echo.kernels.indexer import fp8_index_logits
from sglang_echo.kernels.logits_stage import (
    StageBuffers,
    copy_rest,
    copy_rest_reference,
    fp8_index_logits_staged,
    stage_scores,
    stage_scores_reference,
)
from test_kernel_decode_prefetch import _inputs  # the fp8 logits inputs, shared

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ROW_BYTES = 48


def _candidates(scores, locs, lens, theta, h2d, b: int) -> list[int]:
    """Request b's candidates in position order."""
    return [
        int(locs[b, n])
        for n in range(int(lens[b]))
        if scores[b, n] > theta[b] and int(h2d[int(locs[b, n])]) == ABSENT
    ]


def _setup(seed: int, cap: int):
    q, w, keys, scales, locs, lens, h2d = _inputs(seed, length=150)
    plain = fp8_index_logits(q, w, keys, scales, locs, lens, block_n=16)
    # Row 0 at its 70% score quantile, row 1 at 0 (about half its keys), row 2 +inf.
    first = plain[0, : int(lens[0])].float().quantile(0.7).item()
    theta = torch.tensor([first, 0.0, float("inf")], dtype=torch.float32, device=DEV)
    g = torch.Generator().manual_seed(seed)
    host = torch.randint(0, 256, (keys.shape[0], ROW_BYTES), generator=g, dtype=torch.uint8)
    host = host.to(DEV)

    def buffers() -> StageBuffers:
        stage = StageBuffers(4, cap, ROW_BYTES, torch.uint8, keys.shape[0], DEV)
        stage.counts.fill_(99)  # a previous step's: emptied by the launch itself
        stage.stage_map.fill_(7)  # stale everywhere
        return stage

    return (q, w, keys, scales, locs, lens, h2d), plain, theta, host, buffers


def _assert_staged(stage, total, plain, locs, lens, theta, h2d, host, cap) -> None:
    kept = 0
    for b in range(3):
        want = _candidates(plain, locs, lens, theta, h2d, b)
        assert int(stage.counts[b]) == len(want)  # uncapped
        n = min(len(want), cap)
        kept += n
        entries = torch.arange(b * cap, b * cap + n, device=DEV)
        got = stage.ids[entries].tolist()
        assert len(set(got)) == n and set(got) <= set(want)
        if len(want) <= cap:
            assert set(got) == set(want)
        # The map points at an entry holding the token (a token two requests share is
        # staged in both regions; the map keeps one of them).
        ids = stage.ids[entries]
        assert torch.equal(stage.ids[stage.stage_map[ids].long()], ids)
        assert torch.equal(stage.rows[entries], host[stage.ids[entries]])
        # Nothing past the kept lanes: no write strays into another region.
        assert (stage.ids[b * cap + n : (b + 1) * cap] == -1).all()
        assert (stage.rows[b * cap + n : (b + 1) * cap] == 0).all()
    assert int(total) == kept
    assert (stage.ids[3 * cap :] == -1).all()
    # A region past the batch is emptied too: an earlier, larger batch's count there
    # would validate stale map entries.
    assert int(stage.counts[3]) == 0


@pytest.mark.parametrize("cap", [120, 12], ids=["room", "overflow"])
def test_staged_logits_equal_plain_and_stage_the_candidates(cap):
    (q, w, keys, scales, locs, lens, h2d), plain, theta, host, buffers = _setup(4, cap)
    stage, total = buffers(), torch.zeros(1, dtype=torch.int64, device=DEV)
    out = fp8_index_logits_staged(
        q, w, keys, scales, locs, lens, theta, h2d, host, stage, total, block_n=16
    )
    assert torch.equal(out, plain)  # the same bits as the plain kernel
    assert len(_candidates(plain, locs, lens, theta, h2d, 0)) > 12  # overflow binds
    assert len(_candidates(plain, locs, lens, theta, h2d, 1)) > 12
    _assert_staged(stage, total, plain, locs, lens, theta, h2d, host, cap)


@pytest.mark.parametrize("cap", [120, 12], ids=["room", "overflow"])
def test_staging_from_scores_matches_the_reference(cap):
    (*_, locs, lens, h2d), plain, theta, host, buffers = _setup(5, cap)
    for fn in (stage_scores, stage_scores_reference):
        stage, total = buffers(), torch.zeros(1, dtype=torch.int64, device=DEV)
        fn(plain, locs, lens, theta, h2d, host, stage, total)
        _assert_staged(stage, total, plain, locs, lens, theta, h2d, host, cap)
    ref = buffers()
    stage_scores_reference(plain, locs, lens, theta, h2d, host, ref, torch.zeros(1).long())
    for b in range(3):  # the reference keeps the first cap by position
        want = _candidates(plain, locs, lens, theta, h2d, b)[:cap]
        assert ref.ids[b * cap : b * cap + len(want)].tolist() == want


@pytest.mark.parametrize("copy", [copy_rest, copy_rest_reference], ids=["kernel", "reference"])
def test_rows_past_the_copy_limit_are_left_to_copy_rest(copy):
    """With ``copy_limit`` the logits kernel copies only each region's ranks below it; the
    others are recorded (ids, map, count) but their rows move in copy_rest, after which the
    staging is what a kernel copying everything leaves."""
    cap, limit = 12, 5
    (q, w, keys, scales, locs, lens, h2d), plain, theta, host, buffers = _setup(4, cap)
    stage, total = buffers(), torch.zeros(1, dtype=torch.int64, device=DEV)
    out = fp8_index_logits_staged(
        q, w, keys, scales, locs, lens, theta, h2d, host, stage, total, block_n=16,
        copy_limit=limit,
    )  # fmt: skip
    assert torch.equal(out, plain)
    waiting = 0
    for b in range(3):
        n = min(int(stage.counts[b]), cap)
        first = b * cap
        copied = min(n, limit)
        ids = stage.ids[first : first + copied]
        assert torch.equal(stage.rows[first : first + copied], host[ids])
        assert (stage.rows[first + copied : first + n] == 0).all()  # not copied yet
        waiting += n - copied
    assert waiting > 0  # the case occurs
    copy(host, stage, 3, limit)
    _assert_staged(stage, total, plain, locs, lens, theta, h2d, host, cap)


def test_a_batch_past_the_regions_is_refused():
    stage = StageBuffers(2, 4, ROW_BYTES, torch.uint8, 10, DEV)
    with pytest.raises(ValueError, match="exceeds the 2 regions"):
        stage.begin(3)
    with pytest.raises(ValueError, match="region"):
        StageBuffers(0, 4, ROW_BYTES, torch.uint8, 10, DEV)
