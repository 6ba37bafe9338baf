"""MTP speculative decoding on the study's decode node: rounds against plain decode steps,
ECHO against no-offload, at DeepSeek-V3.2's per-layer dimensions (issue 52's targets).

    PYTHONUNBUFFERED=1 python3 benchmark/mtp_study.py --out DIR     # the H200 run
    python benchmark/mtp_study.py --smoke --out DIR                 # tiny, on the CPU

The model is the study's random worker (benchmark/study/worker.py) with one NextN layer of
the same dimensions (its FFN the same one-DP-worker MoE share). A random draft is never
right, so acceptance is forced: each round accepts each draft with probability
``--accept-rate`` until the first rejection, by a coin seeded with (request, output
length), so both backends take the same decisions and commit the same tokens (the
accepted drafts, then the target's own choice); the committed tokens are meaningless, the
speed is the point. Prompts arrive as on the study's decode node (synthetic KV, also in the
draft's one-layer pool), and every step replays a CUDA graph on a GPU.

Phases, each measured ``--repeats`` times, interleaved (plain decode, rounds; no-offload,
ECHO), medians with their spread:
- ``batch1``: one request of the study's prompt length on each backend, tokens/s of
  plain decode steps and of rounds (``S = --spec-num-steps``): the speed-up of MTP (goal
  >= 1.6x for ECHO at S = 1, p = 0.85); the verify step's time beside the plain step's;
  committed tokens of ECHO equal to no-offload's.
- ``paper``: each backend at its capacity of the study's paper setting (no-offload: its
  pool over the context; ECHO: N_G // (Q x top-k) and its host pool), rounds only:
  ECHO / no-offload tokens/s with MTP (goal >= 3.3x).
Tokens/s are committed tokens over the device time between CUDA events around each step
or round (a round's host work between its steps included, as it is a real cost there);
on the CPU, wall time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmark.mtp_bound import batch1_bound
from benchmark.study.decode_node import DecodeNode, NodeRequest
from benchmark.study.moe import LocalRoutedMoE
from benchmark.study.worker import build_worker, study_config
from benchmark.study.worker_spec import SIZES
from sglang_echo.config import EchoConfig
from sglang_echo.model.kv_cache import PlainKVCache
from sglang_echo.model.nextn import NextNLayer
from sglang_echo.runtime.kv_factory import echo_cache_for_model
from sglang_echo.runtime.speculative import SpecLane, SpecRounds
from sglang_echo.runtime.step_runner import StepRunner
from sglang_echo.runtime.synthetic_kv import Locality, SyntheticKV

# (paper setting) no-offload pool, ECHO's N_G and host pool, prompt lengths: the study's.
GPU_SIZES = dict(pool=380_000, dev_cache=260_000, host=1_800_000, prompt=(100_000, 110_000))
SMOKE_SIZES = dict(pool=1_200, dev_cache=256, host=4_000, prompt=(300, 340))


class ForcedRounds(SpecRounds):
    """Rounds whose acceptance is a seeded coin: each draft accepted with probability
    ``rate`` until the first rejection, the coin seeded by (request seed, output length)."""

    rate = 0.85

    def accepted_drafts(self, lane: SpecLane, drafts: list[int], best: list[int]) -> int:
        coin = random.Random(lane.seq.seed * 1_000_003 + len(lane.seq.output))
        k = 0
        while k < len(drafts) and coin.random() < self.rate:
            k += 1
        return k


def build_models(args, device: torch.device, dtype: torch.dtype):
    """(target worker, its NextN layer, favoured directions): random, deterministic."""
    dims, moe = SIZES["smoke" if args.smoke else "dsv32"]
    cfg = study_config(dims, args.layers, 4096, 131_072, "fp8_hadamard")
    # One NextN layer, its placeholder FFN dense (replaced below by the MoE share).
    cfg = dataclasses.replace(
        cfg, num_nextn_predict_layers=1, first_k_dense_replace=args.layers + 1
    )
    target, directions = build_worker(cfg, moe, dtype, device)
    torch.manual_seed(99)
    with device:
        draft = NextNLayer(cfg)
    draft = draft.to(dtype)
    draft.mlp = LocalRoutedMoE(cfg.hidden_size, seed=999, device=device, dtype=dtype, **moe)
    return target, draft.eval(), directions


class Backend:
    """One engine: its KV cache, runner and (lazily) its rounds."""

    def __init__(self, name: str, args, target, draft, directions, batch: int, sizes: dict):
        self.name = name
        cfg, device = target.config, target.lm_head.weight.device
        dtype = target.lm_head.weight.dtype
        q, topk = args.spec_num_steps + 1, cfg.index_topk
        context = sizes["prompt"][1] + args.new_tokens + q + 8
        if name == "no-offload":
            self.kv = PlainKVCache.for_model(cfg, sizes["pool"], dtype, device)
            tokens = sizes["pool"]
        else:
            echo = EchoConfig(offload=True, dev_cache_size=sizes["dev_cache"])
            echo.check_verify_batch(batch, topk, q, batch_flag="batch")
            self.kv = echo_cache_for_model(echo, cfg, sizes["host"], dtype, device)
            tokens = sizes["host"]
        self.runner = StepRunner(
            target, self.kv, tokens, max_requests=batch, max_context=context,
            use_cuda_graph=device.type == "cuda",
        )  # fmt: skip
        self.synth = SyntheticKV(cfg, directions, Locality(0.9), dtype, device)
        self.rounds = ForcedRounds(
            target, draft, self.runner, args.spec_num_steps, tokens,
            graphs=device.type == "cuda",
        )  # fmt: skip
        self.rounds.rate = args.accept_rate
        draft_dirs = directions[:1]
        self.draft_synth = SyntheticKV(draft.config, draft_dirs, Locality(0.0), dtype, device)
        self.node = DecodeNode(self.runner, self.synth, cfg.vocab_size)
        self.hidden = cfg.hidden_size
        self.dtype = dtype


def _clock(device: torch.device):
    """(start, stop) -> seconds: CUDA events on a GPU, the wall clock elsewhere."""
    if device.type != "cuda":
        t = {}
        return (lambda: t.__setitem__(0, time.perf_counter())), (lambda: time.perf_counter() - t[0])
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def stop() -> float:
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    return start.record, stop


def admit(b: Backend, n: int, sizes: dict, args, seed0: int) -> list[NodeRequest]:
    """``n`` requests on ``b``'s node, each with its draft pool rows and draft carry."""
    rng = random.Random(seed0)
    reqs = []
    for i in range(n):
        length = rng.randint(*sizes["prompt"])
        # the draft tail: S positions a round may hold past the committed ones
        req = b.node.admit(length, seed=seed0 * 1000 + i, max_new_tokens=args.new_tokens + 8)
        locs = torch.tensor(req.locs, dtype=torch.int64, device=b.runner.device)
        b.draft_synth.write(b.rounds.draft_cache, locs, req.seed)
        reqs.append(req)
    return reqs


def lanes_of(b: Backend, reqs: list[NodeRequest]) -> list[SpecLane]:
    gen = torch.Generator(device=b.runner.device).manual_seed(7)
    lanes = []
    for r in reqs:
        h = torch.randn(b.hidden, generator=gen, device=b.runner.device).to(b.dtype)
        lanes.append(SpecLane(r, draft_token=r.output[-1], draft_hidden=h))
    return lanes


def plain_phase(b: Backend, n: int, sizes, args, seed: int) -> dict:
    """Plain decode steps of ``n`` requests: tokens/s, the step time, committed tokens."""
    reqs = admit(b, n, sizes, args, seed)
    device = b.runner.device
    times = []
    for step in range(args.warmup + args.steps):
        start, stop = _clock(device)
        start()
        b.node.step()
        took = stop()
        if step >= args.warmup:
            times.append(took)
    out = [list(r.output) for r in reqs]
    b.node.release_all()
    step_s = statistics.median(times)
    return {"tokens_per_s": n / step_s, "step_ms": step_s * 1e3, "outputs": out}


def spec_phase(b: Backend, n: int, sizes, args, seed: int) -> dict:
    """Rounds of ``n`` requests: committed tokens/s, round and verify times, tokens."""
    reqs = admit(b, n, sizes, args, seed)
    lanes = lanes_of(b, reqs)
    device = b.runner.device
    rounds, verify_s, committed = [], [], []
    for i in range(args.warmup + args.steps):
        start, stop = _clock(device)
        verify_start, verify_stop = _clock(device)

        def drafter(ls: list[SpecLane], begin=verify_start) -> list[list[int]]:
            drafts = b.rounds.draft(ls)
            begin()  # the verify: from after the drafts to after its accept read
            return drafts

        start()
        v = b.rounds.verify(lanes, drafter)
        verified = verify_stop()
        for lane, window in zip(lanes, v.accepted, strict=True):
            lane.seq.output.extend(window)
        b.rounds.extend_drafts(v, [True] * len(lanes))
        took = stop()
        if i >= args.warmup:
            rounds.append(took)
            verify_s.append(verified)
            committed.append(sum(len(w) for w in v.accepted))
    out = [list(r.output) for r in reqs]
    b.node.release_all()
    round_s = statistics.median(rounds)
    per_round = statistics.fmean(committed)
    return {
        "tokens_per_s": per_round / round_s,
        "round_ms": round_s * 1e3,
        "verify_ms": statistics.median(verify_s) * 1e3,
        "tokens_per_round": per_round,
        "outputs": out,
    }


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument("--out", required=True, help="folder for mtp_study.json")
    ap.add_argument("--smoke", action="store_true", help="tiny configuration on the CPU")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--spec-num-steps", type=int, default=1, help="S draft tokens per round")
    ap.add_argument("--accept-rate", type=float, default=0.85, help="p, per draft")
    ap.add_argument("--warmup", type=int, default=4, help="steps or rounds before measuring")
    ap.add_argument("--steps", type=int, default=16, help="measured steps or rounds")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--phases", default="batch1,paper", help="batch1, paper, or both")
    ap.add_argument("--commit", default="", help="the code's commit, given literally")
    ap.add_argument("--command", default="", help="the command recorded")
    args = ap.parse_args(argv)
    if not 0.0 <= args.accept_rate <= 1.0:
        ap.error(f"--accept-rate must be in [0, 1], got {args.accept_rate}")
    if not 1 <= args.spec_num_steps <= 3:
        ap.error(f"--spec-num-steps must be 1 to 3, got {args.spec_num_steps}")
    args.new_tokens = (args.warmup + args.steps) * (args.spec_num_steps + 1)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sizes = SMOKE_SIZES if args.smoke else GPU_SIZES
    target, draft, directions = build_models(args, device, dtype)
    topk, q = target.config.index_topk, args.spec_num_steps + 1
    record = {
        "name": "mtp_study",
        "commit": args.commit,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "date": time.strftime("%Y-%m-%d"),
        "command": args.command or " ".join(["python", *sys.argv]),
        "config": {
            "layers": args.layers,
            "spec_num_steps": args.spec_num_steps,
            "accept_rate": args.accept_rate,
            "sizes": sizes,
            "smoke": args.smoke,
            "steps": args.steps,
            "warmup": args.warmup,
            "repeats": args.repeats,
        },
        "phases": {},
        "metrics": {},
    }
    phases = set(args.phases.split(","))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        (out / "mtp_study.json").write_text(json.dumps(record, indent=1) + "\n")

    if "batch1" in phases:
        runs: dict[str, list[dict]] = {"no-offload": [], "echo": []}
        backends = {n: Backend(n, args, target, draft, directions, 1, sizes) for n in runs}
        for rep in range(args.repeats):
            for name, b in backends.items():
                plain = plain_phase(b, 1, sizes, args, seed=rep)
                spec = spec_phase(b, 1, sizes, args, seed=rep)
                runs[name].append({"plain": plain, "spec": spec})
                print(f"[mtp] batch1 {name} #{rep}: plain {plain['tokens_per_s']:.1f} tok/s, "
                      f"rounds {spec['tokens_per_s']:.1f} tok/s "
                      f"({spec['tokens_per_round']:.2f} tokens/round)", flush=True)  # fmt: skip
        record["phases"]["batch1"] = {
            n: [{k: {x: y for x, y in v.items() if x != "outputs"} for k, v in r.items()}
                for r in rs]
            for n, rs in runs.items()
        }  # fmt: skip
        for name, rs in runs.items():
            key = "echo" if name == "echo" else "no_offload"
            speedups = [r["spec"]["tokens_per_s"] / r["plain"]["tokens_per_s"] for r in rs]
            verify = [r["spec"]["verify_ms"] / r["plain"]["step_ms"] for r in rs]
            record["metrics"][f"mtp_speedup_batch1_{key}"] = spread(speedups)
            record["metrics"][f"verify_over_decode_step_{key}"] = spread(verify)
        # The round taken apart and the speed-up each part allows (benchmark/mtp_bound.py).
        record["metrics"]["bound_batch1"] = batch1_bound(record["phases"]["batch1"], args.layers)
        record["metrics"]["outputs_equal_batch1"] = all(
            a[k]["outputs"] == b[k]["outputs"]
            for a, b in zip(runs["no-offload"], runs["echo"], strict=True)
            for k in ("plain", "spec")
        )
        del backends
        save()
    if "paper" in phases:
        cap = {
            "no-offload": max(1, sizes["pool"] // (sizes["prompt"][1] + args.new_tokens + q + 8)),
            "echo": min(
                sizes["dev_cache"] // (q * topk),
                sizes["host"] // (sizes["prompt"][1] + args.new_tokens + q + 8),
            ),
        }
        runs = {n: [] for n in cap}
        backends = {n: Backend(n, args, target, draft, directions, cap[n], sizes) for n in cap}
        for rep in range(args.repeats):
            for name, b in backends.items():
                spec = spec_phase(b, cap[name], sizes, args, seed=100 + rep)
                spec.pop("outputs")
                runs[name].append(spec)
                print(f"[mtp] paper {name} #{rep}: batch {cap[name]}, "
                      f"{spec['tokens_per_s']:.1f} tok/s", flush=True)  # fmt: skip
        record["phases"]["paper"] = {"batch": cap, "runs": runs}
        ratios = [
            e["tokens_per_s"] / n["tokens_per_s"]
            for e, n in zip(runs["echo"], runs["no-offload"], strict=True)
        ]
        record["metrics"]["echo_over_no_offload_mtp_paper"] = spread(ratios)
        save()
    print(json.dumps(record["metrics"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
