"""The decode node's engine without HTTP: where its host time goes, admission included.

Why: through the HTTP server, both backends lost about 0.1 s of batch progress per admitted
100K-token request; the engine clock put it in the ``admit`` phase. This probe builds the
same engine the server builds (``build_serving`` with the sweep's flags), submits N
prompts at once and steps the scheduler to the end on this thread, with no HTTP threads
beside it. It prints the engine clock (wall and CPU per phase) and, with ``--profile``,
the functions that took the admission time. Admission costing the same here as through
HTTP means its own work; much less means another thread (the GIL) took it.

    python benchmark/decode_node_probe.py --model DIR --backend echo [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmark.study

from benchmark.study import loader
from sglang_echo.config import EchoConfig
from sglang_echo.runtime.engine_loop import engine_time_summary
from sglang_echo.runtime.host_threads import limit_host_threads
from sglang_echo.runtime.request import SamplingParams, ServeRequest
from sglang_echo.runtime.server_args import ServerArgs
from sglang_echo.runtime.serving import build_serving


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
    ap.add_argument("--context", type=int, default=110592)
    ap.add_argument("--pool", type=int, default=None, help="max total tokens (default: sweep's)")
    ap.add_argument("--dev-cache", type=int, default=260000)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--profile", default=None, help="write a cProfile of the run here (.txt too)")
    ap.add_argument("--out", default=None, help="write the clock as JSON here")
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
    serving = build_serving(sargs, echo=EchoConfig(offload=echo, dev_cache_size=args.dev_cache))
    limit_host_threads(serving.scheduler.steps.device)  # as the server's engine does
    sched = serving.scheduler
    vocab = serving.info["vocab_size"]
    rng = random.Random(0)

    def request(i: int, n: int) -> ServeRequest:
        ids = [rng.randrange(3, vocab) for _ in range(n)]
        params = SamplingParams(max_new_tokens=args.output_len, ignore_eos=True)
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
    t0 = time.perf_counter()
    if profile:
        profile.enable()
    for r in reqs:
        sched.add(r)
    while sched.has_work():
        sched.step()
    if profile:
        profile.disable()
    wall = time.perf_counter() - t0
    s = sched.stats
    clock = {
        "backend": args.backend,
        "num_prompts": args.num_prompts,
        "seconds": wall,
        "output_tokens": s.generation_tokens - tokens0,
        "decode_steps": s.decode_steps - steps0,
        "phase_s": {k: v - base["wall"][k] for k, v in s.phase_s.items()},
        "phase_cpu_s": {k: v - base["cpu"][k] for k, v in s.phase_cpu_s.items()},
    }
    clock["admit_ms_per_request"] = 1e3 * clock["phase_s"]["admit"] / args.num_prompts
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


if __name__ == "__main__":
    main()
