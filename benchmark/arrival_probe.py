"""One decode-node arrival taken apart: how long a prompt's emulated KV transfer takes, on
the transfer's stream and on the writer thread, what runs in it, against the link's limit.

Why: served at rate inf, ECHO's decode node admits requests about as fast as their prompts
arrive (the sum of the transfers' start-to-arrival times nearly filled the run), and one
arrival alone took about twice the time its host rows need at the host link's speed. What
the transfer's time is made of (copies to the pinned pool, the UVA scatter of short runs,
the index keys, the placed device rows, the writer's own host time) decides what to make
faster. This builds the engine the served sweep builds (``build_serving``: the study
worker, a decode node with the fake transfer, ECHO), admits one prompt at a time with no
decode beside it, and records per arrival the start-to-arrival time the server counts, the
device span of the writes on the transfer's stream (CUDA events), the writer thread's host
time, and, under torch's profiler for the last arrivals, the device time by kernel and copy.
The roofline: a plain device-to-pinned copy of the same bytes, timed in the same run.

    python benchmark/arrival_probe.py --out DIR [--prompt-len 104857] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmark.study

import torch

from benchmark.study import loader
from benchmark.study.worker_spec import write_spec
from sglang_echo.config import EchoConfig
from sglang_echo.runtime.request import SamplingParams, ServeRequest
from sglang_echo.runtime.server_args import ServerArgs
from sglang_echo.runtime.serving import build_serving


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument("--out", required=True, type=Path, help="folder for arrival_probe.json")
    ap.add_argument("--layers", type=int, default=8, help="the study worker's layers (8)")
    ap.add_argument(
        "--size", choices=("dsv32", "smoke"), default=None,
        help="the worker's dims (default: dsv32 on CUDA, smoke on the CPU)",
    )  # fmt: skip
    ap.add_argument("--prompt-len", type=int, default=None, help="default 104857 (2000 on CPU)")
    ap.add_argument("--repeats", type=int, default=5, help="timed arrivals (after a warm-up)")
    ap.add_argument("--profiled", type=int, default=2, help="arrivals under torch's profiler")
    ap.add_argument("--dev-cache", type=int, default=260000, help="NSA_DEV_CACHE_SIZE")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--commit", default="", help="the sha the run was made on, literally")
    ap.add_argument("--command", default="", help="the command that made the run")
    return ap


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def d2h_roofline_gbps(nbytes: int, repeats: int = 5) -> float | None:
    """A plain device-to-pinned copy of ``nbytes`` on a side stream, GB/s (median; None
    off CUDA): the link's speed for the transfer's host rows, measured in the same run."""
    if not torch.cuda.is_available():
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.Stream()
    times = []
    with torch.cuda.stream(stream):
        for i in range(repeats + 1):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src, non_blocking=True)
            b.record()
            b.synchronize()
            if i:  # the first is a warm-up
                times.append(a.elapsed_time(b) / 1e3)
    return nbytes / median(times) / 1e9


class TimedWrites:
    """Wraps the fake transfer's ``_write`` (it runs on the writer thread, on the
    transfer's stream): the writes' device span (CUDA events on that stream) and the
    writer's host time per arrival."""

    def __init__(self, transfer) -> None:
        self.transfer = transfer
        self.inner = transfer._write
        self.spans: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.host_s: list[float] = []
        transfer._write = self

    def __call__(self, *args, **kwargs) -> None:
        cuda = torch.cuda.is_available() and self.transfer.stream is not None
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
        t0 = time.perf_counter()
        self.inner(*args, **kwargs)
        self.host_s.append(time.perf_counter() - t0)
        if cuda:
            b.record()
            self.spans.append((a, b))

    def device_ms(self) -> list[float]:
        for _, b in self.spans:
            b.synchronize()
        return [a.elapsed_time(b) for a, b in self.spans]


def profile_top(prof, arrivals: int, top: int = 15) -> list[dict]:
    """The profiled arrivals' device time by kernel or copy, per arrival (ms), largest
    first."""
    rows = []
    for e in prof.key_averages():
        device_us = getattr(e, "device_time_total", None)
        if device_us is None:
            device_us = getattr(e, "cuda_time_total", 0.0)
        self_us = getattr(e, "self_device_time_total", device_us)
        if self_us and self_us > 0:
            rows.append((self_us, e.key, e.count))
    rows.sort(reverse=True)
    return [
        {"name": k, "device_ms_per_arrival": round(us / 1e3 / arrivals, 3), "calls": c // arrivals}
        for us, k, c in rows[:top]
    ]


def git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def run(args: argparse.Namespace) -> dict:
    cuda = torch.cuda.is_available() and args.device in ("auto", "cuda")
    size = args.size or ("dsv32" if cuda else "smoke")
    n = args.prompt_len or (104857 if cuda else 2000)
    folder = Path(tempfile.mkdtemp(prefix="arrival_probe_"))
    write_spec(folder, layers=args.layers, size=size)
    sargs = ServerArgs(
        model_path=str(folder),
        device="cuda" if cuda else "cpu",
        context_length=n + 64,
        max_total_tokens=3 * (n + 64),
        disaggregation_mode="decode",
        disaggregation_transfer_backend="fake",
        model_loader=loader.SPEC,
        model_loader_args="--fake-kv-locality 0.9",
        disable_cuda_graph=True,  # arrivals only: no decode step is timed here
    )
    dev_cache = min(args.dev_cache, 3 * (n + 64))
    serving = build_serving(sargs, echo=EchoConfig(offload=True, dev_cache_size=dev_cache))
    sched = serving.scheduler
    transfer = sched.prompt_source
    timed = TimedWrites(transfer)
    vocab = serving.info["vocab_size"]
    rng = random.Random(0)

    def one(rid: str) -> float:
        """One arrival alone (its request ends on arrival): its start-to-arrival ms."""
        before_n, before_s = transfer.transfers, transfer.transfer_s
        ids = [rng.randrange(3, vocab) for _ in range(n)]
        sched.add(ServeRequest(rid=rid, prompt=ids, params=SamplingParams(max_new_tokens=1)))
        while sched.has_work():
            sched.step()
        if transfer.transfers != before_n + 1:
            raise RuntimeError(f"{rid}: expected one arrival, saw {transfer.transfers - before_n}")
        return 1e3 * (transfer.transfer_s - before_s)

    one("warm-up")
    timed.spans.clear()
    timed.host_s.clear()
    arrival_ms = [one(f"a{i}") for i in range(args.repeats)]
    device_ms = timed.device_ms()
    host_ms = [1e3 * s for s in timed.host_s]
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for i in range(args.profiled):
            one(f"p{i}")
        if cuda:
            torch.cuda.synchronize()
    cache = serving.kv_cache
    host_rows = cache.host.rows
    row_bytes = host_rows.shape[-1] * host_rows.element_size()
    nbytes = args.layers * n * row_bytes
    roof = d2h_roofline_gbps(nbytes)
    arrival = median(arrival_ms)
    metrics = {
        "prompt_tokens": n,
        "layers": args.layers,
        "host_row_bytes": row_bytes,
        "host_bytes_per_arrival": nbytes,
        "arrival_ms": [round(x, 3) for x in arrival_ms],
        "arrival_ms_median": arrival,
        "stream_ms_median": median(device_ms),  # the writes' span on the transfer's stream
        "writer_host_ms_median": median(host_ms),  # the writer thread queuing them
        "effective_gbps": nbytes / (arrival / 1e3) / 1e9 if arrival else None,
        "d2h_roofline_gbps": roof,
        "roofline_ms": 1e3 * nbytes / (roof * 1e9) if roof else None,
        "profile_top": profile_top(prof, max(1, args.profiled)) if args.profiled else [],
    }
    if metrics["roofline_ms"] and arrival:
        metrics["arrival_over_roofline"] = arrival / metrics["roofline_ms"]
    return {
        "name": "arrival_probe",
        "commit": args.commit or git_commit(),
        "command": args.command
        or " ".join(["python3", "benchmark/arrival_probe.py", *sys.argv[1:]]),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "date": time.strftime("%Y-%m-%d"),
        "config": {"size": size, "dev_cache": dev_cache, "repeats": args.repeats},
        "metrics": metrics,
    }


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    for name in ("repeats", "layers"):
        if getattr(args, name) < 1:
            raise SystemExit(f"error: --{name} must be >= 1")
    if args.profiled < 0:
        raise SystemExit("error: --profiled must be >= 0")
    record = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "arrival_probe.json").write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record["metrics"], indent=1))
    return record


if __name__ == "__main__":
    main()
