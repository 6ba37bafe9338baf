"""The device bytes of each ECHO buffer owner, from sizes alone (no torch, no triton).

Why a module of its own: two places need these numbers before any tensor exists: the
sglang launcher, which refuses a plan that cannot fit while it resolves arguments
(sglang/sizing.py, pure Python), and the runtime's token budget (runtime/serving.py). Each
owner exports its function as ``bytes_for`` (``DeviceCache.bytes_for``,
``AllocWorkspace.bytes_for`` (kernels/alloc_geometry.py), ``EchoManager.counter_bytes_for``,
``DecodePrefetcher.bytes_for``), and ``tests/test_footprint.py`` builds each owner and checks
its function against the tensors it allocated, so a new buffer that is not counted fails
there rather than in a sizing estimate.
"""

from __future__ import annotations

from sglang_echo.kernels.alloc_geometry import workspace_bytes

I32, I64 = 4, 8
DEVICE_CACHE_COUNTERS = 5  # hits, misses, evictions, append_evictions, recalled_rows


def device_cache_bytes(layers: int, slots: int, host_tokens: int, row_bytes: int) -> int:
    """``offload.device_cache.DeviceCache`` of ``slots`` (N_G) slots over ``host_tokens``
    (N_H) host ids: its rows (``row_bytes`` per token; 0 where the rows are borrowed, as in
    the plugin), maps, priorities, free stack, clock and counters, for every layer."""
    per_layer = (
        (slots + 2) * row_bytes  # rows
        + I32 * (host_tokens + 2)  # host_to_device
        + I32 * (slots + 2)  # device_to_host
        + I64 * (slots + 2)  # priority
        + I32 * (slots + 1)  # free_stack
        + I32  # free_count
        + I64  # clock
        + I64 * DEVICE_CACHE_COUNTERS
    )
    return layers * per_layer


def host_map_bytes_per_token(layers: int) -> int:
    """What one more host token adds on the device: its ``host_to_device`` entry per layer."""
    return device_cache_bytes(layers, 0, 1, 0) - device_cache_bytes(layers, 0, 0, 0)


def manager_counter_bytes(layers: int) -> int:
    """``offload.manager.EchoManager``'s device counters: rows prefetched and prefetch hits
    per layer, and one count of refused release lanes."""
    return I64 * (2 * layers + 1)


def threshold_bytes(request_slots: int) -> int:
    """One ``offload.predictor.DecodeThresholdPredictor``: a float32 threshold and a bool
    per request slot, plus its scratch row."""
    return (4 + 1) * (request_slots + 1)


def decode_prefetch_bytes(
    request_slots: int,
    host_tokens: int,
    row_bytes: int,
    layers: int,
    chunks: int,
    stage_rows: int,
) -> int:
    """``offload.decode_prefetcher.DecodePrefetcher``: the staging rows and their int64
    host ids (``stage_rows`` per request, split over ``chunks``), each chunk's int32 count,
    the int32 host-id map over ``host_tokens`` (N_H) + 2 entries, and one threshold
    predictor per layer."""
    entries = chunks * request_slots * (stage_rows // chunks)
    return (
        entries * (row_bytes + I64)
        + I32 * chunks
        + I32 * (host_tokens + 2)
        + layers * threshold_bytes(request_slots)
    )


def echo_device_bytes(
    layers: int,
    slots: int,
    host_tokens: int,
    row_bytes: int,
    eviction_reserve: int,
    max_lanes: int | None = None,
) -> int:
    """ECHO's device bytes besides the index keys: the per-layer cache (``row_bytes`` per
    token and layer; 0 where the rows are borrowed), the one allocation workspace (calls of
    up to ``max_lanes`` lanes; default N_G) and the manager's counters."""
    lanes = slots if max_lanes is None else max_lanes
    return (
        device_cache_bytes(layers, slots, host_tokens, row_bytes)
        + workspace_bytes(slots, lanes, eviction_reserve)
        + manager_counter_bytes(layers)
    )


def echo_metadata_bytes(
    layers: int, slots: int, host_tokens: int, eviction_reserve: int, max_lanes: int | None = None
) -> int:
    """``echo_device_bytes`` without rows: what the plugin adds beside sglang's own pool."""
    return echo_device_bytes(layers, slots, host_tokens, 0, eviction_reserve, max_lanes)
