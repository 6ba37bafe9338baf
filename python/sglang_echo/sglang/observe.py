"""Seeing what ECHO does in sglang: each rank's start-up line and, under ``--enable-metrics``,
ECHO's gauges and counters in sglang's Prometheus exporter.

- ``startup_line``: one INFO line per scheduler (rank), ``sglang-echo rank tp=T dp=D: ECHO
  cache of N_G=... slots x L layers ...``, logged by the coordinator once it is built.
- ``publish_metrics``: an AROUND hook on sglang's
  ``SchedulerMetricsReporter._log_hicache_stats``, which sglang calls right before
  ``SchedulerMetricsCollector.log_stats`` each time it publishes a scheduler's stats (every
  ``--decode-log-interval`` decode steps, after a prefill batch, and when idle). There, and
  only there, the coordinator's device counters are read (one small copy to the host; it
  waits for the step in flight), and ECHO's metrics are set with the collector's labels
  (``model_name``, ``engine_type``, ``tp_rank``, ``pp_rank``, ``moe_ep_rank``, ``dp_rank``
  when sglang sets it). sglang runs prometheus_client in multiprocess mode
  (``PROMETHEUS_MULTIPROC_DIR``): the schedulers' values reach ``/metrics`` through its
  ``MultiProcessCollector``, like sglang's own.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)

REPORTER_TARGET = (
    "sglang.srt.managers.scheduler_components.metrics_reporter."
    "SchedulerMetricsReporter._log_hicache_stats"
)
PREFIX = "sglang:echo_"
# name -> (kind, documentation); counters get prometheus_client's ``_total`` suffix.
METRICS = {
    "hits": ("counter", "ECHO cache: selected rows found on the device (all layers)."),
    "misses": ("counter", "ECHO cache: selected rows recalled from the host (all layers)."),
    "evictions": ("counter", "ECHO cache: resident rows evicted for a miss (all layers)."),
    "recalled_bytes": ("counter", "ECHO cache: bytes recalled from the host pool."),
    "staged_rows": ("counter", "Decode prefetch: rows staged from sglang's indexer logits."),
    "staged_rows_used": ("counter", "Decode prefetch: staged rows that served a miss."),
    "hit_rate": ("gauge", "ECHO cache: hits / (hits + misses) since start (1 before any)."),
    "rows_in_use": ("gauge", "ECHO cache: resident rows, summed over layers."),
    "cache_rows": ("gauge", "ECHO cache: N_G slots x layers (the capacity of rows_in_use)."),
}
COUNTERS = tuple(name for name, (kind, _) in METRICS.items() if kind == "counter")
_metrics: dict[str, Any] = {}  # name -> prometheus_client metric, once per process
_label_names: tuple[str, ...] | None = None
_hook_installed = False
_echo_class: type | None = None  # EchoCoordinator, once a coordinator is built


def rank_of(tp_group: Any) -> tuple[int, int | None]:
    """(tp rank, attention-DP rank or None) as sglang published them in this process; a
    coordinator built by hand (no published ranks) takes its process-group rank."""
    try:
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()
        tp_rank = int(parallel.tp_rank)
    except Exception:  # no published ranks: a coordinator built outside a scheduler
        try:
            import torch.distributed as dist

            return (dist.get_rank(tp_group) if dist.is_initialized() else 0), None
        except Exception:
            return 0, None
    dp_rank = None
    for name in ("attn_dp_rank", "dp_rank"):
        try:
            value = getattr(parallel, name)
        except Exception:
            continue
        if value is not None:
            dp_rank = int(value)
            break
    return tp_rank, dp_rank


def rank_name(tp_group: Any) -> str:
    tp_rank, dp_rank = rank_of(tp_group)
    return f"tp={tp_rank} dp={dp_rank if dp_rank is not None else 0}"


def startup_line(coordinator: Any, prefetch_mode: str) -> str:
    """The rank's one start-up line: N_G, the device rows, the host pool, bytes, prefetch."""
    cache = coordinator.cache
    layers = cache.num_layers
    row_bytes = _row_bytes(cache)
    cache_row_bytes = layers * (coordinator.num_slots + 2) * row_bytes
    metadata = cache.nbytes  # ECHO's own tensors (the rows are sglang's)
    staging = coordinator.decode_prefetch.nbytes if coordinator.decode_prefetch else 0
    host = coordinator.mem_pool_host
    host_bytes = int(getattr(host.kv_buffer, "nbytes", 0))
    left = coordinator.token_to_kv_pool_allocator.hisparse_attn_allocator.available_size()
    return (
        f"sglang-echo rank {rank_name(coordinator.tp_group)}: ECHO cache of "
        f"N_G={coordinator.num_slots} slots x {layers} layers (device rows "
        f"[{coordinator.row_base}, {coordinator.row_base + coordinator.num_slots + 2}), "
        f"{row_bytes} B/row); {left} device rows left for newest pages and prefills; host "
        f"pool of {host.size - coordinator.reserved_host_ids.numel()} tokens "
        f"({host.size} rows); device bytes {cache_row_bytes + metadata + staging} "
        f"(cache rows {cache_row_bytes} in sglang's pool, metadata {metadata}, prefetch "
        f"staging {staging}); host bytes {host_bytes} "
        f"({'pinned' if coordinator.host_rows.pinned else 'not pinned'}); decode prefetch "
        f"{prefetch_mode}; recall by "
        f"{'the Triton kernel' if coordinator.manager.use_kernels else 'torch'}"
    )


def _row_bytes(cache: Any) -> int:
    return cache.row_dim * cache.rows.dtype.itemsize


def read_counters(coordinator: Any) -> dict[str, float]:
    """ECHO's counters since start, summed over layers, in one copy to the host (reads the
    device: call between steps, at sglang's stats cadence)."""
    cache, manager = coordinator.cache, coordinator.manager
    sums = torch.stack(
        [
            t.to(torch.int64).sum()
            for t in (
                cache.hits,
                cache.misses,
                cache.evictions,
                cache.recalled_rows,
                manager.prefetched_rows,
                manager.prefetch_hits,
                cache.free_count,
            )
        ]
    ).tolist()
    hits, misses, evictions, recalled, staged, staged_used, free = sums
    layers = cache.num_layers
    row_bytes = _row_bytes(cache)
    return {
        "hits": hits,
        "misses": misses,
        "evictions": evictions,
        "recalled_bytes": recalled * row_bytes,
        "staged_rows": staged,
        "staged_rows_used": staged_used,
        "hit_rate": hits / (hits + misses) if hits + misses else 1.0,
        "rows_in_use": layers * cache.num_slots - free,
        "cache_rows": layers * cache.num_slots,
    }


def _metric_family(label_names: tuple[str, ...]) -> dict[str, Any] | None:
    """ECHO's metrics, created once per process with sglang's label names (prometheus_client
    imported here, after sglang set PROMETHEUS_MULTIPROC_DIR)."""
    global _label_names
    if _label_names is not None:
        return _metrics if label_names == _label_names else None
    from prometheus_client import Counter, Gauge

    for name, (kind, doc) in METRICS.items():
        if kind == "counter":
            _metrics[name] = Counter(PREFIX + name, doc, labelnames=label_names)
        else:
            _metrics[name] = Gauge(
                PREFIX + name, doc, labelnames=label_names, multiprocess_mode="mostrecent"
            )
    _label_names = label_names
    return _metrics


def publish_metrics(coordinator: Any, labels: dict[str, Any]) -> dict[str, float] | None:
    """Set ECHO's metrics for this rank (counters advance by what grew since the last call).
    Returns the values read, None when they could not be published."""
    label_names = tuple(labels)
    metrics = _metric_family(label_names)
    if metrics is None:
        logger.warning(
            "sglang-echo: sglang's metric labels changed in this process (%s, was %s); "
            "ECHO's metrics are not updated",
            label_names,
            _label_names,
        )
        return None
    values = read_counters(coordinator)
    sent = coordinator._metrics_sent
    label_values = {k: str(v) for k, v in labels.items()}
    for name, value in values.items():
        metric = metrics[name].labels(**label_values)
        if name in COUNTERS:
            delta = value - sent.get(name, 0)
            if delta > 0:
                metric.inc(delta)
            sent[name] = value
        else:
            metric.set(value)
    return values


def around_log_hicache_stats(original, reporter, *args, **kwargs):
    """AROUND sglang's stats refresh right before ``log_stats``: ECHO's metrics too."""
    result = original(reporter, *args, **kwargs)
    coordinator = getattr(getattr(reporter, "scheduler", None), "hisparse_coordinator", None)
    collector = getattr(reporter, "metrics_collector", None)
    if collector is not None and _echo_class and isinstance(coordinator, _echo_class):
        try:
            publish_metrics(coordinator, dict(collector.labels))
        except Exception:  # metrics must never stop the scheduler
            logger.exception("sglang-echo: could not publish ECHO's metrics")
    return result


def install_metrics_hook(echo_class: type) -> None:
    """Register ``around_log_hicache_stats`` once per process (from the coordinator: only
    schedulers build one), for coordinators of ``echo_class`` (given, not imported: the
    coordinator imports this module). If sglang cannot apply it (it only logs that), say
    so."""
    global _hook_installed, _echo_class
    _echo_class = echo_class
    if _hook_installed:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookSource, HookType

    source = HookSource(plugin_name="echo", dist_name="sglang-echo")
    HookRegistry.register(REPORTER_TARGET, around_log_hicache_stats, HookType.AROUND, source=source)
    HookRegistry.apply_hooks()
    _hook_installed = True
    if REPORTER_TARGET not in HookRegistry._patched:
        logger.warning(
            "sglang-echo: could not wrap %s; ECHO's metrics (%s*) are not exported",
            REPORTER_TARGET,
            PREFIX,
        )
