"""How fast the HTTP front takes in long prompts sent all at once: the served ramp's bound.

Why: at rate inf a served ECHO batch grows only as fast as prompts reach the engine, and the
served records' counter series showed the engine taking in 100K-token prompts at about 26-33
a second on both backends. This measures the front alone: the server's real app (routes,
body reading, JSON parsing, the token-id checks, the fake transfer's seed) over a stub engine
that records when each request is submitted and ends it at once, in a process of its own,
fed by a client process that sends every body, encoded beforehand, at once. Two arms,
interleaved round by round: the bodies parsed on the front's one parser thread in turn
(``one_thread``, the server's) and on asyncio's thread pool (``pool``, before it). Both run
on the CPU; no GPU is used.

    python benchmark/ingress_probe.py --out DIR [--prompts 96] [--prompt-len 104857]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python"))

ARMS = ("one_thread", "pool")
QUANTILES = (0.0, 0.1, 0.25, 0.5, 0.75, 1.0)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument("--out", required=True, type=Path, help="folder for ingress_probe.json")
    ap.add_argument("--prompts", type=int, default=96, help="prompts sent at once (96)")
    ap.add_argument("--prompt-len", type=int, default=104857, help="tokens per prompt")
    ap.add_argument("--rounds", type=int, default=2, help="rounds, each arm once per round")
    ap.add_argument("--commit", default="", help="the sha the run was made on, literally")
    ap.add_argument("--command", default="", help="the command that made the run")
    ap.add_argument("--serve", choices=ARMS, help=argparse.SUPPRESS)  # the server process
    ap.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    return ap


class StubEngine:
    """What the app needs of an engine: submissions are timed and end at once."""

    def __init__(self) -> None:
        self.submitted: list[float] = []
        self.alive = True
        self.fatal_error = None

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def abort(self, rid: str) -> None:
        pass

    def submit(self, req) -> None:
        from sglang_echo.runtime.request import OutputEvent

        self.submitted.append(time.monotonic())
        done = {"type": "length", "length": 1}
        req.on_output(OutputEvent(req.rid, (1,), len(req.prompt), 1, finish_reason=done))


def serve(arm: str, model: Path, prompt_len: int, prompts: int) -> None:
    """The server process: prints its URL, then, once ``prompts`` requests were submitted,
    their submission times (monotonic seconds) as one JSON line; stops when its stdin
    closes."""
    import threading

    import uvicorn

    import sglang_echo.runtime.api.core as core
    from sglang_echo.config import EchoConfig
    from sglang_echo.runtime.server import create_app
    from sglang_echo.runtime.server_args import ServerArgs
    from sglang_echo.runtime.serving import build_serving

    if arm == "pool":  # a pool of asyncio's default size, as asyncio.to_thread used
        pool = core.ThreadPoolExecutor
        core.ThreadPoolExecutor = lambda *a, **k: pool(thread_name_prefix="echo-parse-pool")
    args = ServerArgs(
        model_path=str(model), device="cpu", dtype="float32",
        context_length=prompt_len + 64, max_total_tokens=prompt_len + 64,
    )  # fmt: skip
    engine = StubEngine()
    app = create_app(build_serving(args, echo=EchoConfig()), engine)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning")
    server = uvicorn.Server(config)
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    print(f"http://127.0.0.1:{port}", flush=True)
    while len(engine.submitted) < prompts:
        time.sleep(0.01)
    print(json.dumps(engine.submitted), flush=True)
    sys.stdin.read()  # until the client closes it: its last responses may still be streaming
    server.should_exit = True


async def send_all(url: str, bodies: list[bytes]) -> float:
    """Every body at once; returns the monotonic time just before the first send."""
    import aiohttp

    from sglang_echo.bench.client import JSON_HEADERS

    async with aiohttp.ClientSession() as session:

        async def one(body: bytes) -> None:
            async with session.post(url + "/generate", data=body, headers=JSON_HEADERS) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:300]}")

        start = time.monotonic()
        await asyncio.gather(*(one(b) for b in bodies))
        return start


def one_round(arm: str, model: Path, bodies: list[bytes], prompt_len: int) -> list[float]:
    """Seconds from the first send to each submission, sorted."""
    cmd = [sys.executable, __file__, "--out", "-", "--serve", arm, "--model", str(model),
           "--prompt-len", str(prompt_len), "--prompts", str(len(bodies))]  # fmt: skip
    with subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as proc:
        url = proc.stdout.readline().strip()
        if not url.startswith("http"):
            raise RuntimeError(f"the {arm} server did not start (printed {url!r})")
        start = asyncio.run(send_all(url, bodies))
        times = json.loads(proc.stdout.readline())
        proc.stdin.close()  # every response read: the server may stop
        proc.wait(60)
    return sorted(t - start for t in times)


def make_model(folder: Path, prompt_len: int) -> Path:
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_tiny_checkpoint.py"), "--out", str(folder),
         "--max-position", str(prompt_len + 64), "--vocab-size", "32000"],
        check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    return folder


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> dict | None:
    args = build_parser().parse_args(argv)
    if args.serve:
        serve(args.serve, args.model, args.prompt_len, args.prompts)
        return None
    if args.prompts < 2 or args.prompt_len < 1 or args.rounds < 1:
        raise SystemExit("error: give --prompts >= 2, --prompt-len >= 1 and --rounds >= 1")
    from sglang_echo.bench.client import encode_payload
    from sglang_echo.bench.datasets import BenchRequest

    rng = random.Random(0)
    reqs = [
        BenchRequest([rng.randrange(32000) for _ in range(args.prompt_len)], args.prompt_len, 1)
        for _ in range(args.prompts)
    ]
    bodies = [encode_payload(r, True) for r in reqs]
    runs: dict[str, list[list[float]]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp) / "model", args.prompt_len)
        for r in range(args.rounds):
            for arm in ARMS:
                runs[arm].append(one_round(arm, model, bodies, args.prompt_len))
                print(f"round {r + 1} {arm}: all in {runs[arm][-1][-1]:.2f} s", file=sys.stderr)
    n = args.prompts

    def at(times: list[float], q: float) -> float:
        return times[round(q * (n - 1))]

    # Rounded once, after the median: medians of values rounded first could put the half
    # after the whole (seen in a test run, at 3 prompts of milliseconds each).
    metrics = {
        arm: {
            "seconds_at_quantile": {
                str(q): [round(at(t, q), 3) for t in runs[arm]] for q in QUANTILES
            },
            "all_in_s_median": round(statistics.median(t[-1] for t in runs[arm]), 3),
            "half_in_s_median": round(statistics.median(at(t, 0.5) for t in runs[arm]), 3),
            "prompts_per_s_median": round(n / statistics.median(t[-1] for t in runs[arm]), 1),
        }
        for arm in ARMS
    }
    record = {
        "name": "ingress_probe",
        "commit": args.commit,
        "command": args.command or " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "device": f"cpu: {cpu_model()}, {os.cpu_count()} cores",
        "date": time.strftime("%Y-%m-%d"),
        "config": {"prompts": n, "prompt_len": args.prompt_len, "rounds": args.rounds},
        "metrics": metrics,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ingress_probe.json").write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(metrics, indent=1))
    return record


if __name__ == "__main__":
    main()
