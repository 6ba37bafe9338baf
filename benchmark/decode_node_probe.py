"""The decode node's engine without HTTP: where its host time goes, admission included.

Why: through the HTTP server, both backends lost about 0.1 s of batch progress per admitted
100K-token request; the engine clock put it in the ``admit`` phase. This probe builds the
same engine the server builds (``build_serving`` with the sweep's flags), submits N
prompts at once and steps the scheduler to the end on this thread, with no HTTP threads
beside it. It prints the engine clock (wall and CPU per phase) and, with ``--profile``,
the functions that took the admission time. Admission costing the same here as through
HTTP means its own work; much less means another thread (the GIL) took it.

With ``--trace DIR`` it also records a torch profiler trace (CUDA activity) of a window of
decode steps in the steady state and folds it (benchmark/device_timeline.py) into what the
GPU did between the decode graphs: the served efficiency's missing share, by stream and
kernel, and the gaps between the steps' graph launches. The clock gives the efficiency
(the decode steps' device time / wall) of the whole run and of the traced window; the
profiler slows the window's host side several-fold, so compare efficiencies of untraced
runs (``--readback`` is such an A/B) and read the trace for where the gaps come from.

    python benchmark/decode_node_probe.py --model DIR --backend echo [--profile] [--trace DIR]

Requests are greedy unless ``--temperature`` says otherwise: the served sweeps' client asks
for temperature 0, and a sampled step adds the sampler's launches between the decode graphs.
ECHO's switches other than the backend and the device cache come from the environment, as
for the server: ``SGLANG_ECHO_RESOLVE_OVERLAP=0 python benchmark/decode_node_probe.py ...``.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import random
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmark.study

from benchmark.device_timeline import load_chrome_trace, summarize
from benchmark.study import loader
from sglang_echo.config import EchoConfig
from sglang_echo.env_settings import ENV_DEV_CACHE, ENV_OFFLOAD
from sglang_echo.runtime.engine_loop import engine_time_summary
from sglang_echo.runtime.host_threads import limit_host_threads
from sglang_echo.runtime.request import SamplingParams, ServeRequest
from sglang_echo.runtime.server_args import ServerArgs
from sglang_echo.runtime.serving import build_serving
from sglang_echo.runtime.streams import on_engine_stream


def probe_echo_config(
    offload: bool, dev_cache: int, environ: Mapping[str, str] | None = None
) -> EchoConfig:
    """The backend and device cache from the flags, every other ECHO setting from the
    environment (``SGLANG_ECHO_PDL=0``, ``SGLANG_ECHO_RESOLVE_OVERLAP=0``, ...), so an A/B of
    a switch runs through this probe as it does through the server. Why: a config built from
    the flags alone gave every arm the defaults whatever the environment said."""
    env = dict(os.environ if environ is None else environ)
    env.update({ENV_OFFLOAD: "1" if offload else "0", ENV_DEV_CACHE: str(dev_cache)})
    return EchoConfig.from_env(env)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model", required=True, help="a study worker folder (benchmark.study.worker_spec)"
    )
    ap.add_argument("--backend", choices=("no-offload", "echo"), default="echo")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--min-len", type=int, default=100000)
    ap.add_argument("--max-len", type=int, default=110000)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="every request's temperature: 0 (greedy, the default) as the serving benchmark's "
        "client sends; above 0 each step also runs the sampler's race (runtime/sampling.py)",
    )
    ap.add_argument("--context", type=int, default=110592)
    ap.add_argument("--pool", type=int, default=None, help="max total tokens (default: sweep's)")
    ap.add_argument("--dev-cache", type=int, default=260000)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--profile", default=None, help="write a cProfile of the run here (.txt too)")
    ap.add_argument("--out", default=None, help="write the clock as JSON here")
    ap.add_argument(
        "--trace", default=None, help="a folder: a profiler trace of a window of decode steps"
    )
    ap.add_argument("--trace-after", type=int, default=150, help="decode steps before the window")
    ap.add_argument("--trace-steps", type=int, default=100, help="decode steps in the window")
    ap.add_argument(
        "--readback",
        choices=("kernel", "torch"),
        default="kernel",
        help="how step results reach the host: the engine's stores into pinned memory "
        "(kernels/pinned_store.py, the default) or torch's copies by copy engine (the A/B)",
    )
    args = ap.parse_args()
    echo = args.backend == "echo"
    pool = args.pool or (1800000 if echo else 380000)
    sargs = ServerArgs(
        model_path=args.model,
        device=args.device,
        context_length=args.context,
        max_total_tokens=pool,
        disaggregation_mode="decode",
        disaggregation_transfer_backend="fake",
        model_loader=loader.SPEC,  # the study worker folder, its indexers biased
        model_loader_args="--fake-kv-locality 0.9",
    )
    serving = build_serving(sargs, echo=probe_echo_config(echo, args.dev_cache))
    limit_host_threads(serving.scheduler.steps.device)  # as the server's engine does
    sched = serving.scheduler
    if args.readback == "torch":  # the readbacks as they were: copy-engine copies
        sched.steps.readback = None
        rule = getattr(sched.steps.kv_cache, "rule", None)
        if rule is not None:
            rule._counts_alias = None
    vocab = serving.info["vocab_size"]
    rng = random.Random(0)

    def request(i: int, n: int) -> ServeRequest:
        ids = [rng.randrange(3, vocab) for _ in range(n)]
        params = SamplingParams(
            max_new_tokens=args.output_len, ignore_eos=True, temperature=args.temperature
        )
        return ServeRequest(rid=f"p{i}", prompt=ids, params=params)

    # Warm-up: one request, so the first graph capture and lazy set-up are not counted.
    sched.add(request(-1, args.min_len))
    while sched.has_work():
        sched.step()
    reqs = [request(i, rng.randint(args.min_len, args.max_len)) for i in range(args.num_prompts)]
    base = {
        k: dict(v) for k, v in (("wall", sched.stats.phase_s), ("cpu", sched.stats.phase_cpu_s))
    }
    tokens0, steps0 = sched.stats.generation_tokens, sched.stats.decode_steps
    profile = cProfile.Profile() if args.profile else None
    window = TracedWindow(sched, args.trace, args.trace_after, args.trace_steps)
    device0 = device_seconds(sched)
    t0 = time.perf_counter()
    if profile:
        profile.enable()
    for r in reqs:
        sched.add(r)
    with on_engine_stream(sched.steps.device):  # as the server's engine thread steps
        while sched.has_work():
            sched.step()
            window.after_step()
    if profile:
        profile.disable()
    wall = time.perf_counter() - t0
    window.close()
    s = sched.stats
    clock = {
        "device": torch.cuda.get_device_name(sched.steps.device)
        if sched.steps.device.type == "cuda"
        else str(sched.steps.device),
        "backend": args.backend,
        "resolve_overlap": sched.steps.kv_cache.resolve_beside_from,
        "readback": args.readback,
        "temperature": args.temperature,
        "num_prompts": args.num_prompts,
        "seconds": wall,
        "output_tokens": s.generation_tokens - tokens0,
        "decode_steps": s.decode_steps - steps0,
        "phase_s": {k: v - base["wall"][k] for k, v in s.phase_s.items()},
        "phase_cpu_s": {k: v - base["cpu"][k] for k, v in s.phase_cpu_s.items()},
    }
    clock["admit_ms_per_request"] = 1e3 * clock["phase_s"]["admit"] / args.num_prompts
    device = device_seconds(sched)
    if device is not None and device0 is not None:
        clock["efficiency"] = (device - device0) / wall
        if clock["decode_steps"]:
            clock["device_ms_per_step"] = 1e3 * (device - device0) / clock["decode_steps"]
    if clock["decode_steps"]:  # at batch 1, the engine's share of the inter-token latency
        clock["wall_ms_per_step"] = 1e3 * wall / clock["decode_steps"]
    clock.update(window.report())
    clock["output_tok_per_s"] = clock["output_tokens"] / wall
    print(json.dumps(clock, indent=1))
    print("engine (whole run):", engine_time_summary(sched))
    if args.out:
        Path(args.out).write_text(json.dumps(clock, indent=1))
    if profile:
        profile.dump_stats(args.profile)
        with open(args.profile + ".txt", "w") as f:
            ps = pstats.Stats(profile, stream=f).sort_stats("cumulative")
            ps.print_stats(50)
            ps.sort_stats("tottime").print_stats(25)


def device_seconds(sched) -> float | None:
    """The decode steps' device time so far (CUDA events; None without graphs or off CUDA),
    every completed pair folded in first."""
    runner = sched.steps.decode_runner
    if runner is None or not runner.clock.enabled:
        return None
    torch.cuda.synchronize(sched.steps.device)  # every pair completed: poll folds them all
    runner.clock.poll()
    return runner.clock.total_seconds


class TracedWindow:
    """A torch profiler (CUDA activity; CPU when there is no GPU) over decode steps
    ``after`` .. ``after + steps`` of the run, its trace folded into a summary."""

    def __init__(self, sched, folder: str | None, after: int, steps: int) -> None:
        self.sched = sched
        self.folder = Path(folder) if folder else None
        self.start_step = sched.stats.decode_steps + after
        self.stop_step = self.start_step + steps
        self.profiler = None
        self.t0 = 0.0
        self.device0: float | None = None
        self.measured: dict = {}

    def after_step(self) -> None:
        if self.folder is None:
            return
        done = self.sched.stats.decode_steps
        if self.profiler is None and not self.measured and done >= self.start_step:
            import torch.profiler as tp

            cuda = self.sched.steps.device.type == "cuda"
            activity = tp.ProfilerActivity.CUDA if cuda else tp.ProfilerActivity.CPU
            self.profiler = tp.profile(activities=[activity])
            self.device0 = device_seconds(self.sched)
            self.steps0 = done
            self.t0 = time.perf_counter()
            self.profiler.__enter__()
        elif self.profiler is not None and done >= self.stop_step:
            self.close()

    def close(self) -> None:
        if self.profiler is None:
            return
        wall = time.perf_counter() - self.t0
        self.profiler.__exit__(None, None, None)
        steps = self.sched.stats.decode_steps - self.steps0
        device = device_seconds(self.sched)
        self.measured = {"seconds": wall, "decode_steps": steps}
        if device is not None and self.device0 is not None:
            self.measured["efficiency"] = (device - self.device0) / wall
        self.folder.mkdir(parents=True, exist_ok=True)
        trace = self.folder / "trace.json"
        self.profiler.export_chrome_trace(str(trace))
        self.profiler = None
        ops, calls = load_chrome_trace(trace)
        if ops:  # a CPU run has no device operations to fold
            summary = summarize(ops, calls)
            (self.folder / "timeline.json").write_text(json.dumps(summary, indent=1))
            self.measured["timeline"] = summary

    def report(self) -> dict:
        return {"traced_window": self.measured} if self.measured else {}


if __name__ == "__main__":
    main()
