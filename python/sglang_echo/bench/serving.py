"""``python -m sglang_echo.bench_serving``: a serving benchmark in SGLang's shape.

Sends a workload to a server's ``/generate`` (SGLang's streaming protocol) with Poisson
arrivals at ``--request-rate`` (``inf`` = all at once), measures TTFT, ITL, TPOT and E2E
latency per request, prints a summary and appends one JSON line per run to
``--output-file`` with SGLang bench_serving's field names, so the same plots read both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from pathlib import Path

import aiohttp

from sglang_echo.bench import datasets as ds
from sglang_echo.bench.client import RequestResult, encode_payload, send_generate
from sglang_echo.bench.counter_poll import CounterPoll, counter_series, steady_fields
from sglang_echo.bench.metrics import summarize
from sglang_echo.bench.server_counters import engine_counters, served_fields

DEFAULT_CONTEXT = 131072


def input_range(text: str) -> tuple[int, int]:
    """``LO,HI`` prompt lengths in tokens (argparse type: a bad value is a usage error)."""
    try:
        lo, hi = (int(v.replace("_", "")) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO,HI token counts, got {text!r}") from None
    if not 0 < lo <= hi:
        raise argparse.ArgumentTypeError(f"expected 0 < LO <= HI, got {lo},{hi}")
    return lo, hi


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sglang_echo.bench_serving",
        description="Benchmark a server's online serving throughput and latency "
        "(SGLang /generate streaming protocol).",
    )
    p.add_argument("--backend", default="sglang", choices=["sglang"])
    p.add_argument("--base-url", default=None, help="e.g. http://127.0.0.1:30000")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--model", default=None, help="model path (for its tokenizer)")
    p.add_argument("--tokenizer", default=None, help="folder with tokenizer.json")
    p.add_argument(
        "--dataset-name",
        default="sharegpt",
        choices=["infinitebench", "sharegpt", "random", "custom"],
    )
    p.add_argument(
        "--dataset-path",
        default="",
        help="dataset file or folder; empty = a clearly labelled synthetic workload",
    )
    p.add_argument("--infinitebench-task", default=None, help="task file stem, e.g. kv_retrieval")
    p.add_argument(
        "--infinitebench-input-range",
        type=input_range,
        default=None,
        metavar="LO,HI",
        help="the synthetic InfiniteBench-like workload's prompt lengths in tokens (default "
        f"{ds.INFINITEBENCH_INPUT_RANGE[0]},{ds.INFINITEBENCH_INPUT_RANGE[1]}, "
        "InfiniteBench's); only without --dataset-path",
    )
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument(
        "--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf"
    )
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--warmup-requests", type=int, default=1)
    p.add_argument("--sort-len", action="store_true", help="send prompts shortest first")
    p.add_argument("--output-file", default=None, help="append one JSON line per run")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=1024)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument(
        "--max-output-len", type=int, default=256, help="cap on InfiniteBench outputs (256)"
    )
    p.add_argument(
        "--context-length",
        type=int,
        default=None,
        help="scale synthetic inputs to this context (default: ask the server)",
    )
    p.add_argument("--disable-ignore-eos", action="store_true")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument(
        "--poll-counters-s",
        type=float,
        default=0.0,
        help="sample the server's counters every S seconds during the run, for the steady_* "
        "fields (hit rate, mean batch, efficiency over the steady window; 0: off, default)",
    )
    p.add_argument("--request-timeout", type=float, default=6 * 3600)
    return p


async def _get_json(session: aiohttp.ClientSession, url: str) -> dict | None:
    try:
        async with session.get(url) as resp:
            if resp.status == 200:
                data = await resp.json(content_type=None)
                return data if isinstance(data, dict) else None
    except (aiohttp.ClientError, ValueError, TimeoutError):
        return None
    return None


# The engine's own counters (this project's /metrics; absent on SGLang), by sample name
# without ``sglang:`` and ``_total``; a ``phase``, ``part`` or ``state`` label is folded in
# (engine_seconds_total{phase="decode"} -> engine_seconds.decode).
def _load_tokenizer(path: str | None):
    if not path:
        return None
    file = Path(path) / "tokenizer.json"
    if not file.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(file))


def _model_config(path: str | None) -> dict:
    try:
        return json.loads((Path(path) / "config.json").read_text()) if path else {}
    except (OSError, ValueError):
        return {}


async def server_facts(session: aiohttp.ClientSession, base: str, args) -> dict:
    """Context length, vocabulary, tokenizer path: from our server, SGLang's, or files."""
    info = await _get_json(session, base + "/get_model_info")
    if info is None:
        raise SystemExit(f"error: cannot reach a server at {base} (GET /get_model_info failed)")
    server = await _get_json(session, base + "/get_server_info") or {}
    model_path = args.model or info.get("model_path")
    tok_path = args.tokenizer or info.get("tokenizer_path") or model_path
    cfg = _model_config(model_path)
    tokenizer = _load_tokenizer(tok_path)
    context = (
        args.context_length
        or info.get("context_length")
        or server.get("context_length")
        or cfg.get("max_position_embeddings")
        or DEFAULT_CONTEXT
    )
    vocab = (
        info.get("vocab_size")
        or cfg.get("vocab_size")
        or (tokenizer.get_vocab_size() if tokenizer is not None else None)
        or 32000
    )
    return {
        "info": info,
        "context": int(context),
        "vocab": int(vocab),
        "tokenizer": tokenizer,
        "kv_backend": info.get("kv_backend"),
        # how the server schedules (None from a server that does not say: SGLang's)
        "schedule": {
            "overlap": server.get("overlap_schedule"),
            "engine_process": server.get("engine_process"),
        },
    }


def build_workload(args, facts: dict) -> ds.Workload:
    counter = ds.TokenCounter(facts["tokenizer"])
    ctx, vocab, n = facts["context"], facts["vocab"], args.num_prompts
    path = Path(args.dataset_path) if args.dataset_path else None
    name = args.dataset_name
    if name == "infinitebench":
        if path is None:
            lengths = args.infinitebench_input_range or ds.INFINITEBENCH_INPUT_RANGE
            return ds.synthetic_infinitebench(
                n, ctx, args.max_output_len, vocab, args.seed, lengths
            )
        if args.infinitebench_input_range is not None:
            raise ds.DatasetError(
                "--infinitebench-input-range sets the synthetic workload's lengths; a "
                "dataset file brings its own (drop --dataset-path or the range)"
            )
        return ds.load_infinitebench(
            path, args.infinitebench_task, counter, n, ctx, args.max_output_len
        )
    if name == "sharegpt":
        if path is None:
            return ds.synthetic_sharegpt(n, ctx, vocab, args.seed)
        return ds.load_sharegpt(path, counter, n, ctx, args.seed)
    if name == "random":
        return ds.synthetic_random(
            n,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            vocab,
            args.seed,
        )
    if path is None:
        raise ds.DatasetError("--dataset-name custom needs --dataset-path (a jsonl file)")
    return ds.load_custom(path, counter, n, args.random_output_len)


async def run_requests(
    session: aiohttp.ClientSession,
    url: str,
    reqs: list[ds.BenchRequest],
    rate: float,
    max_concurrency: int | None,
    ignore_eos: bool,
    seed: int,
    progress: bool,
    poll: CounterPoll | None = None,
) -> tuple[list[RequestResult], float, list[float]]:
    """-> (results, the run's wall seconds, each request's send time in seconds from the
    start; parallel to ``reqs``). ``poll`` samples the server's counters meanwhile."""
    rng = random.Random(seed)
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(reqs), desc="requests", unit="req", file=sys.stderr)

    starts = [0.0] * len(reqs)
    bodies = [encode_payload(r, ignore_eos) for r in reqs]  # before the clock starts

    async def send(i: int, req: ds.BenchRequest) -> RequestResult:
        starts[i] = time.perf_counter() - start
        return await send_generate(session, url, req, ignore_eos, bodies[i])

    async def one(i: int, req: ds.BenchRequest) -> RequestResult:
        if gate is None:
            res = await send(i, req)
        else:
            async with gate:
                res = await send(i, req)
        if bar is not None:
            bar.update(1)
        return res

    start = time.perf_counter()
    stop = asyncio.Event()
    sampling = asyncio.create_task(poll.run(start, stop)) if poll is not None else None
    tasks = []
    for i, req in enumerate(reqs):
        if i and math.isfinite(rate) and rate > 0:
            await asyncio.sleep(rng.expovariate(rate))
        tasks.append(asyncio.create_task(one(i, req)))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    if sampling is not None:
        stop.set()
        await sampling
    if bar is not None:
        bar.close()
    return list(results), duration, starts


def print_summary(rec: dict, out=sys.stdout) -> None:
    rows = [
        ("Backend:", rec["backend"]),
        ("Dataset:", rec["dataset_name"] + (" (SYNTHETIC)" if rec["synthetic"] else "")),
        ("Traffic request rate:", rec["request_rate"]),
        ("Successful requests:", rec["completed"]),
        ("Failed requests:", rec["failed"]),
        ("Benchmark duration (s):", f"{rec['duration']:.2f}"),
        ("Total input tokens:", rec["total_input_tokens"]),
        ("Total generated tokens:", rec["total_output_tokens"]),
        ("Request throughput (req/s):", f"{rec['request_throughput']:.2f}"),
        ("Input token throughput (tok/s):", f"{rec['input_throughput']:.2f}"),
        ("Output token throughput (tok/s):", f"{rec['output_throughput']:.2f}"),
        ("Concurrency:", f"{rec['concurrency']:.2f}"),
        ("Mean E2E Latency (ms):", f"{rec['mean_e2e_latency_ms']:.2f}"),
        ("Median E2E Latency (ms):", f"{rec['median_e2e_latency_ms']:.2f}"),
        ("Mean TTFT (ms):", f"{rec['mean_ttft_ms']:.2f}"),
        ("Median TTFT (ms):", f"{rec['median_ttft_ms']:.2f}"),
        ("P99 TTFT (ms):", f"{rec['p99_ttft_ms']:.2f}"),
        ("Mean TPOT (ms):", f"{rec['mean_tpot_ms']:.2f}"),
        ("Mean ITL (ms):", f"{rec['mean_itl_ms']:.2f}"),
        ("Median ITL (ms):", f"{rec['median_itl_ms']:.2f}"),
        ("P99 ITL (ms):", f"{rec['p99_itl_ms']:.2f}"),
    ]
    if rec.get("steady_output_throughput") is not None:
        lo, hi = rec["steady_window_s"]
        rows.append(
            (
                "Steady output throughput (tok/s):",
                f"{rec['steady_output_throughput']:.2f} ({lo:.1f}-{hi:.1f} s)",
            )
        )
    engine = rec.get("server_engine")
    if engine:
        rows.append(
            (
                "Server engine counters (run):",
                # whole names: the wall and the CPU clocks share their part names
                ", ".join(f"{k} {v:.2f}" for k, v in engine.items()),
            )
        )
    if rec.get("mean_decode_batch") is not None:
        rows.append(("Mean decode batch (requests):", f"{rec['mean_decode_batch']:.2f}"))
    if rec.get("served_efficiency") is not None:
        rows.append(("Served efficiency (decode device/wall):", f"{rec['served_efficiency']:.3f}"))
    if rec.get("spec_accept_length") is not None:
        rows.append(("MTP accept length (tokens/round):", f"{rec['spec_accept_length']:.3f}"))
    if rec.get("steady_hit_rate") is not None:
        lo, hi = rec["steady_counters_window_s"]
        rows.append(
            ("ECHO hit rate (steady):", f"{rec['steady_hit_rate']:.4f} ({lo:.1f}-{hi:.1f} s)")
        )
    echo = rec.get("server_echo")
    if echo:
        rate = "n/a" if echo["hit_rate"] is None else f"{echo['hit_rate']:.4f}"
        rows.append(
            (
                "ECHO hit rate (run):",
                f"{rate} (hits {echo['hits']}, misses {echo['misses']}, "
                f"evictions {echo['evictions']}, recalled {echo['recalled_bytes']} B)",
            )
        )
    print("{:=^50}".format(" Serving Benchmark Result "), file=out)
    for k, v in rows:
        print(f"{k:<40} {v}", file=out)
    print("=" * 50, file=out, flush=True)


# uvicorn (this server's and SGLang's) closes a connection idle for UVICORN_KEEP_ALIVE_S; a
# pooled one kept longer can be reused just as the server closes it, and the request fails
# with ServerDisconnectedError (seen on the H200 after the warm-up).
# The client drops idle connections first.
UVICORN_KEEP_ALIVE_S = 5.0
CLIENT_KEEP_ALIVE_S = 2.0


def bench_connector() -> aiohttp.TCPConnector:
    """Unlimited connections, none reused after CLIENT_KEEP_ALIVE_S idle."""
    return aiohttp.TCPConnector(limit=0, keepalive_timeout=CLIENT_KEEP_ALIVE_S)


async def run(args) -> dict:
    base = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    # The server's facts in a session of their own: building a large workload (96 prompts
    # of 100K tokens) takes longer than uvicorn keeps an idle connection open, and a
    # pooled connection it closed meanwhile failed the first request (broken pipe).
    async with aiohttp.ClientSession(timeout=timeout) as probe:
        facts = await server_facts(probe, base, args)
    workload = build_workload(args, facts)
    async with aiohttp.ClientSession(timeout=timeout, connector=bench_connector()) as session:
        reqs = workload.requests
        if args.sort_len:
            reqs = sorted(reqs, key=lambda r: r.prompt_len)
        print(
            f"dataset: {workload.description}; {len(reqs)} requests, "
            f"{sum(r.prompt_len for r in reqs)} input tokens",
            file=sys.stderr,
            flush=True,
        )
        url = base + "/generate"
        ignore_eos = not args.disable_ignore_eos
        if args.warmup_requests > 0:
            warm = [
                ds.BenchRequest(r.prompt, r.prompt_len, min(r.output_len, 16), r.task)
                for r in reqs[: args.warmup_requests]
            ]
            done = await asyncio.gather(*(send_generate(session, url, r, ignore_eos) for r in warm))
            bad = [r.error for r in done if not r.success]
            if bad:
                raise SystemExit(f"error: warmup request failed: {bad[0]}")
        counters_before = await engine_counters(session, base)
        poll = None
        if args.poll_counters_s > 0:
            poll = CounterPoll(lambda: engine_counters(session, base), args.poll_counters_s)
        results, duration, starts = await run_requests(
            session,
            url,
            reqs,
            args.request_rate,
            args.max_concurrency,
            ignore_eos,
            args.seed,
            progress=not args.disable_tqdm,
            poll=poll,
        )
        counters_after = await engine_counters(session, base)
    record = {
        "backend": args.backend,
        "dataset_name": args.dataset_name,
        "dataset_path": args.dataset_path,
        "infinitebench_task": args.infinitebench_task,
        "infinitebench_input_range": args.infinitebench_input_range,
        "synthetic": workload.synthetic,
        "dataset_description": workload.description,
        "request_rate": args.request_rate,
        "max_concurrency": args.max_concurrency,
        "num_prompts": len(reqs),
        "warmup_requests": args.warmup_requests,
        "random_input_len": args.random_input_len,
        "random_output_len": args.random_output_len,
        "random_range_ratio": args.random_range_ratio,
        "kv_backend": facts["kv_backend"],
        "server_schedule": facts["schedule"],
        "server_context_length": facts["context"],
        **summarize(results, duration, starts),
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_len for r in results],
        "ttfts": [r.ttft for r in results],
        "latencies": [r.latency for r in results],
        "start_times": starts,  # each request's send, s from the run's start
        # Each request's output token ids (None where the server sent none): two engines'
        # greedy runs over the same dataset compare token for token.
        "output_ids": [r.output_ids for r in results],
        "errors": [r.error for r in results if r.error][:20],
        # The server's counters over the run (this project's server; None where absent):
        # server_engine (the engine thread's seconds by phase, decode steps, ...),
        # server_echo, mean_decode_batch, served_efficiency (see served_fields).
        **served_fields(counters_before, counters_after, duration),
    }
    record.update(steady_fields(poll, record.get("steady_window_s"), served_fields))
    record["counter_series"] = counter_series(poll, served_fields)
    return record


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.num_prompts < 1:
        print("error: --num-prompts must be >= 1", file=sys.stderr)
        return 2
    if args.request_rate <= 0:
        print("error: --request-rate must be > 0 (or inf)", file=sys.stderr)
        return 2
    try:
        record = asyncio.run(run(args))
    except ds.DatasetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print_summary(record)
    if args.output_file:
        out = Path(args.output_file)
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
    if record["failed"]:
        print(f"{record['failed']} requests failed, e.g.: {record['errors'][:3]}", file=sys.stderr)
    return 0 if record["completed"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
