"""ECHO's offload configuration, ``EchoConfig``, and the capacity rules it is sized by.

``EchoConfig`` is what the offload runs with: ECHO on or off, the device cache size N_G,
the decode and prefill prefetch switches, the eviction reserve, the decode writes'
placement and the resolve's overlap; ``validate`` refuses a configuration that cannot
work, at start-up, with a message that says what to change. The capacity rule
(``max_running``, ``dev_cache_for``) and the decode prefetch's staged rows are written
once, here, for the runtime and the plugin's torch-free sizing alike.

The environment variables that set it live in ``env_settings.py`` (the registry, the
process's parsed settings, the docs writer); every name of that module is re-exported
here, so ``from sglang_echo.config import settings, ENV_PDL, ConfigError`` and
``python -m sglang_echo.config --markdown > docs/CONFIGURATION.md`` work as before.
``EchoConfig.from_settings(settings())`` is the configuration a start-up parsed.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, fields

from sglang_echo.env_settings import (
    APPLIES_TO,
    DECODE_PREFETCH_MODES,
    DEFAULT_DECODE_PREFETCH,
    DEFAULT_DEV_CACHE_SIZE,
    DEFAULT_RESOLVE_OVERLAP_FROM,
    ENV_BATCH_INVARIANT,
    ENV_DECODE_PLACE,
    ENV_DEV_CACHE,
    ENV_ENGINE_PROFILE,
    ENV_EVICTION_RESERVE,
    ENV_FUSE_DECODE,
    ENV_FUSE_EXTEND,
    ENV_OFFLOAD,
    ENV_PDL,
    ENV_RESOLVE_OVERLAP,
    ENV_SPARSE_MLA,
    EXTERNAL_VARIABLES,
    MARKDOWN_HEADER,
    MAX_DEFAULT_EVICTION_RESERVE,
    REGISTRY,
    SPARSE_MLA_BACKENDS,
    VARIABLES,
    ConfigError,
    EchoSettings,
    HelpFormatter,
    Variable,
    default_eviction_reserve,
    eviction_reserve_in_force,
    help_epilog,
    load_settings,
    main,
    markdown,
    max_eviction_reserve,
    offload_requested,
    parse_choice,
    parse_count,
    parse_dev_cache_size,
    parse_flag,
    parse_path,
    parse_reserve,
    parse_size,
    parse_switch_on,
    reset_settings,
    settings,
)

# The decode prefetch's staged rows per request and layer (offload/decode_prefetcher.py):
# as many as fit in DEFAULT_STAGE_BYTES. Why bytes: what pays is the copy
# that fits beside the logits and the top-k, and a staged row that loses the top-k costs
# its PCIe time. End to end on an H200 (benchmark/results/e2e_prefetch/ and its history,
# batch 17, 1152-byte rows, random keys, where about half of what beat the threshold was
# then selected), 1536 rows per request ran slower than ECHO without the prefetch and 384
# or 512 rows faster; at the paper's setting the rows made little difference
# (docs/ARCHITECTURE.md section 6 and section 15, "Measured choices"; the evidence row
# "decode prefetch end to end (auto)"). At 656-byte rows the same bytes are 896 rows, more
# than the kernel bench's batch 16 x 128K staged per request at any hit rate. Here, not beside the
# prefetcher, because the start-up sizing (sglang/sizing.py, free of torch) counts them.
DEFAULT_STAGE_BYTES = 512 * 1152
MAX_STAGE_ROWS = 1536  # and never more rows than this (small rows: the tests' models)
STAGE_ROWS_ALIGN = 64


def default_stage_rows(row_bytes: int) -> int:
    """Staged rows per request and layer for cache rows of ``row_bytes`` bytes."""
    if row_bytes < 1:
        raise ValueError(f"row_bytes must be >= 1, got {row_bytes}")
    rows = DEFAULT_STAGE_BYTES // row_bytes // STAGE_ROWS_ALIGN * STAGE_ROWS_ALIGN
    return max(STAGE_ROWS_ALIGN, min(MAX_STAGE_ROWS, rows))


# ------------------------------------------------------------------- the capacity rule
def max_running(dev_cache_size: int, top_k: int, *, queries_per_request: int = 1) -> int:
    """The capacity rule, written once: one decode step selects up to top-k tokens per
    query token in each layer, and all of them must be resident in the N_G =
    ``dev_cache_size`` device slots at once (N_G >= running x Q x top-k), so at most
    N_G // (Q x top-k) requests decode together (per attention-DP rank under SGLang).
    Q = ``queries_per_request`` is 1 for a plain decode step and S + 1 for a speculative
    verify step (the last accepted token and S drafts, each selecting its own top-k).
    0: the cache cannot hold one request's selection. The runtime
    (``EchoConfig.max_running``: runtime/serving.py, offload/echo_cache.py, the
    speculative start-up check), the plugin's plan (sglang/args.py), its sizing
    (sglang/sizing.py) and its decode resolve (sglang/topk_resolve.py) call this;
    tests/test_capacity_rule.py checks that they agree and that no other module of the
    package divides by a top-k."""
    if top_k < 1:
        raise ValueError(f"top-k must be >= 1, got {top_k}")
    if queries_per_request < 1:
        raise ValueError(f"queries per request must be >= 1, got {queries_per_request}")
    # floor(floor(N_G / Q) / top-k) == floor(N_G / (Q x top-k)): one division by top-k.
    return dev_cache_size // queries_per_request // top_k


def dev_cache_for(running: int, top_k: int, *, queries_per_request: int = 1) -> int:
    """The rule read the other way: the smallest N_G at which ``max_running`` admits
    ``running`` requests of Q = ``queries_per_request`` query tokens each
    (running x Q x top-k slots)."""
    return running * queries_per_request * top_k


def decode_prefetch_mode(value: bool | str) -> str:
    """ENV_FUSE_DECODE's mode, "0" | "1" | "auto" (a bool: "1" / "0", as tests pass it)."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if value not in DECODE_PREFETCH_MODES:
        raise ConfigError(f"decode prefetch mode must be one of {DECODE_PREFETCH_MODES}")
    return value


@dataclass(frozen=True)
class EchoConfig:
    offload: bool = False
    dev_cache_size: int = DEFAULT_DEV_CACHE_SIZE  # N_G: usable device slots per layer
    # Decode prefetch (ENV_FUSE_DECODE): "0" off, "1" every step, "auto" by the measured
    # rule (offload/prefetch_rule.py); True / False are read as "1" / "0".
    fuse_decode: str = DEFAULT_DECODE_PREFETCH
    fuse_extend: bool = False
    # Extra victims per evicting step (ENV_EVICTION_RESERVE); None = the default for N_G.
    eviction_reserve: int | None = None
    # A decode step's new tokens placed in free device slots as they are written
    # (ENV_DECODE_PLACE); False: host only, recalled by the resolve.
    decode_place: bool = True
    # The smallest decode step (tokens) whose resolve runs on a side stream beside the
    # query's up-projection (CUDA; ENV_RESOLVE_OVERLAP); smaller ones in line (0: every
    # step in line, 1: every step beside).
    resolve_overlap: int = DEFAULT_RESOLVE_OVERLAP_FROM
    # Chained launches of the allocation and recall kernels where the device supports them
    # (ENV_PDL, kernels/pdl.py).
    pdl: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "fuse_decode", decode_prefetch_mode(self.fuse_decode))
        object.__setattr__(
            self,
            "eviction_reserve",
            eviction_reserve_in_force(self.dev_cache_size, self.eviction_reserve),
        )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> EchoConfig:
        """ECHO's own variables of ``environ`` (default ``os.environ``), parsed by the
        registry's parsers: a fresh parse, for tests and tools; the runtime and the plugin
        read ``EchoConfig.from_settings(settings())``, parsed once at start-up."""
        env = os.environ if environ is None else environ
        own = {f.name for f in fields(cls)}
        return cls(
            **{v.setting: v.parse(v.name, env.get(v.name)) for v in VARIABLES if v.setting in own}
        )

    @classmethod
    def from_settings(cls, parsed: EchoSettings) -> EchoConfig:
        """The ECHO part of the settings a start-up parsed (``settings()``)."""
        return cls(**{f.name: getattr(parsed, f.name) for f in fields(cls)})

    def max_running(self, top_k: int, *, queries_per_request: int = 1) -> int:
        """Requests that can decode together in this cache: ``max_running`` (the rule),
        with Q = ``queries_per_request`` query tokens each (S + 1 under speculation)."""
        return max_running(self.dev_cache_size, top_k, queries_per_request=queries_per_request)

    def min_dev_cache_size(
        self, max_running_requests: int, topk: int, chunk_size: int, *, queries_per_request: int = 1
    ) -> int:
        """Smallest N_G that holds one decode (or verify) step's selections and one
        prefill chunk."""
        running = max(1, max_running_requests)
        return max(
            dev_cache_for(running, topk, queries_per_request=queries_per_request), chunk_size
        )

    def check_verify_batch(
        self, batch: int, top_k: int, queries_per_request: int, batch_flag: str = "--batch-size"
    ) -> None:
        """Refuse, at start-up, a speculative batch whose verify step cannot be resident:
        each of its ``batch`` requests verifies Q = ``queries_per_request`` tokens, each
        selecting up to ``top_k`` tokens per layer (the rule with Q). The message names the
        largest batch that fits and the N_G that would fit this one, so either can be
        changed without working the rule out by hand; ``batch_flag``: the entry point's
        flag for the batch (generate's --batch-size, the server's --max-running-requests).
        No-op without offload."""
        if not self.offload:
            return
        fits = self.max_running(top_k, queries_per_request=queries_per_request)
        if batch <= fits:
            return
        need = dev_cache_for(batch, top_k, queries_per_request=queries_per_request)
        lower = f"lower {batch_flag} to {fits}" if fits else "no batch fits"
        raise ConfigError(
            f"{ENV_DEV_CACHE}={self.dev_cache_size} (N_G) is too small for speculative "
            f"decoding: a verify step of {batch} requests x Q {queries_per_request} query "
            f"tokens (S + 1) x top-k {top_k} selects up to {need} tokens per layer; the "
            f"largest batch that fits is {fits} ({lower}), or set {ENV_DEV_CACHE} >= {need} "
            f"for a batch of {batch}, or lower --speculative-num-steps."
        )

    def validate(
        self, *, host_tokens: int, max_running_requests: int, topk: int, chunk_size: int
    ) -> None:
        if host_tokens < 1:
            raise ConfigError(f"the host pool must hold >= 1 token, got {host_tokens}.")
        if max_running_requests < 1:
            raise ConfigError(f"max running requests must be >= 1, got {max_running_requests}.")
        if self.eviction_reserve > max_eviction_reserve(self.dev_cache_size):
            raise ConfigError(
                f"{ENV_EVICTION_RESERVE}={self.eviction_reserve} would keep more than half of "
                f"the {self.dev_cache_size} device slots ({ENV_DEV_CACHE}) free after each "
                f"eviction; use at most {max_eviction_reserve(self.dev_cache_size)} (a few "
                "thousand is plenty)."
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


__all__ = [  # this module's names and the registry's, re-exported (env_settings.py)
    "APPLIES_TO",
    "DECODE_PREFETCH_MODES",
    "DEFAULT_DECODE_PREFETCH",
    "DEFAULT_DEV_CACHE_SIZE",
    "DEFAULT_RESOLVE_OVERLAP_FROM",
    "DEFAULT_STAGE_BYTES",
    "ENV_BATCH_INVARIANT",
    "ENV_DECODE_PLACE",
    "ENV_DEV_CACHE",
    "ENV_ENGINE_PROFILE",
    "ENV_EVICTION_RESERVE",
    "ENV_FUSE_DECODE",
    "ENV_FUSE_EXTEND",
    "ENV_OFFLOAD",
    "ENV_PDL",
    "ENV_RESOLVE_OVERLAP",
    "ENV_SPARSE_MLA",
    "EXTERNAL_VARIABLES",
    "MARKDOWN_HEADER",
    "MAX_DEFAULT_EVICTION_RESERVE",
    "MAX_STAGE_ROWS",
    "REGISTRY",
    "SPARSE_MLA_BACKENDS",
    "STAGE_ROWS_ALIGN",
    "VARIABLES",
    "ConfigError",
    "EchoConfig",
    "EchoSettings",
    "HelpFormatter",
    "Variable",
    "decode_prefetch_mode",
    "default_eviction_reserve",
    "default_stage_rows",
    "dev_cache_for",
    "eviction_reserve_in_force",
    "help_epilog",
    "load_settings",
    "main",
    "markdown",
    "max_eviction_reserve",
    "max_running",
    "offload_requested",
    "parse_choice",
    "parse_count",
    "parse_dev_cache_size",
    "parse_flag",
    "parse_path",
    "parse_reserve",
    "parse_size",
    "parse_switch_on",
    "reset_settings",
    "settings",
]

if __name__ == "__main__":
    sys.exit(main())
