"""Decode intra-query prefetch: while the fp8 indexer scores a request's keys, flag the
misses its exact top-k will probably select, so their recall can start before the top-k.

A key is a candidate when its logit beats the request's predicted threshold
(``theta[b]``, offload.predictor.DecodeThresholdPredictor: an EMA of the request's
previous exact k-th scores) and its host id is not resident in the layer's device cache
(``host_to_device[id] == ABSENT``). Candidates are compacted per request in position
order into a fixed ``[B, cap]`` list of host ids (-1 past the request's count), with the
count ``[B]`` on the device: the first ``cap`` candidates by position are kept. Order
and contents are deterministic (no atomics), so the allocation that consumes the list
leaves the same cache state with the Triton kernels as with the torch reference.

Lossless by construction: the flags only decide which rows move early. The logits are
computed by the same code as the plain kernel (kernels/indexer.py ``_fp8_logits_block``),
so they are bit-identical to it, and the exact top-k over them decides what attention
reads (docs/ARCHITECTURE.md section 6).

Two launches: the logits kernel also writes a 0/1 flag per position and a count per key
block (the residency map is only read for keys above theta, a few per request); a
compaction kernel places each block's candidates after the preceding blocks' counts. The
torch reference does the same from computed scores; it is the CPU path and the path of
the bf16 indexer. Two one-launch kernels serve the step's epilogue: the threshold update
after the exact top-k (DecodeThresholdPredictor.update's semantics) and the count of
prefetched rows the resolve then selected (telemetry).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from sglang_echo.kernels.cache_layout import ABSENT
from sglang_echo.kernels.indexer import (
    DEFAULT_BLOCK_N,
    DEFAULT_BLOCKS_PER_PROGRAM,
    DEFAULT_NUM_STAGES,
    _check,
    _fp8_logits_block,
    _request_query,
    fp8_index_logits,
)

COMPACT_TILE = 2048  # positions per compaction program (a multiple of the key block)


class DecodeCandidates(NamedTuple):
    """ids [B, cap] int64 host ids in position order, -1 past ``counts[b]``;
    counts [B] int64 = min(candidates of request b, cap)."""

    ids: torch.Tensor
    counts: torch.Tensor


# ----------------------------------------------------------------------------- kernels
@triton.jit
def _fp8_logits_flag_kernel(
    q_ptr, w_ptr, k_ptr, k_scale_ptr, locs_ptr, lens_ptr, out_ptr,
    theta_ptr, h2d_ptr, flags_ptr, block_counts_ptr,
    length, k_stride, k_scale_stride, locs_stride, out_stride, n_blocks,
    H: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr,
    PRECISE_ACC: tl.constexpr, KEYS_AS_M: tl.constexpr, ABSENT_ID: tl.constexpr,
):  # fmt: skip
    """The plain logits kernel plus, per key block: a flag per position (logit > theta and
    not resident) and the block's flag count."""
    b = tl.program_id(0)
    q, w, seq_len = _request_query(q_ptr, w_ptr, lens_ptr, b, H=H, D=D)
    theta = tl.load(theta_ptr + b)
    row = b.to(tl.int64)
    first = tl.program_id(1) * BLOCKS
    for i in range(BLOCKS):
        blk = first + i
        n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
        logits, loc, live = _fp8_logits_block(
            q, w, k_ptr, k_scale_ptr, locs_ptr, b, n, seq_len, k_stride, k_scale_stride,
            locs_stride, D=D, PRECISE_ACC=PRECISE_ACC, KEYS_AS_M=KEYS_AS_M,
        )  # fmt: skip
        tl.store(out_ptr + b * out_stride + n, logits, mask=n < length)
        # The residency map is read only for keys above theta: a few per request.
        over = live & (logits > theta)
        slot = tl.load(h2d_ptr + loc, mask=over, other=0)
        fetch = over & (slot == ABSENT_ID)
        tl.store(flags_ptr + row * length + n, fetch.to(tl.int8), mask=n < length)
        tl.store(
            block_counts_ptr + row * n_blocks + blk,
            tl.sum(fetch.to(tl.int32), 0),
            mask=blk < n_blocks,
        )


@triton.jit
def _compact_kernel(
    flags_ptr, block_counts_ptr, locs_ptr, ids_ptr, counts_ptr,
    length, n_blocks, locs_stride, cap,
    TILE: tl.constexpr, TILE_BLOCKS: tl.constexpr, MAX_BLOCKS: tl.constexpr,
    CAP_LANES: tl.constexpr,
):  # fmt: skip
    """Grid (requests, position tiles): write a tile's candidates after those of the
    preceding key blocks, keeping the first ``cap``; tile 0 writes the count and pads the
    rest of the request's list with -1. (Constexpr widths, one per power of two: the
    interpreter needs constexpr trip counts, and the context width changes every step.)"""
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    t = tl.arange(0, MAX_BLOCKS)
    c = tl.load(block_counts_ptr + row * n_blocks + t, mask=t < n_blocks, other=0)
    prefix = tl.sum(tl.where(t < tile * TILE_BLOCKS, c, 0), 0)
    total = tl.sum(c, 0)
    n = tile * TILE + tl.arange(0, TILE)
    f = tl.load(flags_ptr + row * length + n, mask=n < length, other=0).to(tl.int32)
    pos = prefix + tl.cumsum(f, 0) - 1
    take = (f != 0) & (pos < cap)
    loc = tl.load(locs_ptr + row * locs_stride + n, mask=take, other=0).to(tl.int64)
    tl.store(ids_ptr + row * cap + pos, loc, mask=take)
    kept = tl.minimum(total, cap)
    tl.store(counts_ptr + row, kept.to(tl.int64), mask=tile == 0)
    lane = tl.arange(0, CAP_LANES)
    pad = tl.full((CAP_LANES,), -1, dtype=tl.int64)
    tl.store(ids_ptr + row * cap + lane, pad, mask=(tile == 0) & (lane >= kept) & (lane < cap))


# ---------------------------------------------------------------------------- launcher
def _check_prefetch(scores_shape, locs, seq_lens, theta, host_to_device, cap) -> None:
    batch, length = scores_shape
    if locs.dim() != 2 or locs.shape[0] != batch or locs.shape[1] < length:
        raise ValueError(f"locs must be [B, >= L] = [{batch}, >= {length}] host ids")
    if seq_lens.shape != (batch,):
        raise ValueError(f"seq_lens must be [B] = [{batch}], got {tuple(seq_lens.shape)}")
    if theta.shape != (batch,) or theta.dtype != torch.float32:
        raise ValueError(
            f"theta must be [B] = [{batch}] float32 (DecodeThresholdPredictor.predict), "
            f"got {tuple(theta.shape)} {theta.dtype}"
        )
    if host_to_device.dim() != 1 or host_to_device.dtype != torch.int32:
        raise ValueError("host_to_device must be the layer's 1-D int32 map (DeviceCache)")
    if cap < 0:
        raise ValueError(f"cap must be >= 0 candidates per request, got {cap}")
    for name, t in (("locs", locs), ("theta", theta), ("host_to_device", host_to_device)):
        if t.device != seq_lens.device:
            raise ValueError(f"{name} is on {t.device}, seq_lens on {seq_lens.device}")


def _empty(batch: int, cap: int, device: torch.device) -> DecodeCandidates:
    return DecodeCandidates(
        torch.full((batch, cap), -1, dtype=torch.int64, device=device),
        torch.zeros(batch, dtype=torch.int64, device=device),
    )


def fp8_index_logits_prefetch(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    key_scales: torch.Tensor,
    locs: torch.Tensor,
    seq_lens: torch.Tensor,
    theta: torch.Tensor,
    host_to_device: torch.Tensor,
    cap: int,
    block_n: int = DEFAULT_BLOCK_N,
    num_warps: int = 4,
    num_stages: int = DEFAULT_NUM_STAGES,
    blocks_per_program: int = DEFAULT_BLOCKS_PER_PROGRAM,
    keys_as_m: bool = True,
    precise_acc: int = 32,
    compact_tile: int = COMPACT_TILE,
) -> tuple[torch.Tensor, DecodeCandidates]:
    """:func:`kernels.indexer.fp8_index_logits` (same arguments, bit-identical logits)
    plus the prefetch candidates: per request, the host ids ``locs[b, n]`` of positions
    n < seq_lens[b] whose logit > theta[b] (float32 [B]) and whose ``host_to_device`` entry
    (the layer's int32 map) is ABSENT, in position order, the first ``cap`` of them.
    Two launches, fixed shapes, no host synchronisation. ``compact_tile`` positions per
    compaction program (a power of two, a multiple of ``block_n``)."""
    if keys.stride(1) != 1:
        raise ValueError("keys need unit stride along D")
    _check(q, weights, keys, key_scales, locs, seq_lens)
    batch, heads, dim = q.shape
    length = locs.shape[1]
    _check_prefetch((batch, length), locs, seq_lens, theta, host_to_device, cap)
    kernel_args = dict(
        block_n=block_n,
        num_warps=num_warps,
        num_stages=num_stages,
        blocks_per_program=blocks_per_program,
        keys_as_m=keys_as_m,
        precise_acc=precise_acc,
    )
    if cap == 0 or length == 0 or batch == 0:
        logits = fp8_index_logits(q, weights, keys, key_scales, locs, seq_lens, **kernel_args)
        return logits, _empty(batch, cap, q.device)
    if compact_tile % block_n or triton.next_power_of_2(compact_tile) != compact_tile:
        raise ValueError(
            f"compact_tile must be a power of two and a multiple of block_n ({block_n}), "
            f"got {compact_tile}"
        )
    dev = q.device
    n_blocks = triton.cdiv(length, block_n)
    out = torch.empty(batch, length, dtype=torch.float32, device=dev)
    flags = torch.empty(batch, length, dtype=torch.int8, device=dev)
    block_counts = torch.empty(batch, n_blocks, dtype=torch.int32, device=dev)
    ids = torch.empty(batch, cap, dtype=torch.int64, device=dev)
    counts = torch.empty(batch, dtype=torch.int64, device=dev)
    grid = (batch, triton.cdiv(n_blocks, blocks_per_program))
    _fp8_logits_flag_kernel[grid](
        q.contiguous(), weights.contiguous().float(), keys, key_scales, locs, seq_lens, out,
        theta.contiguous(), host_to_device, flags, block_counts,
        length, keys.stride(0), key_scales.stride(0), locs.stride(0), out.stride(0), n_blocks,
        H=heads, D=dim, BLOCK_N=block_n, BLOCKS=blocks_per_program, PRECISE_ACC=precise_acc,
        KEYS_AS_M=keys_as_m, ABSENT_ID=ABSENT, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    _compact_kernel[(batch, triton.cdiv(length, compact_tile))](
        flags, block_counts, locs, ids, counts, length, n_blocks, locs.stride(0), cap,
        TILE=compact_tile, TILE_BLOCKS=compact_tile // block_n,
        MAX_BLOCKS=triton.next_power_of_2(n_blocks), CAP_LANES=triton.next_power_of_2(cap),
    )  # fmt: skip
    return out, DecodeCandidates(ids, counts)


# ---------------------------------------------------------------------------- reference
def decode_prefetch_reference(
    scores: torch.Tensor,
    locs: torch.Tensor,
    seq_lens: torch.Tensor,
    theta: torch.Tensor,
    host_to_device: torch.Tensor,
    cap: int,
) -> DecodeCandidates:
    """The candidates from computed scores [B, L] (any float dtype; positions at and past
    seq_lens[b] are ignored whatever they hold): the semantics the kernels must meet, and
    the path of the torch indexer. Fixed shapes, no host synchronisation (graph-safe)."""
    if scores.dim() != 2:
        raise ValueError(f"scores must be [B, L], got shape {tuple(scores.shape)}")
    _check_prefetch(tuple(scores.shape), locs, seq_lens, theta, host_to_device, cap)
    batch, length = scores.shape
    if cap == 0 or length == 0 or batch == 0:
        return _empty(batch, cap, scores.device)
    locs = locs[:, :length].to(torch.int64)
    pos = torch.arange(length, device=scores.device)
    visible = pos[None, :] < seq_lens.to(torch.int64)[:, None]
    key = torch.where(visible, locs, torch.zeros_like(locs))
    over = visible & (scores.to(torch.float32) > theta[:, None])
    flag = over & (host_to_device[key] == ABSENT)
    rank = torch.cumsum(flag.to(torch.int64), 1) - 1
    take = flag & (rank < cap)
    dest = torch.where(take, rank, torch.full_like(rank, cap))  # column cap: dropped
    ids = torch.full((batch, cap + 1), -1, dtype=torch.int64, device=scores.device)
    ids.scatter_(1, dest, torch.where(take, locs, torch.full_like(locs, -1)))
    counts = flag.sum(1).clamp(max=cap)
    return DecodeCandidates(ids[:, :cap].contiguous(), counts)


# ------------------------------------------------ step epilogue: thresholds, telemetry
# One launch each instead of a dozen tiny torch ops on the main stream: at hit rate 1.0
# these sit on the critical path of every layer's decode step.
@triton.jit
def _ema_store(theta_ptr, finite_ptr, row, new, alpha, live):
    """DecodeThresholdPredictor.update's rule for the lanes' rows and new k-th scores."""
    old = tl.load(theta_ptr + row, mask=live, other=0.0)
    was_finite = tl.load(finite_ptr + row, mask=live, other=0) != 0
    new_finite = tl.abs(new) < float("inf")
    blend = was_finite & new_finite
    # Zeros where a value is infinite: no inf - inf on lanes that keep ``new`` anyway.
    a = tl.where(blend, new, 0.0)
    b = tl.where(blend, old, 0.0)
    value = tl.where(blend, alpha * a + (1.0 - alpha) * b, new)
    tl.store(theta_ptr + row, value, mask=live)
    tl.store(finite_ptr + row, new_finite, mask=live)


@triton.jit
def _threshold_kernel(
    theta_ptr, finite_ptr, kth_ptr, rows_ptr, n, kth_stride, alpha, LANES: tl.constexpr
):  # fmt: skip
    lane = tl.program_id(0) * LANES + tl.arange(0, LANES)
    live = lane < n
    row = tl.load(rows_ptr + lane, mask=live, other=0).to(tl.int64)
    new = tl.load(kth_ptr + lane * kth_stride, mask=live, other=0.0).to(tl.float32)
    _ema_store(theta_ptr, finite_ptr, row, new, alpha, live)


@triton.jit
def _topk_threshold_kernel(
    theta_ptr, finite_ptr, scores_ptr, pos_ptr, rows_ptr, scores_stride, pos_stride, topk,
    alpha, K: tl.constexpr,
):  # fmt: skip
    """One program per request: its k-th score (the smallest picked score; -inf where the
    top-k has empty lanes) straight from the scores and positions, then the EMA."""
    b = tl.program_id(0)
    lane = tl.arange(0, K)
    inside = lane < topk
    pos = tl.load(pos_ptr + b * pos_stride + lane, mask=inside, other=0)
    picked = tl.load(scores_ptr + b * scores_stride + pos, mask=inside & (pos >= 0), other=0.0)
    picked = tl.where(inside & (pos >= 0), picked, float("inf"))
    kth = tl.min(picked, 0)
    missing = tl.sum((inside & (pos < 0)).to(tl.int32), 0) > 0
    kth = tl.where(missing, float("-inf"), kth)
    row = tl.load(rows_ptr + b).to(tl.int64)
    _ema_store(theta_ptr, finite_ptr, row, kth, alpha, row >= 0)


def update_thresholds(
    theta: torch.Tensor, finite: torch.Tensor, kth: torch.Tensor, rows: torch.Tensor, alpha: float
) -> None:
    """DecodeThresholdPredictor.update (its reference) in one launch: for distinct request
    rows, theta[row] = EMA(alpha) of the new k-th score where both are finite, else the
    new score; finite[row] = whether the new score is finite. ``kth`` may be strided (a
    column of the sorted scores: no copy). Floating-point contraction is off, so the
    result matches the torch ops bit for bit."""
    if theta.dtype != torch.float32 or finite.dtype != torch.bool:
        raise ValueError("theta must be float32 and finite bool (DecodeThresholdPredictor)")
    if kth.shape != rows.shape or kth.dim() != 1:
        raise ValueError(
            f"expected kth [B] and rows [B], got {tuple(kth.shape)}, {tuple(rows.shape)}"
        )
    n = kth.numel()
    if n == 0:
        return
    lanes = min(1024, triton.next_power_of_2(n))
    _threshold_kernel[(triton.cdiv(n, lanes),)](
        theta, finite, kth, rows.contiguous(), n, kth.stride(0), float(alpha), LANES=lanes,
        enable_fp_fusion=False,
    )  # fmt: skip


def update_thresholds_from_topk(
    theta: torch.Tensor,
    finite: torch.Tensor,
    scores: torch.Tensor,
    positions: torch.Tensor,
    rows: torch.Tensor,
    alpha: float,
) -> None:
    """:func:`update_thresholds` with the k-th scores taken from the top-k itself (scores
    [B, L] float32, positions [B, topk], -1 = none): one launch in place of the gather,
    the two reductions and the fills that ``exact_topk`` would run on the main stream.
    The k-th score is the smallest picked score, -inf where a lane is empty (exact_topk's
    rule), so the thresholds are bit-identical to exact_topk + update_thresholds."""
    if theta.dtype != torch.float32 or finite.dtype != torch.bool:
        raise ValueError("theta must be float32 and finite bool (DecodeThresholdPredictor)")
    batch, topk = positions.shape
    if scores.shape[0] != batch or rows.shape != (batch,) or scores.dtype != torch.float32:
        raise ValueError("expected scores [B, L] float32, positions [B, topk], rows [B]")
    if batch == 0 or topk == 0:
        return
    _topk_threshold_kernel[(batch,)](
        theta, finite, scores, positions, rows, scores.stride(0), positions.stride(0), topk,
        float(alpha), K=triton.next_power_of_2(topk), enable_fp_fusion=False,
    )  # fmt: skip


@triton.jit(do_not_specialize=("lanes",))
def _prefetch_hits_kernel(
    ids_ptr, slots_ptr, count_ptr, d2h_ptr, prio_ptr, clock_ptr, hits_ptr, lanes,
    LANES: tl.constexpr,
):  # fmt: skip
    lane = tl.program_id(0) * LANES + tl.arange(0, LANES)
    live = (lane < lanes) & (lane < tl.load(count_ptr))
    ids = tl.load(ids_ptr + lane, mask=live, other=0)
    slots = tl.load(slots_ptr + lane, mask=live, other=0)
    owner = tl.load(d2h_ptr + slots, mask=live, other=-1).to(tl.int64)
    stamp = tl.load(prio_ptr + slots, mask=live, other=-1)
    hit = live & (owner == ids) & (stamp == tl.load(clock_ptr))
    tl.atomic_add(hits_ptr, tl.sum(hit.to(tl.int64), 0))


def count_prefetch_hits(
    miss_ids: torch.Tensor,
    miss_slots: torch.Tensor,
    miss_count: torch.Tensor,
    lanes: int,
    device_to_host: torch.Tensor,
    priority: torch.Tensor,
    clock: torch.Tensor,
    hits: torch.Tensor,
) -> None:
    """hits[0] += prefetched rows (the first ``miss_count`` of a prefetch's miss list,
    at most ``lanes``) that the resolve selected: still owned by their token and stamped
    with the layer's clock. One launch; :func:`count_prefetch_hits_reference` is the
    same in torch."""
    if lanes == 0:
        return
    block = 1024  # fixed: prefetch sizes vary (prefill), one compiled variant
    _prefetch_hits_kernel[(triton.cdiv(lanes, block),)](
        miss_ids, miss_slots, miss_count, device_to_host, priority, clock, hits, lanes,
        LANES=block,
    )  # fmt: skip


def count_prefetch_hits_reference(
    miss_ids: torch.Tensor,
    miss_slots: torch.Tensor,
    miss_count: torch.Tensor,
    lanes: int,
    device_to_host: torch.Tensor,
    priority: torch.Tensor,
    clock: torch.Tensor,
    hits: torch.Tensor,
) -> None:
    """Plain torch (fixed shapes, no host sync) of :func:`count_prefetch_hits`."""
    live = torch.arange(lanes, device=miss_ids.device) < miss_count
    slots = torch.where(live, miss_slots[:lanes], 0)
    owner = device_to_host[slots].to(torch.int64)
    selected = priority[slots] == clock.reshape(())
    hits += (live & (owner == miss_ids[:lanes]) & selected).sum()
