"""The allocation kernels' launch geometry and age-histogram width, in a module free of
torch and triton: kernels/alloc_common.py launches with them, and offload/footprint.py
sizes the workspace they imply before anything is allocated (the sglang launcher's sizing
runs without torch)."""

NUM_BUCKETS = 256
HIST_BINS = NUM_BUCKETS  # the age histogram: one bin per bucket (unevictable: masked out)
# The launch shape. For the five-launch pipeline it
# was the fastest of 8 shapes on an H200; for the look-back resolve, cache_ops_bench's
# former --sweep timed 18 shapes at batch 48 in three runs (cache_ops.json's
# launch_shape_sweep; the runs: docs/ARCHITECTURE.md section 15, "Measured choices"): 512
# lanes x 16 warps was the fastest each time, ahead of this one, and fewer lanes or warps
# per program were slower. So the look-back takes that shape (LOOKBACK_*); the pipeline
# (appends) and the one program's block keep these, where they were measured.
LANE_BLOCK = 1024
SLOT_BLOCK = 2048
NUM_WARPS = 8
LOOKBACK_LANE_BLOCK = 512
LOOKBACK_WARPS = 16


I32, I64 = 4, 8


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def workspace_bytes(slots: int, max_lanes: int, eviction_reserve: int) -> int:
    """``kernels.alloc_common.AllocWorkspace`` of a cache of ``slots`` slots, for calls of up
    to ``max_lanes`` lanes, at the module's launch geometry (this module's)."""
    slot_programs = _cdiv(slots + 2, SLOT_BLOCK)
    return (
        I32 * HIST_BINS  # hist
        + I32 * max(1, _cdiv(max_lanes, LANE_BLOCK))  # lane_counts
        + I32 * 2 * slot_programs  # slot_counts
        + 2 * I64 * (max_lanes + 1)  # miss_ids, miss_slots
        + I64 + I32  # miss_count, miss_bound
        + I32 * max(1, eviction_reserve)  # extras
        + 2 * (slots + 2)  # buckets (int16)
        + I32 * 2  # tickets
        + I32 * 2 * max(1, _cdiv(max_lanes, LOOKBACK_LANE_BLOCK))  # tile_words
        + I64 * slot_programs  # slot_words
        + I64 * 2  # call_counts
        + I32 * max(1, max_lanes)  # lane_ref
    )  # fmt: skip
