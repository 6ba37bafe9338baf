"""Decode steps captured in CUDA graphs, one graph per (batch size, decode-prefetch mode).

Batch sizes up to ``max_batch_size`` (SGLang's ``--cuda-graph-max-bs``) get a graph each;
larger batches run eagerly. There is no padding to a bucket: a padded lane would write KV
rows and, under ECHO, take device slots.

A server captures every shape it will use at start-up (``capture_all``), before it says
it is ready, as SGLang does: a capture in the middle of a measured run costs that run a
capture's time, and a capture that fails there fails the requests of its step. Each shape
is first run eagerly on a dummy batch (every lane the padding sink: location 0, position
0), which compiles and loads every Triton specialization the step launches, since loading
a module inside a capture can invalidate it; then it is captured. The dummy steps move
the KV backend's small state (ECHO's clocks, counters, the sink's stamps), so the backend's
state is checkpointed before and restored after (``kv_state``): after start-up the cache is
as a fresh one. Graphs share one memory pool and are captured largest first, so the
smaller ones reuse the larger ones' memory. A shape not captured at start-up (the offline
engine and the e2e study capture lazily) is captured at its first step, after that step
ran eagerly as a real step.

A capture can fail (an invalidated capture has been seen on the H200 when other work ran
in the same process before). Capture then never takes a request with it: the failure is
logged as a warning, the backend's half-recorded step is abandoned, and that shape runs
eagerly from then on. Python's garbage collector is held off during a capture (a
collection can free CUDA memory or pinned host memory of an earlier engine, calls that
are illegal during a capture), and the capture's error mode is the capturing thread's own,
so another thread's legal work (an HTTP thread's tensors) cannot invalidate it.

Each replayed or eager decode step is timed on the device by a pair of CUDA events; the
times are collected without waiting (``DeviceStepClock``) and exported at ``/metrics``.
"""

from __future__ import annotations

import gc
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch

from sglang_echo.model.deepseek_v32 import DeepseekV32ForCausalLM
from sglang_echo.model.forward_batch import ForwardBatch
from sglang_echo.model.kv_cache import KVCache
from sglang_echo.runtime import kv_state

log = logging.getLogger("sglang_echo.cuda_graph")

GraphKey = tuple[int, bool]  # (batch size, decode prefetch on)


class GraphBackend(Protocol):
    """How a step is captured and replayed: CUDA graphs on a GPU, a stand-in in tests."""

    def capture(self, step: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        """Record ``step``; returns (replay, the output tensor each replay rewrites)."""
        ...


class CudaGraphs:
    """The GPU's backend: one shared memory pool, captured on ``stream``."""

    def __init__(self, device: torch.device, stream: torch.cuda.Stream | None = None) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = stream

    def capture(self, step: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(
            graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"
        ):
            out = step()
        return graph.replay, out


def graph_backend(
    kv_cache: KVCache, device: torch.device, backend: GraphBackend | None, step: str
) -> GraphBackend:
    """``backend``, or CUDA graphs on ``device``; refused, saying why, where ``step`` (what
    would be captured) cannot be: no CUDA, or an ECHO host pool the device cannot address."""
    if backend is None and not torch.cuda.is_available():
        raise RuntimeError("CUDA graphs need a CUDA device")
    if not kv_cache.graph_safe:
        raise RuntimeError(
            "the ECHO host pool is not device-addressable (no pinned UVA view), so "
            f"{step} cannot be captured; run without CUDA graphs"
        )
    return backend if backend is not None else CudaGraphs(device)


@contextmanager
def no_gc() -> Iterator[None]:
    """No garbage collection inside: collected first, then held off until the end."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def clear_capture_error(device: torch.device) -> None:
    """After a failed capture: wait for the device and drop the error it left pending, so
    the next eager launch does not report it."""
    if device.type != "cuda":
        return
    try:
        torch.cuda.synchronize(device)
    except RuntimeError as exc:  # the capture's error, once more
        log.debug("after the failed capture: %s", exc)


class DeviceStepClock:
    """Device time of decode steps by batch size, from CUDA event pairs read without
    waiting: a pair is read once it has completed (polled at the next step), so timing
    never stalls the host. Off CUDA it records nothing."""

    def __init__(self, device: torch.device, max_pending: int = 64) -> None:
        self.enabled = device.type == "cuda"
        self._pending: deque[tuple[int, torch.cuda.Event, torch.cuda.Event]] = deque()
        self._free: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.max_pending = max_pending
        self.seconds: dict[int, float] = {}  # batch size -> device seconds, summed
        self.steps: dict[int, int] = {}  # batch size -> decode steps timed

    @contextmanager
    def timed(self, batch_size: int) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        start, end = self._free.pop() if self._free else self._new_pair()
        start.record()
        yield
        end.record()
        self._pending.append((batch_size, start, end))
        self.poll(wait=len(self._pending) > self.max_pending)

    @staticmethod
    def _new_pair() -> tuple[torch.cuda.Event, torch.cuda.Event]:
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def poll(self, wait: bool = False) -> None:
        """Fold in every pair that has completed (``wait``: the oldest one at least)."""
        while self._pending:
            bs, start, end = self._pending[0]
            if wait:
                end.synchronize()
                wait = False
            elif not end.query():
                return
            self._pending.popleft()
            self.seconds[bs] = self.seconds.get(bs, 0.0) + start.elapsed_time(end) / 1e3
            self.steps[bs] = self.steps.get(bs, 0) + 1
            self._free.append((start, end))

    @property
    def total_seconds(self) -> float:
        return sum(self.seconds.values())


@dataclass
class _Captured:
    replay: Callable[[], None]
    batch: ForwardBatch
    logits: torch.Tensor


class CudaGraphDecodeRunner:
    def __init__(
        self,
        model: DeepseekV32ForCausalLM,
        kv_cache: KVCache,
        context_width: int,
        max_batch_size: int | None = None,
        backend: GraphBackend | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.context_width = context_width
        self.max_batch_size = max_batch_size  # larger decode batches run eagerly; None = all
        self.device = model.lm_head.weight.device
        self.backend = graph_backend(kv_cache, self.device, backend, "a decode step")
        self.graphs: dict[GraphKey, _Captured] = {}
        self.eager_shapes: set[GraphKey] = set()  # their capture failed: eager from then on
        self.captures = 0  # shapes captured so far
        self.capture_s = 0.0  # host seconds of those captures (and their warm-up steps)
        self.startup_captures = 0  # of which at start-up, before serving
        self.capture_failures = 0
        self.clock = DeviceStepClock(self.device)
        model.set_graph_safe(True)

    # ------------------------------------------------------------ start-up
    def modes(self) -> tuple[bool, ...]:
        """The decode-prefetch modes the backend's steps can take (graph keys' second
        part): off, on, or both under the rule (``auto``)."""
        return tuple(self.kv_cache.decode_prefetch_modes())

    def capture_all(self, batch_sizes: list[int] | None = None) -> int:
        """Capture every (batch size, mode) before serving, largest batch first; returns
        how many were captured (failed ones run eagerly). The backend's state is restored
        to what it was before (``kv_state``)."""
        if batch_sizes is None:
            if self.max_batch_size is None:
                raise ValueError("capture_all needs batch sizes when max_batch_size is None")
            batch_sizes = list(range(1, self.max_batch_size + 1))
        t0 = time.perf_counter()
        captured = 0
        with kv_state.preserved(self.kv_cache):
            for bs in sorted(set(batch_sizes), reverse=True):
                for mode in self.modes():
                    if (bs, mode) in self.graphs or (bs, mode) in self.eager_shapes:
                        continue
                    with kv_state.forced_decode_prefetch(self.kv_cache, mode):
                        static = self._static_batch(bs)
                        self._warm(static)
                        captured += self._capture((bs, mode), static)
        self.startup_captures += captured
        log.info(
            "captured %d decode graphs (batch sizes %s, prefetch modes %s) in %.1f s",
            captured,
            _ranges(sorted(set(batch_sizes))),
            list(self.modes()),
            time.perf_counter() - t0,
        )
        return captured

    def _warm(self, static: ForwardBatch) -> None:
        """One eager step over the dummy batch: every kernel and specialization the captured
        step launches is compiled and loaded here, not inside the capture."""
        self.model(static, self.kv_cache)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _capture(self, key: GraphKey, static: ForwardBatch) -> int:
        """1 when ``key`` is captured; 0 when its capture failed (logged; eager from now)."""
        t0 = time.perf_counter()
        try:
            with no_gc():
                replay, logits = self.backend.capture(lambda: self.model(static, self.kv_cache))
        except Exception as exc:  # never a request's failure: that shape runs eagerly
            self.capture_failures += 1
            self.eager_shapes.add(key)
            self.kv_cache.abandon_step()
            clear_capture_error(self.device)
            log.warning(
                "CUDA-graph capture of decode batch size %d (prefetch %s) failed; that shape "
                "runs eagerly from now on: %s: %s",
                key[0],
                "on" if key[1] else "off",
                type(exc).__name__,
                exc,
            )
            return 0
        self.graphs[key] = _Captured(replay, static, logits)
        self.captures += 1
        self.capture_s += time.perf_counter() - t0
        return 1

    # --------------------------------------------------------------- steps
    def _static_batch(self, bs: int) -> ForwardBatch:
        return static_lanes(bs, self.context_width, self.device)

    @staticmethod
    def _load(static: ForwardBatch, batch: ForwardBatch) -> None:
        copy_lane_inputs(static, batch)

    def key_for(self, bs: int) -> GraphKey:
        return (bs, self.kv_cache.decode_prefetch is not None)

    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        if not batch.is_decode:
            raise ValueError("only decode batches are captured")
        bs = batch.num_requests
        with self.clock.timed(bs):
            return self._step(batch, bs)

    def _step(self, batch: ForwardBatch, bs: int) -> torch.Tensor:
        key = self.key_for(bs)
        if (self.max_batch_size is not None and bs > self.max_batch_size) or (
            key in self.eager_shapes
        ):
            return self.model(batch, self.kv_cache)
        captured = self.graphs.get(key)
        if captured is not None:
            self._load(captured.batch, batch)
            captured.replay()
            return captured.logits.clone()
        # Not captured at start-up: this step runs eagerly as a real step (ECHO's cache
        # state moves exactly once), then its shape is captured for the next ones.
        static = self._static_batch(bs)
        self._load(static, batch)
        result = self.model(static, self.kv_cache).clone()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._capture(key, static)
        return result


def static_lanes(
    lanes: int,
    width: int,
    device: torch.device,
    logits_rows: int = 0,
    selections_distinct: bool = True,
) -> ForwardBatch:
    """The static decode batch a captured step reads (``copy_lane_inputs`` fills it):
    ``lanes`` lanes over ``width`` context positions, every lane the padding sink
    (location 0, position 0) until filled; ``logits_rows`` rows with logits (0: all)."""
    z = dict(dtype=torch.int64, device=device)
    return ForwardBatch(
        input_ids=torch.zeros(lanes, **z),
        positions=torch.zeros(lanes, **z),
        out_locs=torch.zeros(lanes, **z),
        context_locs=torch.zeros(lanes, width, **z),
        extend_lens=[1] * lanes,
        context_lens=[0] * lanes,
        is_decode=True,
        logits_indices=torch.zeros(logits_rows, **z) if logits_rows else None,
        request_rows=torch.zeros(lanes, **z),
        selections_distinct=selections_distinct,
    )


def copy_lane_inputs(static: ForwardBatch, batch: ForwardBatch) -> None:
    """A decode batch's inputs into a captured step's static batch of as many lanes (its
    context width at least ``batch``'s; the rest zeroed), queued without a host wait."""
    static.input_ids.copy_(batch.input_ids, non_blocking=True)
    static.positions.copy_(batch.positions, non_blocking=True)
    static.out_locs.copy_(batch.out_locs, non_blocking=True)
    width = batch.context_locs.shape[1]
    static.context_locs[:, :width].copy_(batch.context_locs, non_blocking=True)
    static.context_locs[:, width:].zero_()
    if batch.request_rows is not None:
        static.request_rows.copy_(batch.request_rows, non_blocking=True)
    if static.logits_indices is not None:
        static.logits_indices.copy_(batch.logits_indices, non_blocking=True)


def _ranges(values: list[int]) -> str:
    """[1, 2, 3, 5] -> "1-3, 5" (for the start-up log)."""
    out: list[str] = []
    for v in values:
        if out and int(out[-1].split("-")[-1]) == v - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{v}"
        else:
            out.append(str(v))
    return ", ".join(out)
