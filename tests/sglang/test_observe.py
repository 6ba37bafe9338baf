"""Seeing what ECHO does (sglang_echo/sglang/observe.py, plugin.py): each rank's start-up
line, ECHO's metrics in sglang's Prometheus exporter (multiprocess mode, as sglang runs it
with --enable-metrics; in a fresh process), and the plugin's load checks."""

from __future__ import annotations

import logging
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import plugin_testenv  # first: sets the process up before sglang loads
import pytest
import torch

plugin_testenv.require_sglang()

from sglang_world import DecodeNode, cpu_machine  # noqa: E402,F401 (autouse fixture)

HERE = Path(__file__).resolve().parent
LABELS = {
    "model_name": "dsv32",
    "engine_type": "decode",
    "tp_rank": 0,
    "pp_rank": 0,
    "moe_ep_rank": 0,
    "dp_rank": 0,
}


def small_node() -> DecodeNode:
    return DecodeNode(layers=2, top_k=16, dev_cache=32, max_running=2, host_tokens=1024,
                      max_context=160)  # fmt: skip


def run_steps(node: DecodeNode, steps: int = 6) -> list[str]:
    """Two PD requests of 100 tokens, random selections over their whole context: the
    32-slot cache misses and evicts."""
    rng = random.Random(5)

    def topk_for(layer: int, rid: str, seq_len: int) -> torch.Tensor:
        k = min(seq_len, node.top_k)
        return torch.tensor(sorted(rng.sample(range(seq_len), k)), dtype=torch.int32)

    rids = [node.arrive(100), node.arrive(90)]
    for _ in range(steps):
        node.step(rids, padded_bs=2, topk_for=topk_for)
    return rids


def test_one_startup_line_per_rank_with_the_sizes(caplog):
    with caplog.at_level(logging.INFO, logger="sglang_echo.sglang.coordinator"):
        node = small_node()
    lines = [r.getMessage() for r in caplog.records if "sglang-echo rank" in r.getMessage()]
    assert len(lines) == 1, lines
    line = lines[0]
    coord = node.coord
    host_tokens = coord.mem_pool_host.size - coord.reserved_host_ids.numel()
    row_bytes = (512 + 64) * 2  # bf16 rows
    for part in (
        "sglang-echo rank tp=0 dp=0: ECHO cache of N_G=32 slots x 2 layers",
        f"{row_bytes} B/row",
        f"host pool of {host_tokens} tokens ({coord.mem_pool_host.size} rows)",
        f"cache rows {2 * 34 * row_bytes} in sglang's pool",
        f"host bytes {coord.mem_pool_host.kv_buffer.nbytes}",
        "decode prefetch off",
        "recall by torch",
    ):
        assert part in line, (part, line)


def test_metric_values_follow_the_cache_counters():
    """publish_metrics reads the summed device counters; counters advance by deltas."""
    from sglang_echo.sglang.observe import read_counters

    node = small_node()
    rids = run_steps(node)
    coord = node.coord
    values = read_counters(coord)
    hits, misses = int(coord.cache.hits.sum()), int(coord.cache.misses.sum())
    assert misses > 0 and values["misses"] == misses and values["hits"] == hits
    assert values["evictions"] == int(coord.cache.evictions.sum()) > 0
    assert values["recalled_bytes"] == int(coord.cache.recalled_rows.sum()) * 1152 > 0
    assert values["hit_rate"] == pytest.approx(hits / (hits + misses))
    assert values["cache_rows"] == 64
    assert 0 < values["rows_in_use"] <= 64
    assert values["staged_rows"] == 0  # decode prefetch off
    for rid in rids:
        node.finish(rid)


def test_metrics_appear_in_sglangs_exporter():
    """A fresh process as an sglang scheduler with --enable-metrics: sglang's
    PROMETHEUS_MULTIPROC_DIR set-up, the coordinator, a few decode steps, then sglang's
    (hooked) SchedulerMetricsReporter._log_hicache_stats twice; /metrics' collector
    (MultiProcessCollector, as sglang's add_prometheus_middleware builds it) shows them."""
    env = dict(os.environ)
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), *filter(None, [env.get("PYTHONPATH")])])
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "exporter"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = done.stdout
    labels = 'dp_rank="0",engine_type="decode",model_name="dsv32"'
    for name in (
        "sglang:echo_hits_total",
        "sglang:echo_misses_total",
        "sglang:echo_evictions_total",
        "sglang:echo_recalled_bytes_total",
        "sglang:echo_staged_rows_total",
        "sglang:echo_staged_rows_used_total",
        "sglang:echo_hit_rate",
        "sglang:echo_rows_in_use",
        "sglang:echo_cache_rows",
    ):
        samples = [line for line in text.splitlines() if line.startswith(name + "{")]
        assert len(samples) == 1, (name, text)
        assert labels in samples[0] and 'tp_rank="0"' in samples[0], samples[0]
    expected = {
        line.split()[1]: line.split()[2] for line in text.splitlines() if line.startswith("EXPECT ")
    }
    value = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("sglang:echo_")
    }
    # The counters were published twice: they hold the totals, not twice them.
    assert value["sglang:echo_misses_total"] == float(expected["misses"]) > 0
    assert value["sglang:echo_hits_total"] == float(expected["hits"])
    assert value["sglang:echo_evictions_total"] == float(expected["evictions"]) > 0
    assert value["sglang:echo_recalled_bytes_total"] == float(expected["recalled_bytes"]) > 0
    assert value["sglang:echo_cache_rows"] == 64
    assert 0 < value["sglang:echo_rows_in_use"] <= 64
    assert 0 <= value["sglang:echo_hit_rate"] <= 1


def exporter_main() -> None:
    from sglang.srt.utils.common import set_prometheus_multiproc_dir

    set_prometheus_multiproc_dir()  # what sglang's launcher does with --enable-metrics
    from sglang_world import init_process_group

    from benchmark.harness.kv_sides import cpu_shims

    cpu_shims()
    init_process_group(tempfile.mkdtemp())
    node = small_node()
    run_steps(node)
    from prometheus_client import CollectorRegistry, generate_latest, multiprocess
    from sglang.srt.managers.scheduler_components.metrics_reporter import (
        SchedulerMetricsReporter,
    )

    reporter = SimpleNamespace(
        scheduler=SimpleNamespace(enable_hierarchical_cache=False, hisparse_coordinator=node.coord),
        metrics_collector=SimpleNamespace(labels=dict(LABELS)),
    )
    SchedulerMetricsReporter._log_hicache_stats(reporter)
    SchedulerMetricsReporter._log_hicache_stats(reporter)
    cache = node.coord.cache
    print(f"EXPECT misses {int(cache.misses.sum())}")
    print(f"EXPECT hits {int(cache.hits.sum())}")
    print(f"EXPECT evictions {int(cache.evictions.sum())}")
    print(f"EXPECT recalled_bytes {int(cache.recalled_rows.sum()) * 1152}")
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    print(generate_latest(registry).decode())


def test_load_checks_name_what_to_change(monkeypatch):
    from sglang_echo.plugin import load_problems

    assert load_problems({"NSA_KV_OFFLOAD": "1"}) == []  # the entry point is installed here
    problems = load_problems({"NSA_KV_OFFLOAD": "1", "SGLANG_PLUGINS": "other"})
    assert len(problems) == 1 and "SGLANG_PLUGINS='other' does not name 'echo'" in problems[0]
    assert "is not 1" in load_problems({})[0]


def test_an_install_failure_stops_the_process(monkeypatch):
    """sglang only logs a plugin's exception: with NSA_KV_OFFLOAD=1, register() turns a
    failing install into SystemExit naming the cause and the fix."""
    import sglang_echo.sglang.install as install_module
    from sglang_echo import plugin
    from sglang_echo.config import reset_settings

    def broken() -> None:
        raise ImportError("cannot import name 'register_resolution_hook'")

    monkeypatch.setenv("NSA_KV_OFFLOAD", "1")
    monkeypatch.setattr(install_module, "install", broken)
    reset_settings()
    with pytest.raises(SystemExit) as stop:
        plugin.register()
    reset_settings()
    text = str(stop.value)
    for part in ("NSA_KV_OFFLOAD=1", "could not install", "register_resolution_hook",
                 "sglang.srt.plugins: echo", "unset NSA_KV_OFFLOAD"):  # fmt: skip
        assert part in text, (part, text)


if __name__ == "__main__" and sys.argv[1:] == ["exporter"]:
    exporter_main()
