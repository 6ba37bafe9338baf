"""Which host-side events invalidate a CUDA-graph capture on this machine (GPU only).

Why: a decode-graph capture failed in 1 of 3 runs of the lossless graph test on the H200,
depending on what had run earlier in the same process (cudaErrorStreamCaptureInvalidated
from a Triton launch). Candidates are things a capture can meet that it did not cause: the
garbage collector freeing an earlier engine's pinned host memory or CUDA graph, a Triton
kernel compiled and loaded inside the capture, a pinned allocation or an event query (in
this thread or another one), under PyTorch's default capture mode ("global") and under
"thread_local" (what runtime/cuda_graph.py captures with). Each case captures a tiny graph
around the event and reports whether the capture (and a replay) worked. Prints one line per
case and writes --out as JSON.

    python3 benchmark/capture_probe.py --out /tmp/capture_probe.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import threading
import time
from collections.abc import Callable

import torch
import triton
import triton.language as tl


@triton.jit
def _add_kernel(x_ptr, n, VALUE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) + VALUE, mask=mask)


def _garbage(obj: object) -> None:
    """Leave ``obj`` in a reference cycle, for the collector."""
    holder: list = [obj]
    holder.append(holder)


def attempt(body: Callable[[], None], mode: str) -> str:
    """Capture [add, body, add] on a side stream; "ok" if capture and replay work."""
    x = torch.zeros(4096, device="cuda")
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, capture_error_mode=mode):
            x.add_(1)
            body()
            x.add_(1)
        graph.replay()
        torch.cuda.synchronize()
        return "ok" if int(x[0]) == 2 else f"wrong result {float(x[0])}"
    except Exception as exc:  # the point: which ones raise
        with contextlib.suppress(Exception):
            torch.cuda.synchronize()
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"


def cases() -> dict[str, tuple[Callable[[], None], Callable[[], None]]]:
    """name -> (set-up before the capture, body inside it)."""
    state: dict = {}

    def pinned_garbage() -> None:
        _garbage(torch.zeros(1 << 22, pin_memory=True))

    def pinned_used_garbage() -> None:
        pinned = torch.zeros(1 << 22, pin_memory=True)
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.empty(1 << 22, device="cuda").copy_(pinned, non_blocking=True)
        _garbage(pinned)

    def graph_garbage() -> None:
        y = torch.zeros(16, device="cuda")
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y.add_(1)
        _garbage(g)

    def event_setup() -> None:
        side = torch.cuda.Stream()
        ev = torch.cuda.Event()
        with torch.cuda.stream(side):
            torch.zeros(16, device="cuda").add_(1)
            ev.record(side)
        state["event"] = ev

    def thread_pinned() -> None:
        done = threading.Event()

        def work() -> None:
            torch.zeros(1 << 20, pin_memory=True)
            done.set()

        threading.Thread(target=work).start()
        done.wait(10)

    def triton_cold() -> None:
        x = torch.zeros(1024, device="cuda")
        state["n"] = state.get("n", 0) + 1
        _add_kernel[(1,)](x, 1024, VALUE=state["n"] + 100, BLOCK=1024)  # a new specialization

    def nothing() -> None:
        return None

    return {
        "baseline (nothing)": (nothing, nothing),
        "gc frees pinned host memory": (pinned_garbage, gc.collect),
        "gc frees pinned memory used by an async copy": (pinned_used_garbage, gc.collect),
        "gc frees an earlier CUDA graph": (graph_garbage, gc.collect),
        "pinned allocation in this thread": (
            nothing,
            lambda: torch.zeros(1 << 20, pin_memory=True),
        ),
        "pinned allocation in another thread": (nothing, thread_pinned),
        "event query (event of another stream)": (event_setup, lambda: state["event"].query()),
        "Triton kernel compiled and loaded inside": (nothing, triton_cold),
        "empty_cache inside": (nothing, torch.cuda.empty_cache),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default="capture_probe.json")
    args = ap.parse_args(argv)
    torch.zeros(1, device="cuda")
    results: dict[str, dict[str, str]] = {}
    for name, (setup, body) in cases().items():
        results[name] = {}
        for mode in ("global", "thread_local"):
            gc.collect()
            setup()
            results[name][mode] = attempt(body, mode)
            print(f"{name:<48} {mode:<13} {results[name][mode]}", flush=True)
    record = {
        "name": "capture_probe",
        "command": " ".join(["python3", "benchmark/capture_probe.py", *(argv or sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "results": results,
    }
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    return record


if __name__ == "__main__":
    main()
