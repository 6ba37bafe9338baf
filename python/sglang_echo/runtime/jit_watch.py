"""Which Triton kernel specializations a server compiles, when, and for how long.

Why: Triton compiles a kernel once per specialization (each constexpr value, and each int
argument that becomes 1 or a multiple of 16), on the thread that launches it, when it is
first launched. Start-up captures every decode graph, but a prefill or transfer shape met
for the first time mid-run compiles there, and every request waits behind it (a batch of
short chats at once showed one such stall: every request's first token came seconds late).
This watch makes such a stall visible and attributable: each compile is logged with the
kernel's name and specialization, and ``/metrics`` counts them and their seconds
(``sglang:triton_compiles_total``), so a benchmark reads the compiles of its own run as a
counter delta (goal 0, as for graph captures during a run).

A "compile" here is a miss of the kernel's in-memory cache: it may be served from Triton's
disk cache (fast) or really compiled (slow); the seconds tell which. Nothing is counted
under ``TRITON_INTERPRET=1`` (the interpreter compiles nothing).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import Counter
from typing import Any

log = logging.getLogger("sglang_echo.jit")


class JitWatch:
    """Counts compiles through Triton's two JIT hooks (before and after each compile),
    chaining whatever hooks were installed before it."""

    def __init__(self) -> None:
        self.compiles = 0
        self.seconds = 0.0
        self.by_kernel: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._started: dict[tuple[int, Any], float] = {}  # (thread, key) -> start
        self._previous: tuple[Any, Any] | None = None  # the hooks we replaced
        # Set when the engine starts serving: a compile from then on is logged as a warning
        # (requests wait behind it), one during start-up at debug level.
        self.serving = False

    @property
    def installed(self) -> bool:
        return self._previous is not None

    def install(self) -> bool:
        """Register the hooks (once); False where Triton has no JIT hooks to register."""
        if self.installed:
            return True
        runtime = _runtime_knobs()
        if runtime is None:
            return False
        self._previous = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
        runtime.jit_cache_hook = self.before_compile
        runtime.jit_post_compile_hook = self.after_compile
        return True

    def uninstall(self) -> None:
        """Put back the hooks found at ``install``."""
        if self._previous is None:
            return
        runtime = _runtime_knobs()
        if runtime is not None:
            runtime.jit_cache_hook, runtime.jit_post_compile_hook = self._previous
        self._previous = None

    def before_compile(self, **kwargs: Any) -> Any:
        """Triton's ``jit_cache_hook``: a specialization missed the in-memory cache. A true
        return would make Triton skip the compile, so only a chained hook decides it."""
        with self._lock:
            self._started[(threading.get_ident(), _key(kwargs))] = time.perf_counter()
        previous = self._previous[0] if self._previous else None
        return previous(**kwargs) if previous is not None else None

    def after_compile(self, **kwargs: Any) -> Any:
        """Triton's ``jit_post_compile_hook``: that specialization is ready."""
        now = time.perf_counter()
        name = _kernel_name(kwargs)
        with self._lock:
            started = self._started.pop((threading.get_ident(), _key(kwargs)), now)
            self.compiles += 1
            self.seconds += now - started
            self.by_kernel[name] += 1
        level = logging.WARNING if self.serving else logging.DEBUG
        log.log(
            level,
            "compiled %s in %.3f s%s; specialization %s",
            name,
            now - started,
            " while serving (before the ready line: the warm-up's; after it: a shape start-up"
            " did not cover)"
            if self.serving
            else "",
            _specialization(kwargs),
        )
        previous = self._previous[1] if self._previous else None
        return previous(**kwargs) if previous is not None else None

    def counters(self) -> dict[str, float]:
        """``compiles`` and ``seconds`` so far (for /metrics)."""
        with self._lock:
            return {"compiles": float(self.compiles), "seconds": self.seconds}


def _runtime_knobs() -> Any:
    try:
        from triton import knobs
    except ImportError:  # no Triton, or one without knobs: nothing to watch
        return None
    runtime = getattr(knobs, "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
        return None
    return runtime


def _key(kwargs: dict) -> Any:
    key = kwargs.get("key")
    try:
        hash(key)
    except TypeError:
        return repr(key)
    return key


def _specialization(kwargs: dict, limit: int = 600) -> str:
    """The argument part of Triton's cache key (types, value and alignment flags), which
    says what made this variant new. Triton 3.6's own ``repr`` drops it (it reads a
    character of the key string as the signature)."""
    key = str(kwargs.get("key", ""))
    options = re.search(r"\w*Options\(", key)  # the key: str(specialization) + str(options)
    return (key[: options.start()] if options else key)[:limit]


def _kernel_name(kwargs: dict) -> str:
    fn = kwargs.get("fn")
    name = getattr(fn, "name", None)
    module = getattr(fn, "module", None)
    if name is None:
        return "?"
    return f"{module}.{name}" if module else str(name)


WATCH = JitWatch()


def install() -> bool:
    """The process's watch, installed (idempotent); False without Triton's hooks."""
    return WATCH.install()
