"""Launches per decode-node arrival, on the engine thread and on the transfer's writer.

Why: the served benchmark measured admission at ~3.6 ms of engine-thread time per
100K-token request (goal 2) while the GPU work it queues takes far less; the writer thread
that makes the arriving prompt's KV holds the GIL between its launches, so its launch
count is engine-thread latency too. This counts, on the CPU, the ops that would launch
work on a GPU (views and allocations excluded) for one arrival through the real serving
stack (``build_serving``, fake transfer, ECHO), on the study's worker at its smoke size
with the layer counts given. A count, not a time: the device session measures the time.

    python benchmark/arrival_launches.py --layers 8 61
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torch.utils._python_dispatch import TorchDispatchMode

from benchmark.study import loader
from benchmark.study.worker_spec import write_spec
from sglang_echo.config import EchoConfig
from sglang_echo.runtime.request import SamplingParams, ServeRequest
from sglang_echo.runtime.server_args import ServerArgs
from sglang_echo.runtime.serving import build_serving

NO_LAUNCH = frozenset(
    [
        "select", "slice", "view", "expand", "alias", "detach", "unsqueeze", "squeeze",
        "reshape", "_unsafe_view", "as_strided", "t", "transpose", "lift_fresh", "empty",
        "resize_", "permute", "split", "unbind",
    ]
)  # fmt: skip


class Launches(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in NO_LAUNCH:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def arrival_launches(layers: int, prompt_len: int) -> dict:
    """One arrival's launches: {"engine_thread": n, "writer": n, "writer_top": {...}}."""
    folder = Path(tempfile.mkdtemp(prefix="arrival_launches_"))
    write_spec(folder, layers=layers, size="smoke")
    sargs = ServerArgs(
        model_path=str(folder),
        device="cpu",
        context_length=2 * prompt_len,
        max_total_tokens=6 * prompt_len,
        disaggregation_mode="decode",
        disaggregation_transfer_backend="fake",
        model_loader=loader.SPEC,
        model_loader_args="--fake-kv-locality 0.9",
    )
    sched = build_serving(sargs, echo=EchoConfig(offload=True, dev_cache_size=4000)).scheduler
    transfer = sched.prompt_source
    writer = Launches()
    write = transfer._write  # on the CPU the writes run inline: counted apart

    def counted_write(*a, **k):
        with writer:
            write(*a, **k)

    transfer._write = counted_write
    rng = random.Random(0)

    def run_one(rid: str) -> None:
        ids = [rng.randrange(3, 4000) for _ in range(prompt_len)]
        params = SamplingParams(max_new_tokens=2, ignore_eos=True)
        sched.add(ServeRequest(rid=rid, prompt=ids, params=params))
        while sched.has_work():
            sched.step()

    run_one("warm-up")
    writer.ops.clear()
    admit, whole = sched.admission.admit, Launches()

    def counted_admit() -> None:
        with whole:
            admit()

    sched.admission.admit = counted_admit
    run_one("measured")
    engine = whole.ops - writer.ops
    return {
        "layers": layers,
        "prompt_len": prompt_len,
        "engine_thread": sum(engine.values()),
        "writer": sum(writer.ops.values()),
        "writer_top": dict(writer.ops.most_common(8)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[8, 61])
    ap.add_argument("--prompt-len", type=int, default=10000)
    args = ap.parse_args()
    for layers in args.layers:
        print(json.dumps(arrival_launches(layers, args.prompt_len)))


if __name__ == "__main__":
    main()
