"""What the step code needs to know about one request, and what a served request adds.

``SeqState`` is the part the model steps read and move (prompt, outputs, where its KV rows
live); the offline engine and the serving scheduler each extend it with their own
bookkeeping, so both drive the same step code.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class SeqState:
    prompt: list[int]
    output: list[int] = field(default_factory=list)
    locs: list[int] = field(default_factory=list)  # token location of each cached position
    row: int = -1  # row in the request table; -1 = not admitted / released
    cached_len: int = 0  # positions whose KV rows are in the cache

    @property
    def prefill_done(self) -> bool:
        return self.cached_len >= len(self.prompt)


@dataclass
class SamplingParams:
    """SGLang's sampling parameters that this runtime honours (temperature 0 = greedy)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = whole vocabulary
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1


class ReqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class ServeRequest(SeqState):
    """A request of the serving scheduler: sampling, stop conditions, lifecycle."""

    rid: str = ""
    params: SamplingParams = field(default_factory=SamplingParams)
    status: ReqStatus = ReqStatus.WAITING
    # None while running; then {"type": "length" | "stop" | "abort", ...} as SGLang reports it.
    finish_reason: dict | None = None
    generator: torch.Generator | None = None  # per-request RNG for sampled decoding
    reserved_tokens: int = 0  # token locations held back for this request at admission
    on_output: Callable[[OutputEvent], None] | None = None  # called from the engine thread
    arrival_s: float = 0.0

    @property
    def finished(self) -> bool:
        return self.status is ReqStatus.FINISHED

    def token_budget(self) -> int:
        """Token locations this request can ever occupy (its last token is never cached)."""
        return len(self.prompt) + self.params.max_new_tokens - 1


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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
