"""A speculative round's steps replayed from CUDA graphs: the target's verify and the
NextN layer's draft steps, one graph per (step, lanes).

Why: a round is S - 1 draft steps, a verify and a draft over the verified positions, each
a decode step of fixed lanes (runtime/speculative.py). Run eagerly, each costs a launch per
kernel on the host, which at small batches is most of a step: the speculative gain at
batch 1 is the gain of doing Q tokens' work in one step, and it needs the step launched
as one graph, as plain decode steps are (runtime/cuda_graph.py).

How: the same rules as the decode runner's. A shape's first step runs eagerly as a real
step (compiling and loading every Triton specialization it launches), then is captured on
static input tensors; later steps copy their inputs in and replay. Outputs are cloned out
of the graph's pool. A capture that fails is logged and that shape runs eagerly from then
on, never taking a request with it. Graphs share the decode runner's memory pool when there
is one (a speculative server replays no plain decode step).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from sglang_echo.model.deepseek_v32 import DeepseekV32ForCausalLM
from sglang_echo.model.forward_batch import ForwardBatch
from sglang_echo.model.kv_cache import KVCache
from sglang_echo.model.nextn import NextNLayer
from sglang_echo.runtime import kv_state
from sglang_echo.runtime.cuda_graph import (
    GraphBackend,
    clear_capture_error,
    copy_lane_inputs,
    graph_backend,
    no_gc,
    static_lanes,
)

log = logging.getLogger("sglang_echo.cuda_graph")

# (step, lanes, rows with logits or 0 for all lanes): "verify" is the target's,
# "draft" the NextN layer's.
SpecKey = tuple[str, int, int]


@dataclass
class _Static:
    """A shape's input tensors (the captured step reads them) and its outputs."""

    batch: ForwardBatch
    hidden: torch.Tensor | None  # the draft's input states [lanes, hidden]
    replay: Callable[[], None] | None = None
    outputs: tuple[torch.Tensor, torch.Tensor] | None = None


class SpecStepGraphs:
    """Verify and draft steps of fixed lanes, captured lazily per shape."""

    def __init__(
        self,
        target: DeepseekV32ForCausalLM,
        draft: NextNLayer,
        target_cache: KVCache,
        draft_cache: KVCache,
        context_width: int,
        backend: GraphBackend | None = None,
    ) -> None:
        self.target, self.draft = target, draft
        self.target_cache, self.draft_cache = target_cache, draft_cache
        self.context_width = context_width
        self.device = target.lm_head.weight.device
        self.backend = graph_backend(target_cache, self.device, backend, "a verify step")
        self.shapes: dict[SpecKey, _Static] = {}
        self.eager_shapes: set[SpecKey] = set()  # their capture failed
        self.captures = 0
        self.startup_captures = 0  # of which by capture_all, before serving
        self.capture_failures = 0
        self.capture_s = 0.0
        target.set_graph_safe(True)
        draft.set_graph_safe(True)

    # --------------------------------------------------------------- steps
    def verify(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's (logits, final-normed hidden) of every lane of ``batch``."""
        return self._step(("verify", batch.num_tokens, 0), batch, None)

    def draft_step(
        self, batch: ForwardBatch, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The NextN layer's (logits, out_hidden) of the rows ``batch.logits_indices``
        picks (every lane when None)."""
        rows = 0 if batch.logits_indices is None else int(batch.logits_indices.numel())
        return self._step(("draft", batch.num_tokens, rows), batch, hidden)

    def _run(self, key: SpecKey, batch: ForwardBatch, hidden: torch.Tensor | None):
        if key[0] == "verify":
            return self.target.forward_with_hidden(batch, self.target_cache)
        return self.draft(batch, hidden, self.draft_cache)

    def _step(
        self, key: SpecKey, batch: ForwardBatch, hidden: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if key in self.eager_shapes:
            return self._run(key, batch, hidden)
        static = self.shapes.get(key)
        if static is not None and static.replay is not None:
            self._load(static, batch, hidden)
            static.replay()
            return tuple(t.clone() for t in static.outputs)  # type: ignore[return-value]
        # The shape's first step: eagerly, as a real step (the cache state moves once),
        # on the static tensors it is then captured with.
        static = self._static(key, batch.selections_distinct)
        self._load(static, batch, hidden)
        out = self._run(key, static.batch, static.hidden)
        result = tuple(t.clone() for t in out)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._capture(key, static)
        return result  # type: ignore[return-value]

    # ------------------------------------------------------------ capture
    def capture_all(self, batch_sizes: list[int], draft_steps: int) -> int:
        """Capture every round shape of these batch sizes now (a server, before it says it
        is ready), largest first: the verify (B x Q lanes), the draft steps (B lanes, when
        S > 1) and the draft over the verified positions (B x Q lanes, B rows). Each is run
        once eagerly on a dummy batch (every lane the padding sink), then captured; the
        target cache's state is restored after (``kv_state``). Returns how many."""
        q = draft_steps + 1
        before = self.captures
        with kv_state.preserved(self.target_cache):
            for b in sorted(set(batch_sizes), reverse=True):
                keys = [("verify", b * q, 0), ("draft", b * q, b)]
                if draft_steps > 1:
                    keys.append(("draft", b, 0))
                for key in keys:
                    if key in self.shapes or key in self.eager_shapes:
                        continue
                    static = self._static(key, selections_distinct=key[1] == b)
                    self._run(key, static.batch, static.hidden)  # compiles what it launches
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)
                    self._capture(key, static)
        self.startup_captures += self.captures - before
        return self.captures - before

    def _capture(self, key: SpecKey, static: _Static) -> None:
        t0 = time.perf_counter()
        try:
            with no_gc():
                replay, outputs = self.backend.capture(
                    lambda: self._run(key, static.batch, static.hidden)
                )
        except Exception as exc:  # never a request's failure: that shape runs eagerly
            self.capture_failures += 1
            self.eager_shapes.add(key)
            self.shapes.pop(key, None)
            self.target_cache.abandon_step()
            clear_capture_error(self.device)
            log.warning(
                "CUDA-graph capture of the %s step of %d lanes failed; that shape runs "
                "eagerly from now on: %s: %s",
                key[0],
                key[1],
                type(exc).__name__,
                exc,
            )
            return
        static.replay, static.outputs = replay, outputs
        self.shapes[key] = static
        self.captures += 1
        self.capture_s += time.perf_counter() - t0

    def _static(self, key: SpecKey, selections_distinct: bool) -> _Static:
        lanes, rows = key[1], key[2]
        static_batch = static_lanes(
            lanes, self.context_width, self.device, rows, selections_distinct
        )
        hidden = None
        if key[0] == "draft":
            width = self.draft.config.hidden_size
            hidden = torch.zeros(
                lanes, width, dtype=self.draft.eh_proj.weight.dtype, device=self.device
            )
        return _Static(static_batch, hidden)

    @staticmethod
    def _load(static: _Static, batch: ForwardBatch, hidden: torch.Tensor | None) -> None:
        if static.batch.selections_distinct != batch.selections_distinct:
            raise ValueError("a captured step's lanes share rows or not, for good")
        copy_lane_inputs(static.batch, batch)
        if static.hidden is not None:
            static.hidden.copy_(hidden, non_blocking=True)
