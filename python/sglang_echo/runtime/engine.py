"""Offline generation: a list of prompts in, greedy outputs back, over the serving
scheduler.

One scheduling core (runtime/scheduler.py) serves the offline engine, the server and the
PD decode node: admission, growth reservation, preemption, finish and release are written
once there. Here every request reserves its whole budget at admission (the scheduler's
``reserve_steps`` set to the context length), so an offline run never preempts: requests
join as earlier ones finish, up to ``max_batch_size`` at a time, and leave the moment they
end. ``record_logits`` keeps every step's logits per request, for the lossless checks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from sglang_echo.model.deepseek_v32 import DeepseekV32ForCausalLM
from sglang_echo.model.kv_cache import KVCache
from sglang_echo.runtime.request import OutputEvent, SamplingParams, ServeRequest
from sglang_echo.runtime.scheduler import Scheduler
from sglang_echo.runtime.step_runner import StepRunner


@dataclass(eq=False)  # identity, as every request class (runtime/request.py)
class Request(ServeRequest):
    index: int = 0
    step_logits: list[torch.Tensor] = field(default_factory=list)


@dataclass
class RunStats:
    prompt_tokens: int = 0
    output_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s


class Engine:
    def __init__(
        self,
        model: DeepseekV32ForCausalLM,
        kv_cache: KVCache,
        token_capacity: int,
        max_batch_size: int,
        max_context: int,
        chunked_prefill_size: int = 8192,
        ignore_eos: bool = False,
        use_cuda_graph: bool = False,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.steps = StepRunner(
            model, kv_cache, token_capacity, max_batch_size, max_context, use_cuda_graph
        )
        self.device = self.steps.device
        self.ignore_eos = ignore_eos
        self.scheduler = Scheduler(
            self.steps,
            max_batch_size,
            chunked_prefill_size,
            max_context,
            list(model.config.eos_token_ids),
            reserve_steps=max_context,  # whole budgets: an offline run never preempts
        )
        self._recording = False
        self.scheduler.on_logits = self._record

    @property
    def decode_runner(self):
        return self.steps.decode_runner

    @property
    def stats(self) -> RunStats:
        """Totals since the engine was built (wall time of the prefill and decode phases)."""
        s = self.scheduler.stats
        return RunStats(
            prompt_tokens=s.prompt_tokens,
            output_tokens=s.generation_tokens,
            prefill_s=s.phase_s["prefill"],
            decode_s=s.phase_s["decode"] + s.phase_s["accept"],
            decode_steps=s.decode_steps,
        )

    def generate(
        self,
        prompts: Sequence[list[int]],
        max_new_tokens: int,
        record_logits: bool = False,
        on_request_done: Callable[[Request], None] | None = None,
    ) -> list[Request]:
        """Greedy outputs of ``prompts``, in their order."""
        params = SamplingParams(
            max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=self.ignore_eos
        )
        requests = []
        for i, prompt in enumerate(prompts):
            req = Request(list(prompt), rid=f"offline-{i}", params=params, index=i)
            if on_request_done is not None:
                req.on_output = self._when_done(req, on_request_done)
            requests.append(req)
        sched = self.scheduler
        for req in requests:
            sched.add(req)
        self._recording = record_logits
        try:
            while sched.has_work():
                sched.step()
        finally:
            self._recording = False
        failed = [r for r in requests if r.finish_reason and r.finish_reason["type"] == "abort"]
        if failed:
            raise RuntimeError(f"request {failed[0].index} failed: {failed[0].finish_reason}")
        return requests

    def _record(self, reqs: Sequence[ServeRequest], logits: torch.Tensor) -> None:
        if not self._recording:
            return
        host = logits.detach().to("cpu", copy=True)
        for i, req in enumerate(reqs):
            req.step_logits.append(host[i])

    @staticmethod
    def _when_done(
        req: Request, on_done: Callable[[Request], None]
    ) -> Callable[[OutputEvent], None]:
        def on_output(event: OutputEvent) -> None:
            if event.finished:
                on_done(req)

        return on_output
