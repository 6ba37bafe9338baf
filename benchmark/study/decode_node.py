"""A PD decode node with a fake transfer backend, over the runtime's ``StepRunner``.

Why: the capacity wall ECHO removes shows on a decode node holding many 100K-token
requests; a prefill of each on the same GPU would dominate the run and hide it. Here a
request arrives as (prompt length, seed); its prompt KV is synthesized into the KV backend
(``SyntheticKV``: the host pool under ECHO, the device pool without), its token locations
and request-table row come from the runner's own allocator and table, its prompt is marked
cached, and it decodes from the next step on. Release goes through ``StepRunner.release``,
so locations, rows and ECHO's device slots are returned exactly as for a served request.

Admission rules (as a real decode node): a request is admitted only while its whole
budget (prompt + max_new_tokens) fits the free token locations after every running
request's remaining budget is reserved, and a request-table row is free. The runner's
``max_requests`` carries ECHO's per-step bound (N_G // top-k); the allocator's capacity is
the pool (no-offload) or the host pool (ECHO). Sampling is greedy over the whole batch on
the device, with one host read per step (no per-request synchronisation).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from sglang_echo.runtime.admission import fits, future_tokens, token_budget
from sglang_echo.runtime.request import SeqState
from sglang_echo.runtime.step_runner import StepRunner
from sglang_echo.runtime.synthetic_kv import SyntheticKV


@dataclass(eq=False)  # identity, as every request class (runtime/request.py)
class NodeRequest(SeqState):
    seed: int = 0
    max_new_tokens: int = 0
    admit_s: float = 0.0

    def remaining(self) -> int:
        """Token locations this request may still take (the scheduling core's rule)."""
        return future_tokens(self, self.max_new_tokens)


class DecodeNode:
    def __init__(self, runner: StepRunner, synth: SyntheticKV, vocab_size: int) -> None:
        self.runner = runner
        self.synth = synth
        self.vocab_size = vocab_size
        self.running: list[NodeRequest] = []

    # ------------------------------------------------------------ admission
    def fits(self, prompt_len: int, max_new_tokens: int) -> bool:
        """Admission as the scheduling core's decode node admits: whole budgets reserved
        (runtime/admission.py), a request-table row free, the context long enough."""
        reserved = sum(r.remaining() for r in self.running)
        need = token_budget(prompt_len, max_new_tokens)
        return (
            self.runner.table.num_free_rows > 0
            and fits(self.runner.allocator.num_free, reserved, need)
            and prompt_len + max_new_tokens <= self.runner.max_context
        )

    def admit(self, prompt_len: int, seed: int, max_new_tokens: int) -> NodeRequest:
        """Synthesize the prompt's KV into the backend and start the request decoding.
        The prompt's own ids are never read (no prefill): a placeholder list of its length."""
        if not self.fits(prompt_len, max_new_tokens):
            raise RuntimeError("request does not fit the decode node (check fits() first)")
        first = random.Random(seed).randrange(self.vocab_size)
        req = NodeRequest(
            prompt=[0] * prompt_len, output=[first], seed=seed, max_new_tokens=max_new_tokens
        )
        runner = self.runner
        runner.admit(req)
        locs = runner.allocator.alloc(prompt_len)
        locs_t = runner.place(req, 0, locs)
        req.cached_len = prompt_len
        self.synth.write(runner.kv_cache, locs_t, seed)
        self.running.append(req)
        return req

    # ---------------------------------------------------------------- steps
    def step(self) -> list[int]:
        """One decode step of every running request; finished requests are released.
        Returns the tokens chosen, in ``running`` order before the step."""
        active = list(self.running)
        logits = self.runner.decode(active)
        tokens = logits.argmax(dim=-1).tolist()  # one host read for the whole batch
        for req, token in zip(active, tokens, strict=True):
            req.output.append(token)
            if req.remaining() <= 0:
                self.release(req)
        return tokens

    def release(self, req: NodeRequest) -> None:
        self.runner.release(req)
        self.running.remove(req)

    def release_all(self) -> None:
        for req in list(self.running):
            self.release(req)
