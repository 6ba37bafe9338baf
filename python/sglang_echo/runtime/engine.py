"""Offline batched generation: chunked prefill, then greedy decode until each request ends.

Requests of a batch have different prompt lengths (packed, no padding) and leave the
batch as soon as they finish, returning their token locations to the pool. The forward
steps themselves live in ``StepRunner``, shared with the serving scheduler.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from sglang_echo.model.deepseek_v32 import DeepseekV32ForCausalLM
from sglang_echo.model.kv_cache import KVCache
from sglang_echo.runtime.request import SeqState
from sglang_echo.runtime.step_runner import StepRunner


@dataclass(eq=False)  # identity, as every request class (runtime/request.py)
class Request(SeqState):
    index: int = 0
    max_new_tokens: int = 0
    finished: bool = False
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
        self.max_batch_size = max_batch_size
        self.chunked_prefill_size = chunked_prefill_size
        self.eos_ids = set() if ignore_eos else set(model.config.eos_token_ids)
        self.stats = RunStats()

    @property
    def decode_runner(self):
        return self.steps.decode_runner

    # ----------------------------------------------------------------- public
    def generate(
        self,
        prompts: Sequence[list[int]],
        max_new_tokens: int,
        record_logits: bool = False,
        on_request_done: Callable[[Request], None] | None = None,
    ) -> list[Request]:
        requests = [
            Request(list(p), index=i, max_new_tokens=max_new_tokens) for i, p in enumerate(prompts)
        ]
        for start in range(0, len(requests), self.max_batch_size):
            batch = requests[start : start + self.max_batch_size]
            self._run_batch(batch, record_logits, on_request_done)
        return requests

    # --------------------------------------------------------------- batches
    def _run_batch(
        self,
        batch: list[Request],
        record_logits: bool,
        on_done: Callable[[Request], None] | None,
    ) -> None:
        for req in batch:
            self.steps.admit(req)
        self.stats.prompt_tokens += sum(len(r.prompt) for r in batch)
        t0 = self._now()
        while any(not r.prefill_done for r in batch):
            pending = [r for r in batch if not r.prefill_done]
            done, logits = self.steps.prefill_chunk(pending, self.chunked_prefill_size)
            self._accept_all(done, logits, record_logits, on_done)
        t1 = self._now()
        self.stats.prefill_s += t1 - t0
        while True:
            active = [r for r in batch if not r.finished]
            if not active:
                break
            logits = self.steps.decode(active)
            self._accept_all(active, logits, record_logits, on_done)
            self.stats.decode_steps += 1
        self.stats.decode_s += self._now() - t1

    def _accept_all(
        self,
        reqs: Sequence[Request],
        logits: torch.Tensor,
        record_logits: bool,
        on_done: Callable[[Request], None] | None,
    ) -> None:
        """Greedy tokens for the batch: one argmax and one host read per step."""
        if not reqs:
            return
        tokens = torch.argmax(logits, dim=-1).tolist()
        for i, (req, token) in enumerate(zip(reqs, tokens, strict=True)):
            req.output.append(token)
            self.stats.output_tokens += 1
            if record_logits:
                req.step_logits.append(logits[i].detach().to("cpu", copy=True))
            if len(req.output) >= req.max_new_tokens or token in self.eos_ids:
                req.finished = True
                self.steps.release(req)
                if on_done is not None:
                    on_done(req)

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()
