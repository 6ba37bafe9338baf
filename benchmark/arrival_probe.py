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

Two arms, interleaved repeat by repeat: the host rows' copies on a stream of their own
(``two_streams``, the default) and on the transfer's one stream (``one_stream``).

    python benchmark/arrival_probe.py --out DIR [--repeats 5] [--beside-decode 12]
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
from sglang_echo.runtime.host_threads import limit_host_threads
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
    ap.add_argument(
        "--beside-decode", type=int, default=0, metavar="B",
        help="time the arrivals while B requests of the same length decode (0: alone)",
    )  # fmt: skip
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
    transfer's stream): the writes' device span (CUDA events on that stream, after it
    waited for the host rows' copy stream) and the writer's host time per arrival."""

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
            if self.transfer.copy_stream is not None:
                torch.cuda.current_stream().wait_stream(self.transfer.copy_stream)
            b.record()
            self.spans.append((a, b))

    def take(self) -> tuple[list[float], list[float]]:
        """(device ms, host ms) of the writes since the last take."""
        for _, b in self.spans:
            b.synchronize()
        device = [a.elapsed_time(b) for a, b in self.spans]
        host = [1e3 * s for s in self.host_s]
        self.spans, self.host_s = [], []
        return device, host


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
    beside = args.beside_decode
    background_tokens = 4096 if beside else 0  # each running request's output budget
    context = n + 64 + background_tokens
    folder = Path(tempfile.mkdtemp(prefix="arrival_probe_"))
    write_spec(folder, layers=args.layers, size=size)
    pool = (beside + 2) * context
    sargs = ServerArgs(
        model_path=str(folder),
        device="cuda" if cuda else "cpu",
        context_length=context,
        max_total_tokens=pool,
        max_running_requests=beside + 2,
        disaggregation_mode="decode",
        disaggregation_transfer_backend="fake",
        model_loader=loader.SPEC,
        model_loader_args="--fake-kv-locality 0.9",
        # decode graphs only where a batch decodes beside the arrivals
        disable_cuda_graph=not beside,
        cuda_graph_max_bs=max(1, beside + 1),
    )
    dev_cache = min(args.dev_cache, pool)
    serving = build_serving(sargs, echo=EchoConfig(offload=True, dev_cache_size=dev_cache))
    limit_host_threads(serving.scheduler.steps.device)  # as the server's engine does
    sched = serving.scheduler
    transfer = sched.prompt_source
    two_streams = transfer.copy_stream
    timed = TimedWrites(transfer)
    vocab = serving.info["vocab_size"]
    rng = random.Random(0)

    def prompt() -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    def one(rid: str) -> float:
        """One arrival (its request ends on arrival): its start-to-arrival ms, the decode
        batch stepping beside it if one runs."""
        before_n, before_s = transfer.transfers, transfer.transfer_s
        sched.add(ServeRequest(rid=rid, prompt=prompt(), params=SamplingParams(max_new_tokens=1)))
        while transfer.transfers == before_n:
            sched.step()
        if transfer.transfers != before_n + 1:
            raise RuntimeError(f"{rid}: expected one arrival, saw {transfer.transfers - before_n}")
        return 1e3 * (transfer.transfer_s - before_s)

    for i in range(beside):  # the batch that decodes beside the timed arrivals
        params = SamplingParams(max_new_tokens=background_tokens, ignore_eos=True)
        sched.add(ServeRequest(rid=f"bg{i}", prompt=prompt(), params=params))
    while transfer.transfers < beside:
        sched.step()
    steps0 = sched.stats.decode_steps
    arms = {"two_streams": two_streams, "one_stream": None}
    for name, stream in arms.items():  # a warm-up of each
        transfer.copy_stream = stream
        one(f"warm-{name}")
    timed.take()
    results: dict[str, dict[str, list[float]]] = {
        name: {"arrival": [], "stream": [], "host": []} for name in arms
    }
    for i in range(args.repeats):  # the arms interleaved, repeat by repeat
        for name, stream in arms.items():
            transfer.copy_stream = stream
            arrival = one(f"{name}-{i}")
            device, host = timed.take()
            r = results[name]
            r["arrival"].append(arrival)
            r["stream"].extend(device)
            r["host"].extend(host)
    transfer.copy_stream = two_streams
    decode_steps = sched.stats.decode_steps - steps0
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for i in range(args.profiled):
            one(f"p{i}")
        if cuda:
            torch.cuda.synchronize()
    timed.take()
    row_bytes = serving.kv_cache.host.rows.shape[-1] * serving.kv_cache.host.rows.element_size()
    nbytes = args.layers * n * row_bytes
    roof = d2h_roofline_gbps(nbytes)
    roof_ms = 1e3 * nbytes / (roof * 1e9) if roof else None
    by_arm = {}
    for name, r in results.items():
        arrival = median(r["arrival"])
        by_arm[name] = {
            "arrival_ms": [round(x, 3) for x in r["arrival"]],
            "arrival_ms_median": arrival,
            "stream_ms_median": median(r["stream"]),  # the writes' span on the streams
            "writer_host_ms_median": median(r["host"]),  # the writer thread queuing them
            "effective_gbps": nbytes / (arrival / 1e3) / 1e9 if arrival else None,
            "arrival_over_roofline": arrival / roof_ms if roof_ms and arrival else None,
        }
    one_arm, two_arm = by_arm["one_stream"], by_arm["two_streams"]
    metrics = {
        "prompt_tokens": n,
        "layers": args.layers,
        "beside_decode": beside,
        "decode_steps_during": decode_steps,
        "host_row_bytes": row_bytes,
        "host_bytes_per_arrival": nbytes,
        "d2h_roofline_gbps": roof,
        "roofline_ms": roof_ms,
        "arms": by_arm,
        "two_over_one_stream": (
            two_arm["arrival_ms_median"] / one_arm["arrival_ms_median"]
            if one_arm["arrival_ms_median"]
            else None
        ),
        "profile_top": profile_top(prof, max(1, args.profiled)) if args.profiled else [],
    }
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
    for name in ("profiled", "beside_decode"):
        if getattr(args, name) < 0:
            raise SystemExit(f"error: --{name.replace('_', '-')} must be >= 0")
    record = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "arrival_probe.json").write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record["metrics"], indent=1))
    return record


if __name__ == "__main__":
    main()
