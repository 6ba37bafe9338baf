"""The model runs in one background thread; other threads talk to it through a queue.

HTTP handlers (or tests) ``submit`` requests, ``abort`` them and ``call`` small functions
that must see the scheduler between steps (metrics read device counters, which must not
race a running or capturing step). Every command is applied by the engine thread, so the
scheduler and the caches are only ever touched by that one thread.
"""

from __future__ import annotations

import cProfile
import logging
import os
import pstats
import queue
import sys
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from sglang_echo.config import ENV_ENGINE_PROFILE, settings
from sglang_echo.runtime import jit_watch, metrics
from sglang_echo.runtime.request import ServeRequest
from sglang_echo.runtime.scheduler import Scheduler
from sglang_echo.runtime.streams import on_engine_stream

log = logging.getLogger("sglang_echo.engine")

# ECHO_ENGINE_PROFILE, a path (config.py; settings().engine_profile): the engine thread
# runs under cProfile and writes PATH (pstats) and PATH.txt (the top functions by
# cumulative time) when it stops; "{pid}" in it becomes the process id (several servers,
# one setting). For finding where a phase of the engine clock goes; it slows the host
# side, so not for timed runs.
PROFILE_ENV = ENV_ENGINE_PROFILE
ENGINE_SWITCH_INTERVAL_S = 5e-4


class EngineLoop:
    def __init__(self, scheduler: Scheduler, idle_wait_s: float = 0.05) -> None:
        self.scheduler = scheduler
        self.idle_wait_s = idle_wait_s
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._draining = threading.Event()
        self._thread = threading.Thread(target=self._run, name="echo-engine", daemon=True)
        self.last_error: str | None = None
        self.fatal_error: str | None = None  # why the engine stopped for good, if it did

    # ------------------------------------------------------------ any thread
    def start(self) -> None:
        # Every torch call of the engine thread drops and retakes the GIL; while an HTTP
        # thread runs Python (parsing a 100K-token request, streaming tokens) a retake
        # waits up to the switch interval (CPython's default: milliseconds) per call, and a
        # step makes dozens. ENGINE_SWITCH_INTERVAL_S, a tenth of that default, bounds that
        # wait; the HTTP threads switch a little more often.
        sys.setswitchinterval(min(sys.getswitchinterval(), ENGINE_SWITCH_INTERVAL_S))
        jit_watch.WATCH.serving = True  # compiles from here on stall requests: warned
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put(None)  # wake the loop
        if self._thread.is_alive():
            self._thread.join(timeout)

    def drain(self, message: str = "server shutting down") -> None:
        """Refuse new requests and end every queued and running one with ``message``.

        Called on SIGTERM, so that open streams end at once and the HTTP server can stop
        instead of waiting for every generation to run to its end.
        """
        self._draining.set()
        self._commands.put(("fail_all", message))

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not (self._stop.is_set() or self._draining.is_set())

    def submit(self, req: ServeRequest) -> None:
        """Queue ``req``; its ``on_output`` gets the events (from the engine thread).

        A request the scheduler rejects ends at once with an abort event carrying why.
        """
        self._commands.put(("add", req))

    def abort(self, rid: str) -> None:
        self._commands.put(("abort", rid))

    def snapshot(self) -> Future:
        """The metrics snapshot (runtime/metrics.py), taken on the engine thread."""
        return self.call(lambda s: metrics.snapshot(s, s.steps.kv_cache))

    def call(self, fn: Callable[[Scheduler], Any]) -> Future:
        """Run ``fn(scheduler)`` on the engine thread between steps; returns its future."""
        fut: Future = Future()
        self._commands.put(("call", (fn, fut)))
        return fut

    # ---------------------------------------------------------- engine thread
    def _apply(self, cmd) -> None:
        if cmd is None:
            return
        kind, arg = cmd
        sched = self.scheduler
        if kind == "add":
            try:
                sched.add(arg)
            except ValueError as exc:
                sched.reject(arg, str(exc))
        elif kind == "abort":
            sched.abort(arg)
        elif kind == "fail_all":
            sched.fail_all(arg)
        elif kind == "call":
            fn, fut = arg
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(sched))
                except Exception as exc:  # the caller gets the error, the loop goes on
                    fut.set_exception(exc)

    def _run(self) -> None:
        # Every step of this thread on the engine's high-priority stream (runtime/streams.py),
        # where the start-up graphs were captured.
        with on_engine_stream(self.scheduler.steps.device):
            path = settings().engine_profile
            if not path:
                self._serve()
                return
            profile = cProfile.Profile()
            profile.enable()
            try:
                self._serve()
            finally:
                profile.disable()
                write_profile(profile, path.replace("{pid}", str(os.getpid())))

    def _serve(self) -> None:
        stats = self.scheduler.stats
        while not self._stop.is_set():
            try:
                if not self.scheduler.has_work():
                    try:
                        with stats.timed("idle"):
                            cmd = self._commands.get(timeout=self.idle_wait_s)
                    except queue.Empty:
                        continue
                    with stats.timed("commands"):
                        self._apply(cmd)
                with stats.timed("commands"):
                    while True:
                        try:
                            self._apply(self._commands.get_nowait())
                        except queue.Empty:
                            break
                if not self._stop.is_set():
                    self.scheduler.step()
            except Exception as exc:
                # The scheduler ends a failed phase's requests itself; an error that escapes
                # it (admission, release) leaves every request in doubt: end them all with
                # the reason and keep serving new ones.
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.error("engine step failed:\n%s", traceback.format_exc())
                try:
                    self.scheduler.fail_all(f"engine error: {self.last_error}", 500)
                except Exception:
                    log.error("could not clean up after the failed step")
                if is_fatal_device_error(exc):
                    # The device context is lost (a sticky CUDA error): every later step
                    # would fail the same way. The engine stops, so /health answers 503
                    # with the reason and new requests are refused, instead of a server
                    # that accepts requests only to fail them.
                    self.fatal_error = self.last_error
                    log.critical("engine stopped: the device is unusable (%s)", self.last_error)
                    break
        self.scheduler.fail_all("server shutting down")
        if self.scheduler.prompt_source is not None:
            self.scheduler.prompt_source.close()
        log.info("engine thread time: %s", engine_time_summary(self.scheduler))


# CUDA errors after which the context is unusable (every later call fails the same way).
STICKY_DEVICE_ERRORS = (
    "device-side assert triggered",
    "an illegal memory access was encountered",
    "unspecified launch failure",
    "misaligned address",
    "illegal instruction",
)


def is_fatal_device_error(exc: BaseException) -> bool:
    """Whether ``exc`` says the device context is lost, not just that one step failed."""
    text = str(exc)
    return any(marker in text for marker in STICKY_DEVICE_ERRORS)


def engine_time_summary(sched: Scheduler) -> str:
    """One line for the server log: where the engine thread's time went, the model steps
    beside the host work around them, graph captures and a decode node's transfers."""
    s = sched.stats
    parts = [f"{k} {v:.2f} s (cpu {s.phase_cpu_s[k]:.2f})" for k, v in s.phase_s.items()]
    parts.append(f"{s.decode_steps} decode steps")
    runner = sched.steps.decode_runner
    if runner is not None:
        g = metrics.graph_counts(sched)
        parts.append(
            f"{g['captures']} graph captures {g['seconds']:.2f} s "
            f"({g['during_run']} during the run, {g['failures']} failed)"
        )
        runner.clock.poll(wait=True)
        if runner.clock.steps:
            parts.append(f"decode device time {runner.clock.total_seconds:.2f} s")
    source = sched.prompt_source
    if source is not None:
        parts.append(f"{source.transfers} transfers {source.transfer_s:.2f} s start to arrival")
    return ", ".join(parts)


def write_profile(profile: cProfile.Profile, path: str) -> None:
    """PATH (pstats, for snakeviz or pstats.Stats) and PATH.txt (readable)."""
    profile.dump_stats(path)
    with open(path + ".txt", "w") as f:
        stats = pstats.Stats(profile, stream=f).sort_stats("cumulative")
        stats.print_stats(60)
        stats.sort_stats("tottime").print_stats(30)
    log.info("engine thread profile written to %s (and .txt)", path)
