"""What the step code needs to know about one request, and what a served request adds.

``SeqState`` is the part the model steps read and move (prompt, outputs, where its KV rows
live); the offline engine and the serving scheduler each extend it with their own
bookkeeping, so both drive the same step code.
"""

from __future__ import annotations

import enum
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field

from sglang_echo.runtime.detokenizer import IncrementalText


# Identity semantics (eq=False) for every request class: ``req in waiting`` and
# ``running.remove(req)`` must find this very request, without comparing 100K-token prompts
# field by field (and two requests with equal fields are still two requests).
@dataclass(eq=False)
class SeqState:
    prompt: list[int]
    output: list[int] = field(default_factory=list)
    # Token location of each cached position (an int64 array: runtime/token_table.py).
    locs: array = field(default_factory=lambda: array("q"))
    row: int = -1  # row in the request table; -1 = not admitted / released
    cached_len: int = 0  # positions whose KV rows are in the cache
    # Tokens a prefill must cache: the prompt, or prompt + outputs for a request that was
    # preempted and is recomputed (None = the prompt).
    recompute_ids: list[int] | None = None

    @property
    def prefill_ids(self) -> list[int]:
        return self.prompt if self.recompute_ids is None else self.recompute_ids

    @property
    def prefill_done(self) -> bool:
        return self.cached_len >= len(self.prefill_ids)


# Below this temperature sampling is greedy, as in SGLang: dividing logits by a tiny
# temperature overflows float32 (1e-320 would give inf/NaN probabilities).
GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    """SGLang's sampling parameters that this runtime honours (temperature 0 = greedy).

    ``protocol`` validates every field before a request reaches the engine, so the
    sampler never sees NaN, infinities or out-of-range values.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = whole vocabulary
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    # Log-probabilities of each chosen token (and of the ``top_logprobs`` likeliest).
    logprobs: bool = False
    top_logprobs: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


class ReqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class ServeRequest(SeqState):
    """A request of the serving scheduler: sampling, stop conditions, lifecycle."""

    rid: str = ""
    params: SamplingParams = field(default_factory=SamplingParams)
    status: ReqStatus = ReqStatus.WAITING
    # None while running; then {"type": "length" | "stop" | "abort", ...} as SGLang reports it.
    finish_reason: dict | None = None
    # 64-bit key of the request's sampling noise (its seed, or drawn at admission): with the
    # output index it fixes every sampled token, whatever the batch or a preemption does.
    sample_key: int = 0
    text: IncrementalText | None = None  # output text, kept by the engine thread
    on_output: Callable[[OutputEvent], None] | None = None  # called from the engine thread
    arrival_s: float = 0.0
    preemptions: int = 0  # times this request was retracted and recomputed
    # A decode node's seed of the prompt's synthetic KV (fake transfer), computed where the
    # request is parsed (a CRC over 100K ids takes milliseconds the engine thread need not
    # spend); None: the node computes it at admission.
    prompt_seed: int | None = None

    @property
    def finished(self) -> bool:
        return self.status is ReqStatus.FINISHED

    def token_budget(self) -> int:
        """Token locations this request can ever occupy (its last token is never cached)."""
        return len(self.prompt) + self.params.max_new_tokens - 1


@dataclass(frozen=True)
class TokenLogprob:
    """The chosen token's log-probability and the likeliest alternatives (id, logprob)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class OutputEvent:
    """What the engine thread tells a waiting client after a step: new tokens and/or the end.

    A copy, never the live request, so the HTTP side can read it without a lock.
    """

    rid: str
    new_token_ids: tuple[int, ...]
    prompt_tokens: int
    completion_tokens: int
    finish_reason: dict | None = None  # set on the last event of a request
    # Output text that can no longer change (stop strings cut, partial characters and
    # possible stop-string prefixes held back); empty without a tokenizer.
    text_delta: str = ""
    logprobs: tuple[TokenLogprob, ...] = ()  # one per new token when the request asked

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
