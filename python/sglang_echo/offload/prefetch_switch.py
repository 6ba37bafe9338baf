"""Which decode prefetch a decode step runs with: ECHO's staged prefetch, or none.

Why apart from EchoKVCache: with SGLANG_NSA_FUSE_LOGITS_RECALL_DECODE=auto a rule
(offload/prefetch_rule.py) turns the prefetch on for the decode steps after one that
missed enough, and a CUDA-graph runner captures one graph per mode, forcing each mode in
turn. Keeping the cache's ``decode_prefetch`` (KVCache's hook: the prefetcher, or None)
equal to what the rule decided, at every point the decision changes, is this object's job.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sglang_echo.offload.prefetch_rule import DecodePrefetchRule
from sglang_echo.offload.state_checkpoint import StateCheckpoint


class DecodePrefetchSwitch:
    """Sets ``cache.decode_prefetch`` from ``cache.decode_prefetcher`` and the rule: the
    prefetcher, or None when it is off or the rule left the coming step without it. The
    rule's decision changes only here (``before_step``, ``forced``) and when a checkpoint
    is restored (``SwitchedCheckpoint``), and ``sync`` runs after each change and when the
    prefetcher is built."""

    def __init__(self, cache: Any, rule: DecodePrefetchRule | None) -> None:
        """``cache``: the EchoKVCache (its ``decode_prefetcher``, counters and hook)."""
        self.cache = cache
        self.rule = rule

    def sync(self) -> None:
        c = self.cache
        off = self.rule is not None and not self.rule.on
        c.decode_prefetch = None if off else c.decode_prefetcher

    def modes(self) -> tuple[bool, ...]:
        """Whether decode steps run with the prefetch: (False,), (True,), or both under
        the rule (a CUDA-graph runner captures one graph per mode)."""
        if self.cache.decode_prefetcher is None:
            return (False,)
        return (False, True) if self.rule is not None else (True,)

    @contextmanager
    def forced(self, on: bool) -> Iterator[None]:
        """Steps inside run with the prefetch ``on`` (start-up graph capture); the rule's
        own choice comes back after."""
        if self.rule is None:
            yield
            return
        before = self.rule.on
        self.rule.on = on
        self.sync()
        try:
            yield
        finally:
            self.rule.on = before
            self.sync()

    def before_step(self) -> None:
        """Under auto: decide whether the coming decode step prefetches (the previous
        decode step's miss fraction) and snapshot the counters."""
        c = self.cache
        if self.rule is not None and c.decode_prefetcher is not None:
            self.rule.decide()
            self.sync()
            self.rule.before_step(c.cache.hits, c.cache.misses)

    def after_step(self) -> None:
        c = self.cache
        if self.rule is not None and c.decode_prefetcher is not None:
            self.rule.after_step(c.cache.hits, c.cache.misses)


class SwitchedCheckpoint(StateCheckpoint):
    """A StateCheckpoint of the cache whose restore, which puts the rule's decision back,
    also puts back the ``decode_prefetch`` that follows from it."""

    def __init__(self, switch: DecodePrefetchSwitch, roots: list, data: list) -> None:
        super().__init__(roots, data)
        self.switch = switch

    def restore(self) -> None:
        super().restore()
        self.switch.sync()
