"""ECHO's environment variables: the one registry, parsed once per process, validated up front.

Every check here exists so that a bad setting fails at start-up with a message that says
what to change, never later inside a kernel. (The offload configuration those settings
feed, ``EchoConfig``, and its capacity rules live in ``config.py``, which re-exports every
name of this module, so ``from sglang_echo.config import settings`` keeps working.)

The registry (``VARIABLES``) names every environment variable this package reads: its
default, where it applies (this project's runtime, the SGLang plugin, or both), whether
users are meant to set it (public) or it is a knob for benchmarks and debugging
(internal), a one-line description and its parser. ``EchoSettings.from_env`` parses
them into one frozen object (all of them for the runtime; for the plugin those it reads,
so that a runtime-only knob can neither change nor fail an sglang launch), and each bad
value raises ``ConfigError`` naming the variable, the value and what to set.
``python -m sglang_echo.config --markdown`` prints the table of docs/CONFIGURATION.md
(tests/test_env_registry.py checks that the committed file equals it).

Parsed once per process. ``load_settings()`` parses ``os.environ`` and makes the result
the process's settings: the runtime's start-ups call it (``runtime.serving.build_serving``
for the server, ``generate.run``), and so do the SGLang plugin's ``register()``, which
SGLang runs early in every process, and its argument resolution in the launcher.
Only the entry points read ``settings()`` after that (the server and its engine,
``generate``, the plugin, the benchmarks): a library user that never started anything
gets the environment parsed on first use, then the same object. No module but this one
reads ``os.environ`` for a registered name (tested).

Settings are handed down, never looked up below the entry points: ``model/``,
``offload/`` and ``kernels/`` call no ``settings()`` (tests/test_settings_handed_down.py).
Each switch is a parameter whose value the entry point passes from ``settings()``:
``SGLANG_ECHO_SPARSE_MLA`` and ``SGLANG_ECHO_BATCH_INVARIANT`` reach the model as its
``ModelKernels`` (``load_model(..., kernels=)``, ``DeepseekV32ForCausalLM(config, kernels=)``;
the NextN draft layer gets the batch-invariant mode from ``model.layers.set_batch_invariant``),
and ``SGLANG_ECHO_PDL`` reaches the caches as ``pdl=`` (``HiSparseKVCache(..., pdl=)``,
``offload.manager.EchoManager``), which pass it to ``use_pdl(device, asked)``,
``recall_rows(..., pdl=)`` and ``AllocWorkspace(..., pdl=)``. Every such default equals
the registry's default, so code called directly (tests, benchmarks, a library user)
behaves as an unset variable does.

Where the registry lives: here, at the package root, importing only the standard library,
so the plugin can read it before anything heavy loads. ``kernels/`` may import nothing
above itself (tests/test_import_direction.py, docs/ARCHITECTURE.md section 1); moving the
registry into ``kernels/`` instead would have put ECHO's and the plugin's settings under
the Triton package, and a process-wide setter inside ``kernels/`` would have hidden the
value a launch uses.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

ENV_OFFLOAD = "NSA_KV_OFFLOAD"
ENV_DEV_CACHE = "NSA_DEV_CACHE_SIZE"
ENV_FUSE_DECODE = "SGLANG_NSA_FUSE_LOGITS_RECALL_DECODE"
ENV_FUSE_EXTEND = "SGLANG_NSA_FUSE_LOGITS_RECALL_EXTEND"
# Extra victims a step takes whenever it must evict, left free for the next steps (which
# then scan no slots): 0 = evict exactly the misses' worth. Unset: N_G / 32, at most 8192
# (rounded up). Why: a step that must evict scans every slot; with the reserve the next
# steps' misses fit the free stack and scan nothing. On the H200 a reserve of 8192 in 260K
# slots made cache management faster per layer-step at batch 48 with the hit rate unchanged
# (that run: docs/ARCHITECTURE.md section 15, "Measured choices"; the default's run is
# cache_ops.json, the evidence row "cache-management kernels").
ENV_EVICTION_RESERVE = "SGLANG_ECHO_EVICTION_RESERVE"
ENV_PDL = "SGLANG_ECHO_PDL"
# 1 (default): a decode step's new tokens also take a free device slot as their host rows
# are written (kernels/decode_write.py), so the step's top-k finds them resident; 0: host
# only, and the resolve recalls each one it selects (the A/B of benchmark/e2e_study.py).
ENV_DECODE_PLACE = "SGLANG_ECHO_DECODE_PLACE"
# N: a decode step of N tokens or more runs its resolve on a side stream beside the
# query's up-projection (model/attention.py resolves_beside), smaller ones in line; 1:
# every step beside, 0: every step in line, on the main stream.
ENV_RESOLVE_OVERLAP = "SGLANG_ECHO_RESOLVE_OVERLAP"
ENV_SPARSE_MLA = "SGLANG_ECHO_SPARSE_MLA"
# 1: every matmul and norm of the model's forward by the batch-invariant GEMM
# (kernels/invariant_matmul.py), handed to the model as ModelKernels.batch_invariant. Why:
# served ECHO decodes more requests per step than no-offload, and cuBLAS (MKL on the CPU)
# rounds a row by the batch's size, so at high load the two served runs' greedy tokens
# could differ though each is lossless at equal batches. Off by default: the fixed-tile
# GEMM is slower than cuBLAS, and the default path stays as it was.
ENV_BATCH_INVARIANT = "SGLANG_ECHO_BATCH_INVARIANT"
# A path: the engine thread runs under cProfile and writes PATH (pstats) and PATH.txt (the
# top functions by cumulative time) when it stops; "{pid}" in it becomes the process id
# (several servers, one setting). It slows the host side, so not for timed runs.
ENV_ENGINE_PROFILE = "ECHO_ENGINE_PROFILE"
DEFAULT_DEV_CACHE_SIZE = 260_000
# The smallest decode batch (tokens) whose resolve runs on the side stream: below it the
# join costs more than the overlap hides (benchmark/results/itl_ab/resolve_overlap_ab.json).
DEFAULT_RESOLVE_OVERLAP_FROM = 16
MAX_DEFAULT_EVICTION_RESERVE = 8192
DECODE_PREFETCH_MODES = ("auto", "0", "1")  # ENV_FUSE_DECODE; the first is the default
DEFAULT_DECODE_PREFETCH = DECODE_PREFETCH_MODES[0]
# The sparse-MLA path (model/attention.py); the first is the default.
SPARSE_MLA_BACKENDS = ("auto", "torch", "kernel")
APPLIES_TO = ("runtime", "plugin", "both")


class ConfigError(ValueError):
    """A setting that cannot work; the message names the setting and the fix."""


# ----------------------------------------------------------------------------- parsers
# Each takes (name, raw) with raw None for an unset variable, and returns the value in
# force or raises ConfigError with the name, the raw value and what to set.


def parse_flag(name: str, raw: str | None) -> bool:
    """A switch that is off unless set to 1."""
    if raw is None or raw.strip() in ("", "0"):
        return False
    if raw.strip() == "1":
        return True
    raise ConfigError(f"{name}={raw!r} is not understood; set it to 1 (on) or 0 (off).")


def parse_switch_on(name: str, raw: str | None) -> bool:
    """A switch that is on unless set to 0 (unset or empty: on)."""
    if raw is None or not raw.strip():
        return True
    return parse_flag(name, raw)


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


def parse_dev_cache_size(name: str, raw: str | None) -> int:
    """N_G: a size, ``DEFAULT_DEV_CACHE_SIZE`` when unset (set but empty is an error)."""
    return DEFAULT_DEV_CACHE_SIZE if raw is None else parse_size(name, raw)


def parse_overlap_from(name: str, raw: str | None) -> int:
    """A batch size from which a switch applies: unset or empty the default, ``0`` never,
    ``1`` always (what ``0``/``1`` meant when the variable was an on/off switch)."""
    if raw is None or not raw.strip():
        return DEFAULT_RESOLVE_OVERLAP_FROM
    text = raw.strip()
    if not (text.isascii() and text.isdigit()):
        raise ConfigError(
            f"{name}={raw!r} is not a batch size; use e.g. {name}={DEFAULT_RESOLVE_OVERLAP_FROM} "
            "(0: every step in line, 1: every step beside)."
        )
    return int(text)


def parse_reserve(name: str, raw: str | None) -> int | None:
    """A count; None when unset (the default for the cache's N_G applies)."""
    return None if raw is None else parse_count(name, raw)


def parse_choice(choices: tuple[str, ...]) -> Callable[[str, str | None], str]:
    """One of ``choices`` (case and spaces ignored); unset or empty: the first."""

    def parse(name: str, raw: str | None) -> str:
        value = (raw or "").strip().lower() or choices[0]
        if value not in choices:
            raise ConfigError(
                f"{name}={raw!r} is not understood; set it to one of {', '.join(choices)} "
                f"(or leave it unset for {choices[0]})."
            )
        return value

    return parse


def parse_path(name: str, raw: str | None) -> str | None:
    """A file path; unset or empty: None."""
    return raw or None


def default_eviction_reserve(dev_cache_size: int) -> int:
    """N_G / 32 rounded up, at most 8192 (and at most half the cache): a step that evicts
    leaves this many slots free, so the next few steps' misses fit without a scan, while
    the cache gives up at most a 32nd of its capacity to free slots. Rounded up so that every
    cache of two slots or more runs with a reserve: the configuration served is the one
    tested, small test caches included."""
    return min(
        MAX_DEFAULT_EVICTION_RESERVE, -(-dev_cache_size // 32), max_eviction_reserve(dev_cache_size)
    )


def max_eviction_reserve(dev_cache_size: int) -> int:
    """The largest eviction reserve an N_G = ``dev_cache_size`` cache takes: half its
    slots (more would keep most of the cache free after each eviction)."""
    return dev_cache_size // 2


def eviction_reserve_in_force(dev_cache_size: int, asked: int | None) -> int:
    """The eviction reserve of an N_G = ``dev_cache_size`` cache: ``asked``
    (SGLANG_ECHO_EVICTION_RESERVE) when set, else ``default_eviction_reserve``. The one
    place an unset reserve becomes a number: ``EchoConfig``, ``EchoSettings.shown``, the
    plugin's cache (sglang/storage.py) and its sizing (sglang/sizing.py) call it."""
    return default_eviction_reserve(dev_cache_size) if asked is None else asked


# ---------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class Variable:
    """One environment variable of the registry."""

    name: str
    setting: str  # the EchoSettings field it sets
    default: str  # the value in force when unset, as the docs write it
    # Who reads it: "runtime" (this project's server and generate), "plugin", or "both".
    applies_to: str
    public: bool  # documented for users (README); internal: benchmarks and debugging
    description: str  # one line
    parse: Callable[[str, str | None], Any]  # (name, raw or None when unset) -> value


VARIABLES: tuple[Variable, ...] = (
    Variable(
        ENV_OFFLOAD, "offload", "0", "both", True,
        "`1` = ECHO on; `0`/unset = the plain KV pool (the SGLang plugin then does nothing)",
        parse_flag,
    ),
    Variable(
        ENV_DEV_CACHE, "dev_cache_size", "260_000", "both", True,
        "N_G, ECHO's device cache slots per layer (underscores allowed); must hold one "
        "decode step's selections (max running requests x top-k) and one prefill chunk",
        parse_dev_cache_size,
    ),
    Variable(
        ENV_FUSE_DECODE, "fuse_decode", "auto", "both", True,
        "with ECHO, decode intra-query prefetch (output unchanged): `auto` on decode steps "
        "after one that missed >= 7% of its selections (where it paid on an H200), `1` every "
        "step (likely misses are staged while the indexer runs), `0` off; the SGLang plugin "
        "stages from sglang's own indexer logits with `1` and runs `auto` as `0`",
        parse_choice(DECODE_PREFETCH_MODES),
    ),
    Variable(
        ENV_FUSE_EXTEND, "fuse_extend", "0", "both", True,
        "`1`, with ECHO: prefill inter-query prefetch (output unchanged; off by default: "
        "slower in isolation, evidence row \"prefill prefetch\"); the SGLang plugin logs "
        "that it does not apply there",
        parse_flag,
    ),
    Variable(
        ENV_EVICTION_RESERVE, "eviction_reserve", "N_G / 32 rounded up, at most 8192",
        "both", False,
        "extra victims a step takes whenever it must evict, left free for the next steps' "
        "misses (at most half of N_G); `0` = exactly the misses' worth",
        parse_reserve,
    ),
    Variable(
        ENV_PDL, "pdl", "1", "both", False,
        "`1`: the cache-management and recall kernels chain by programmatic dependent "
        "launch on sm_90 (`kernels/pdl.py`); `0`: plain launches",
        parse_switch_on,
    ),
    Variable(
        ENV_DECODE_PLACE, "decode_place", "1", "runtime", False,
        "`1`: a decode step's new tokens are written to the host pool and, while free "
        "slots last, to the device cache in the same launch (`kernels/decode_write.py`), "
        "and a decode node's transferred prompt is placed in free slots too (never "
        "evicting; oldest priority); `0`: host only (the step's resolve recalls each row "
        "it selects)",
        parse_switch_on,
    ),
    Variable(
        ENV_RESOLVE_OVERLAP, "resolve_overlap", str(DEFAULT_RESOLVE_OVERLAP_FROM), "runtime",
        False,
        "N: on CUDA the resolve (cache management, recall) of a decode step of N tokens or "
        "more runs on a side stream while the query's up-projection runs "
        "(`model/attention.py`); smaller steps, where the join costs more than it hides, "
        "run it in line; `1`: every step beside, `0`: every step in line",
        parse_overlap_from,
    ),
    Variable(
        ENV_SPARSE_MLA, "sparse_mla", "auto", "runtime", False,
        "`auto`: the Triton kernel (`kernels/sparse_mla.py`) on CUDA, torch on the CPU; "
        "`torch` or `kernel` forces one (lossless either way)",
        parse_choice(SPARSE_MLA_BACKENDS),
    ),
    Variable(
        ENV_BATCH_INVARIANT, "batch_invariant", "0", "runtime", False,
        "`1`: every matmul and norm of the model's forward runs the batch-invariant GEMM "
        "(`kernels/invariant_matmul.py`; MoE sums in a fixed order), so a request's tokens "
        "do not depend on how many others share its batch (served ECHO vs no-offload); "
        "needs CUDA (or TRITON_INTERPRET=1); slower; `0`: cuBLAS/MKL",
        parse_flag,
    ),
    Variable(
        ENV_ENGINE_PROFILE, "engine_profile", "unset", "runtime", False,
        "a path: the engine thread runs under cProfile and writes PATH and PATH.txt when it "
        "stops (`{pid}` = the process id); slows the host side",
        parse_path,
    ),
)  # fmt: skip
REGISTRY: dict[str, Variable] = {v.name: v for v in VARIABLES}

# Read by this package but owned by other tools: not parsed here (Triton reads
# TRITON_INTERPRET itself when it is imported, and SGLang its plugin filter).
EXTERNAL_VARIABLES: dict[str, str] = {
    "TRITON_INTERPRET": "Triton: `1` runs the Triton kernels on the CPU (the tests set it); "
    "the kernels then take their interpreter paths",
    "SGLANG_PLUGINS": "SGLang's plugin filter: if set, it must name `echo` for the plugin to load",
    "OMP_NUM_THREADS": "torch's CPU threads: if set, the server's CUDA engine keeps it; unset, "
    "the engine runs its host ops on one thread (runtime/host_threads.py)",
}


@dataclass(frozen=True)
class RetiredVariable:
    """A variable that switched between designs until one lost its A/B. Set to anything
    but ``runs_as``, its readers' start-up fails instead of running a design that no longer
    exists (docs/ARCHITECTURE.md section 15 names the records that decided)."""

    name: str
    runs_as: str  # the value that still describes what runs (harmless when set)
    applies_to: str  # who read it, as Variable.applies_to: only they refuse it
    why: str  # why the other values are gone


RETIRED_VARIABLES: tuple[RetiredVariable, ...] = (
    RetiredVariable(
        "SGLANG_ECHO_TOPK", "radix", "runtime",
        "the radix select (kernels/topk.py) is the only kernel top-k; FlashInfer's was "
        'slower under the same contract (docs/EVIDENCE.md, row "top-k peer (FlashInfer, issue 15)")',
    ),
)  # fmt: skip


def refuse_retired(env: Mapping[str, str], reader: str) -> None:
    """Fail on a retired variable ``reader`` read, set to a design that is gone; one only
    the other side read fails nothing there, as a live one would."""
    for v in RETIRED_VARIABLES:
        raw = env.get(v.name) if v.applies_to in (reader, "both") else None
        if raw is not None and raw.strip().lower() not in ("", v.runs_as):
            raise ConfigError(f"{v.name}={raw!r} is retired: {v.why}; unset {v.name}")


@dataclass(frozen=True)
class EchoSettings:
    """Every registered variable's value in force (field defaults = unset variables)."""

    offload: bool = False
    dev_cache_size: int = DEFAULT_DEV_CACHE_SIZE
    fuse_decode: str = DEFAULT_DECODE_PREFETCH
    fuse_extend: bool = False
    eviction_reserve: int | None = None  # None: default_eviction_reserve(N_G)
    pdl: bool = True
    decode_place: bool = True
    resolve_overlap: int = DEFAULT_RESOLVE_OVERLAP_FROM
    sparse_mla: str = SPARSE_MLA_BACKENDS[0]
    batch_invariant: bool = False
    engine_profile: str | None = None
    # Not settings: who parsed them ("runtime" or "plugin": the variables read there; the
    # others keep their defaults) and which names the environment set (for the log).
    reader: str = field(default="runtime", compare=False)
    from_environment: frozenset[str] = field(default=frozenset(), compare=False)

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, reader: str = "runtime"
    ) -> EchoSettings:
        """Parse the registered variables that ``reader`` ("runtime" or "plugin") reads,
        from ``environ`` (default ``os.environ``), in the registry's order; the first bad
        value raises its ConfigError. The others keep their defaults: the plugin neither
        uses nor fails on a variable of this project's runtime alone."""
        if reader not in ("runtime", "plugin"):
            raise ValueError(f"reader must be 'runtime' or 'plugin', got {reader!r}")
        env = os.environ if environ is None else environ
        refuse_retired(env, reader)
        read = [v for v in VARIABLES if v.applies_to in (reader, "both")]
        return cls(
            **{v.setting: v.parse(v.name, env.get(v.name)) for v in read},
            reader=reader,
            from_environment=frozenset(v.name for v in read if v.name in env),
        )

    def read_here(self) -> list[Variable]:
        """The variables this process's reader parsed (the others are not in force)."""
        return [v for v in VARIABLES if v.applies_to in (self.reader, "both")]

    def shown(self, name: str) -> str:
        """A variable's value in force as one could set it (``1``/``0`` for switches)."""
        value = getattr(self, REGISTRY[name].setting)
        if name == ENV_EVICTION_RESERVE:
            value = eviction_reserve_in_force(self.dev_cache_size, value)
        if isinstance(value, bool):
            return "1" if value else "0"
        if value is None:
            return "(unset)"
        if isinstance(value, int):
            return f"{value:_}"
        return str(value)

    def summary(self) -> str:
        """One line: the value in force of every variable read here, ``*`` after those the
        environment set."""
        words = [
            f"{v.name}={self.shown(v.name)}{'*' if v.name in self.from_environment else ''}"
            for v in self.read_here()
        ]
        return "settings in force (* = from the environment): " + " ".join(words)


# ------------------------------------------------------------- the process's settings
_process_settings: EchoSettings | None = None


def load_settings(
    environ: Mapping[str, str] | None = None, reader: str = "runtime"
) -> EchoSettings:
    """Start-up: parse the environment (default ``os.environ``) as ``reader`` reads it (the
    plugin passes "plugin") and make the result the process's settings, which
    ``settings()`` returns from then on."""
    global _process_settings
    loaded = EchoSettings.from_env(environ, reader)
    _process_settings = loaded
    return loaded


def settings() -> EchoSettings:
    """The process's settings: those the start-up loaded, else ``os.environ`` parsed now
    (once: later calls return the same object)."""
    return _process_settings if _process_settings is not None else load_settings()


def reset_settings() -> None:
    """Forget the process's settings; the next ``settings()`` parses the environment again
    (tests that change the environment)."""
    global _process_settings
    _process_settings = None


def offload_requested(environ: Mapping[str, str] | None = None) -> bool:
    """``NSA_KV_OFFLOAD`` alone: the plugin asks this first, so that a plain sglang launch
    never parses (nor fails on) ECHO's other variables."""
    env = os.environ if environ is None else environ
    return REGISTRY[ENV_OFFLOAD].parse(ENV_OFFLOAD, env.get(ENV_OFFLOAD))


# ------------------------------------------------------------------ help and the docs
class HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, except that a text with line breaks (the environment epilog)
    keeps them; one-paragraph texts are wrapped as usual."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" not in text:
            return super()._fill_text(text, width, indent)
        return "".join(indent + line for line in text.splitlines(keepends=True))


def help_epilog(environ: Mapping[str, str] | None = None, width: int = 88) -> str:
    """The public variables with the values in force, for a CLI's ``--help``; a value
    that would fail start-up is shown with its error instead of failing the help."""
    env = os.environ if environ is None else environ
    lines = ["environment (values in force; all variables: docs/CONFIGURATION.md):"]
    for v in VARIABLES:
        if not v.public:
            continue
        raw = env.get(v.name)
        try:
            value = v.parse(v.name, raw)
            shown = EchoSettings(**{v.setting: value}).shown(v.name)
            where = "set" if raw is not None else "default"
            head = f"{v.name}={shown} ({where})"
        except ConfigError as exc:  # start-up will fail with this message
            head = str(exc).rstrip(".")
        text = f"{head}: {v.description}"
        lines += textwrap.wrap(text, width, initial_indent="  ", subsequent_indent="      ")
    return "\n".join(lines) + "\n"


MARKDOWN_HEADER = """\
# Configuration: environment variables

<!-- Generated by `python -m sglang_echo.config --markdown` from the registry in
python/sglang_echo/env_settings.py (VARIABLES); tests/test_env_registry.py checks that this
file equals that output. Edit the registry, then regenerate:
python -m sglang_echo.config --markdown > docs/CONFIGURATION.md -->

Every variable below is parsed once per process, at start-up (`config.load_settings()`:
this project's server and `generate`, and the SGLang plugin's `register()` in every
sglang process and its argument resolution in the launcher); code reads the parsed,
frozen `config.settings()` after that. A bad value fails start-up with one line naming
the variable, the value and what to set. Public variables are the user-facing interface
(README); internal ones are knobs for benchmarks and debugging whose default is what
runs. `python -m sglang_echo.launch_server --help` and `python -m sglang_echo.generate
--help` list the public variables with the values in force; the server's start-up log
prints every variable's value in force (`python -m sglang_echo.config` prints it too).
Applies to (who reads it): `runtime` = this project's server and `generate`; `plugin` =
the SGLang plugin; `both`. The plugin parses only the variables it reads, so a bad value
of a runtime-only one cannot fail an sglang launch.
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown() -> str:
    """docs/CONFIGURATION.md: the registry as a table, then the other tools' variables."""
    rows = [
        "| variable | default | applies to | public | description |",
        "| --- | --- | --- | --- | --- |",
    ]
    for v in VARIABLES:
        public = "public" if v.public else "internal"
        rows.append(
            f"| `{v.name}` | {_cell(v.default)} | {v.applies_to} | {public} | "
            f"{_cell(v.description)} |"
        )
    external = [
        "Read by this package but owned by other tools (not parsed by the registry):",
        "",
        "| variable | meaning |",
        "| --- | --- |",
        *(f"| `{name}` | {_cell(text)} |" for name, text in EXTERNAL_VARIABLES.items()),
        "",
        "Retired (its readers' start-up fails if one is set to anything but the value that runs):",
        "",
        "| variable | runs as | applied to | why |",
        "| --- | --- | --- | --- |",
        *(
            f"| `{v.name}` | {v.runs_as} | {v.applies_to} | {_cell(v.why)} |"
            for v in RETIRED_VARIABLES
        ),
    ]
    return MARKDOWN_HEADER + "\n" + "\n".join(rows) + "\n\n" + "\n".join(external) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m sglang_echo.config",
        description="ECHO's environment variables: print the values in force (default), "
        "or the docs/CONFIGURATION.md table.",
    )
    p.add_argument("--markdown", action="store_true", help="print docs/CONFIGURATION.md")
    args = p.parse_args(argv)
    if args.markdown:
        sys.stdout.write(markdown())
        return 0
    try:
        current = EchoSettings.from_env()
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for v in VARIABLES:
        mark = "" if v.name in current.from_environment else "  (default)"
        print(f"{v.name}={current.shown(v.name)}{mark}")
    return 0
