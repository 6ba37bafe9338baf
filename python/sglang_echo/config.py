"""ECHO configuration from the environment and the launcher's flags, validated up front.

Every check here exists so that a bad setting fails at start-up with a message that says
what to change, never later inside a kernel.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

ENV_OFFLOAD = "NSA_KV_OFFLOAD"
ENV_DEV_CACHE = "NSA_DEV_CACHE_SIZE"
ENV_FUSE_DECODE = "SGLANG_NSA_FUSE_LOGITS_RECALL_DECODE"
ENV_FUSE_EXTEND = "SGLANG_NSA_FUSE_LOGITS_RECALL_EXTEND"
# Extra victims a step takes whenever it must evict, left free for the next steps (which
# then scan no slots): 0 = evict exactly the misses' worth. Unset: N_G / 32, at most 8192
# (rounded up; on the H200 a reserve of 8192 in 260K slots cut cache management from 68.9 to 43.4 us
# per layer-step at batch 48 with the hit rate unchanged: benchmark/results/history/
# 2026-12-01-kernels-18b7783/cache_ops_reserve.json; the default's run is cache_ops.json).
ENV_EVICTION_RESERVE = "SGLANG_ECHO_EVICTION_RESERVE"
DEFAULT_DEV_CACHE_SIZE = 260_000
MAX_DEFAULT_EVICTION_RESERVE = 8192


class ConfigError(ValueError):
    """A setting that cannot work; the message names the setting and the fix."""


def parse_flag(name: str, raw: str | None) -> bool:
    if raw is None or raw.strip() in ("", "0"):
        return False
    if raw.strip() == "1":
        return True
    raise ConfigError(f"{name}={raw!r} is not understood; set it to 1 (on) or 0 (off).")


def parse_size(name: str, raw: str) -> int:
    """A positive integer; underscores between digits are allowed (``260_000``)."""
    text = raw.strip()
    digits = text.replace("_", "")
    if (
        not (digits.isascii() and digits.isdigit())
        or text.startswith("_")
        or text.endswith("_")
        or "__" in text
    ):
        raise ConfigError(
            f"{name}={raw!r} is not a whole number of tokens; use e.g. {name}=260_000."
        )
    value = int(digits)
    if value <= 0:
        raise ConfigError(f"{name} must be > 0 tokens, got {raw!r}.")
    return value


def parse_count(name: str, raw: str | None) -> int:
    """A whole number >= 0 (unset or empty: 0); underscores as in ``parse_size``."""
    if raw is None or raw.strip() in ("", "0"):
        return 0
    return parse_size(name, raw)


def default_eviction_reserve(dev_cache_size: int) -> int:
    """N_G / 32 rounded up, at most 8192 (and at most half the cache): a step that evicts
    leaves this many slots free, so the next few steps' misses fit without a scan, while
    the cache gives up at most ~3% of its capacity to free slots. Rounded up so that every
    cache of two slots or more runs with a reserve: the configuration served is the one
    tested, small test caches included."""
    return min(MAX_DEFAULT_EVICTION_RESERVE, -(-dev_cache_size // 32), dev_cache_size // 2)


@dataclass(frozen=True)
class EchoConfig:
    offload: bool = False
    dev_cache_size: int = DEFAULT_DEV_CACHE_SIZE  # N_G: usable device slots per layer
    fuse_decode: bool = False
    fuse_extend: bool = False
    # Extra victims per evicting step (ENV_EVICTION_RESERVE); None = the default for N_G.
    eviction_reserve: int | None = None

    def __post_init__(self) -> None:
        if self.eviction_reserve is None:
            object.__setattr__(
                self, "eviction_reserve", default_eviction_reserve(self.dev_cache_size)
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> EchoConfig:
        env = os.environ if environ is None else environ
        raw_size = env.get(ENV_DEV_CACHE)
        return cls(
            offload=parse_flag(ENV_OFFLOAD, env.get(ENV_OFFLOAD)),
            dev_cache_size=(
                DEFAULT_DEV_CACHE_SIZE if raw_size is None else parse_size(ENV_DEV_CACHE, raw_size)
            ),
            fuse_decode=parse_flag(ENV_FUSE_DECODE, env.get(ENV_FUSE_DECODE)),
            fuse_extend=parse_flag(ENV_FUSE_EXTEND, env.get(ENV_FUSE_EXTEND)),
            eviction_reserve=(
                None
                if env.get(ENV_EVICTION_RESERVE) is None
                else parse_count(ENV_EVICTION_RESERVE, env.get(ENV_EVICTION_RESERVE))
            ),
        )

    def min_dev_cache_size(self, max_running_requests: int, topk: int, chunk_size: int) -> int:
        """Smallest N_G that holds one decode step's selections and one prefill chunk."""
        return max(max_running_requests * topk, chunk_size, topk)

    def validate(
        self, *, host_tokens: int, max_running_requests: int, topk: int, chunk_size: int
    ) -> None:
        if host_tokens < 1:
            raise ConfigError(f"the host pool must hold >= 1 token, got {host_tokens}.")
        if max_running_requests < 1:
            raise ConfigError(f"max running requests must be >= 1, got {max_running_requests}.")
        if self.eviction_reserve > self.dev_cache_size // 2:
            raise ConfigError(
                f"{ENV_EVICTION_RESERVE}={self.eviction_reserve} would keep more than half of "
                f"the {self.dev_cache_size} device slots ({ENV_DEV_CACHE}) free after each "
                f"eviction; use at most {self.dev_cache_size // 2} (a few thousand is plenty)."
            )
        need = self.min_dev_cache_size(max_running_requests, topk, chunk_size)
        if self.dev_cache_size < need:
            raise ConfigError(
                f"{ENV_DEV_CACHE}={self.dev_cache_size} is too small: one decode step of "
                f"{max_running_requests} requests selects up to {max_running_requests} x "
                f"top-k {topk} = {max_running_requests * topk} tokens per layer, and a prefill "
                f"chunk writes {chunk_size}; set {ENV_DEV_CACHE} >= {need}, or lower the "
                "max running requests / chunked prefill size."
            )
