"""The engine in a process of its own, behind the HTTP front, over ZeroMQ.

Why: in one process the HTTP threads (parsing 100K-token bodies, streaming events) and the
engine thread share one GIL, and every torch call of the engine thread drops and retakes
it: the engine waits for Python it does not run. With ``--engine-process`` the front
process keeps HTTP, request validation, tokenization and the event streams; the engine
process builds the model and the KV cache and runs the scheduler (``EngineLoop``, as in
one process), with a receiver thread for commands and a sender thread for outputs. The
front talks to it through ``EngineProcessClient``, which offers what ``EngineLoop`` offers
the front (submit, abort, snapshot, drain, alive, fatal_error), so the API code is the same
in both modes; the in-process mode stays for tests and the offline tools.

Wire (two ipc sockets, PUSH -> PULL, one per direction; multipart messages):

- front -> engine: ``add`` [meta (pickled: rid, params, arrival, seed), prompt (int64
  bytes, sent without a copy)], ``abort`` [rid], ``snapshot`` [call id], ``drain``
  [message], ``stop``;
- engine -> front: ``ready`` [serving info], ``events`` [pickled list of OutputEvent: all
  the outputs since the last message, about one message per step], ``result`` [call id,
  pickled value or exception], ``fatal`` [why], ``failed`` [why: start-up failed].

A request's events go to the ``on_output`` it was submitted with. When the engine process
dies (a crash, ``kill -9``), the front sees it within ``WATCH_S``: every live request ends
with an abort of status 503 saying why, ``/health`` answers 503 with the reason, and new
requests are refused with it. Stopping ends the process (terminated, then killed, if it
does not exit in time) and reaps it: no zombie.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import pickle
import queue
import shutil
import signal
import tempfile
import threading
import time
from array import array
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from sglang_echo.runtime.detokenizer import IncrementalText
from sglang_echo.runtime.request import OutputEvent, ServeRequest

log = logging.getLogger("sglang_echo.engine_process")


@dataclass(frozen=True)
class _Frames:
    """A message for the engine process's one sending thread to send as it is."""

    frames: list


WATCH_S = 0.2  # how often the front checks that the engine process is alive
START_TIMEOUT_S = 1800.0  # model load + graph capture on a cold machine


def _zmq():
    try:
        import zmq
    except ImportError as exc:  # the [serve] extra brings it
        raise RuntimeError(
            "--engine-process needs pyzmq (pip install pyzmq, or sglang-echo[serve])"
        ) from exc
    return zmq


@dataclass
class FrontServing:
    """What the front needs of a ``Serving`` (runtime/serving.py) when the model lives in
    the engine process: the flags, the engine's info, the tokenizer."""

    args: Any
    info: dict
    tokenizer: object | None


# ---------------------------------------------------------------- engine side
def _die_with_parent() -> None:
    """Ask Linux to kill this process when its parent dies (PR_SET_PDEATHSIG): a front killed
    with SIGKILL must not leave an engine holding the GPU. Elsewhere the loop's parent check
    serves."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def engine_main(args, in_addr: str, out_addr: str, log_level: str = "info") -> None:
    """The engine process: build the serving stack, report ready, run the engine loop with a
    receiver thread for commands and a sender for outputs, until ``stop`` (or until the
    front is gone)."""
    parent = os.getppid()
    _die_with_parent()
    logging.basicConfig(
        level=log_level.upper(), format="[%(asctime)s] %(name)s %(levelname)s %(message)s"
    )
    zmq = _zmq()
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(in_addr)
    outbox = ctx.socket(zmq.PUSH)
    outbox.connect(out_addr)
    try:
        from sglang_echo.runtime.engine_loop import EngineLoop
        from sglang_echo.runtime.host_threads import limit_host_threads
        from sglang_echo.runtime.serving import build_serving

        serving = build_serving(args)
        limit_host_threads(serving.scheduler.steps.device)  # runtime/host_threads.py
    except Exception as exc:  # the front prints why and exits
        outbox.send_multipart([b"failed", f"{type(exc).__name__}: {exc}".encode()])
        outbox.close(linger=2000)
        ctx.term()
        return
    serving.scheduler.text_in_engine = False  # the front decodes the text
    engine = EngineLoop(serving.scheduler)
    # Everything the engine process sends after start-up goes through this queue to ONE
    # thread: a ZeroMQ socket is not thread-safe, and the engine thread (snapshot answers),
    # this loop (fatal) and the sender (events) writing it at once lost messages.
    pending: queue.SimpleQueue = queue.SimpleQueue()  # OutputEvent, _Frames, or None (stop)

    def sender() -> None:
        batch: list = []
        while True:
            item = pending.get()
            while True:  # everything queued since: about one events message per step
                if item is None or isinstance(item, _Frames):
                    if batch:
                        outbox.send_multipart([b"events", pickle.dumps(batch)])
                        batch = []
                    if item is None:
                        return
                    outbox.send_multipart(item.frames)
                else:
                    batch.append(item)
                try:
                    item = pending.get_nowait()
                except queue.Empty:
                    break
            if batch:
                outbox.send_multipart([b"events", pickle.dumps(batch)])
                batch = []

    send_thread = threading.Thread(target=sender, name="echo-engine-sender", daemon=True)
    send_thread.start()
    engine.start()
    pending.put(_Frames([b"ready", pickle.dumps(serving.info)]))
    reported = False
    while True:
        if engine.fatal_error and not reported:  # the device is lost: the front must know
            pending.put(_Frames([b"fatal", engine.fatal_error.encode()]))
            reported = True
        if not inbox.poll(int(WATCH_S * 1000)):
            if os.getppid() != parent:  # the front died: nobody will read the outputs
                log.error("the front process is gone; the engine stops")
                break
            continue
        frames = inbox.recv_multipart(copy=False)
        kind = bytes(frames[0].buffer)
        if kind == b"add":
            rid, params, arrival, seed = pickle.loads(frames[1].buffer)
            prompt = array("q")
            prompt.frombytes(frames[2].buffer)
            req = ServeRequest(
                prompt.tolist(),
                rid=rid,
                params=params,
                on_output=pending.put,
                arrival_s=arrival,
                prompt_seed=seed,
            )
            engine.submit(req)
        elif kind == b"abort":
            engine.abort(bytes(frames[1].buffer).decode())
        elif kind == b"snapshot":
            call_id = bytes(frames[1].buffer)
            fut = engine.snapshot()

            def reply(f: Future, call_id: bytes = call_id) -> None:
                exc = f.exception()
                value = exc if exc is not None else f.result()
                pending.put(_Frames([b"result", call_id, pickle.dumps(value)]))

            fut.add_done_callback(reply)
        elif kind == b"drain":
            engine.drain(bytes(frames[1].buffer).decode())
        elif kind == b"stop":
            break
    engine.stop()
    pending.put(None)
    send_thread.join(timeout=10)
    outbox.close(linger=2000)
    inbox.close(linger=0)
    ctx.term()


# ----------------------------------------------------------------- front side
class EngineProcessClient:
    """The front's handle on the engine process; the same surface as ``EngineLoop``."""

    def __init__(
        self,
        args,
        log_level: str = "info",
        detokenize: Callable[[list[int]], str] | None = None,
    ) -> None:
        self.args = args
        self.log_level = log_level
        # The front's text decoding (the engine sends token ids and decides stops).
        self.detokenize = detokenize
        self.info: dict | None = None
        self.fatal_error: str | None = None
        # rid -> (its event callback, its text decoder or None)
        self._outputs: dict[str, tuple[Callable[[OutputEvent], None], IncrementalText | None]] = {}
        self._calls: dict[bytes, Future] = {}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._draining = False
        self._stopping = False
        self._dir = tempfile.mkdtemp(prefix="echo-engine-")
        self._in_addr = f"ipc://{self._dir}/in"
        self._out_addr = f"ipc://{self._dir}/out"
        self._proc: mp.process.BaseProcess | None = None
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------ lifecycle
    def launch(self, timeout_s: float = START_TIMEOUT_S) -> dict:
        """Start the engine process and wait until it has built everything (its graphs
        captured); returns its serving info. Raises ``RuntimeError`` with the engine's
        reason when it fails to start."""
        zmq = _zmq()
        self._ctx = zmq.Context()
        self._in = self._ctx.socket(zmq.PUSH)
        self._in.bind(self._in_addr)
        self._out = self._ctx.socket(zmq.PULL)
        self._out.bind(self._out_addr)
        self._proc = mp.get_context("spawn").Process(
            target=engine_main,
            args=(self.args, self._in_addr, self._out_addr, self.log_level),
            name="echo-engine",
            daemon=True,
        )
        self._proc.start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._out.poll(int(WATCH_S * 1000)):
                frames = self._out.recv_multipart()
                if frames[0] == b"ready":
                    self.info = pickle.loads(frames[1])
                    break
                if frames[0] == b"failed":
                    self._reap()
                    raise RuntimeError(frames[1].decode())
            elif not self._proc.is_alive():
                self._reap()
                raise RuntimeError(
                    f"the engine process exited during start-up (exit code {self._proc.exitcode})"
                )
        else:
            self._reap()
            raise RuntimeError(f"the engine process did not start within {timeout_s:.0f} s")
        return self.info

    def start(self) -> None:
        """Start the threads that read the engine's outputs and watch the process."""
        for target, name in (
            (self._receive, "echo-front-receiver"),
            (self._watch, "echo-front-watch"),
        ):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self, timeout: float = 10.0) -> None:
        if self._stopping:
            return
        self._stopping = True
        if self._proc is not None and self._proc.is_alive():
            self._send([b"stop"])
            self._proc.join(timeout)
        self._reap()
        for t in self._threads:
            t.join(timeout=2 * WATCH_S + 1)
        self._close_sockets()

    def drain(self, message: str = "server shutting down") -> None:
        self._draining = True
        self._send([b"drain", message.encode()])

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def alive(self) -> bool:
        proc = self._proc
        return (
            proc is not None
            and proc.is_alive()
            and self.fatal_error is None
            and not self._draining
            and not self._stopping
        )

    # ------------------------------------------------------------- commands
    def submit(self, req: ServeRequest) -> None:
        if req.on_output is not None:
            text = None
            if self.detokenize is not None:
                text = IncrementalText(self.detokenize, req.params.stop)
            with self._lock:
                self._outputs[req.rid] = (req.on_output, text)
        meta = pickle.dumps((req.rid, req.params, req.arrival_s, req.prompt_seed))
        prompt = array("q", req.prompt)
        self._send([b"add", meta, memoryview(prompt)], copy=False)

    def abort(self, rid: str) -> None:
        self._send([b"abort", rid.encode()])

    def snapshot(self) -> Future:
        fut: Future = Future()
        call_id = os.urandom(8)
        with self._lock:
            self._calls[call_id] = fut
        self._send([b"snapshot", call_id])
        return fut

    def _send(self, frames: list, copy: bool = True) -> None:
        if self.fatal_error is not None or self._proc is None:
            return
        with self._send_lock:  # one socket, several HTTP threads
            self._in.send_multipart(frames, copy=copy)

    # --------------------------------------------------------------- threads
    def _receive(self) -> None:
        while not self._stopping:
            try:
                if not self._out.poll(int(WATCH_S * 1000)):
                    continue
                frames = self._out.recv_multipart()
            except Exception:  # the socket closed under us at shutdown
                return
            kind = frames[0]
            if kind == b"events":
                for ev in pickle.loads(frames[1]):
                    self._deliver(ev)
            elif kind == b"result":
                with self._lock:
                    fut = self._calls.pop(frames[1], None)
                value = pickle.loads(frames[2])
                if fut is not None:
                    if isinstance(value, BaseException):
                        fut.set_exception(value)
                    else:
                        fut.set_result(value)
            elif kind == b"fatal":
                self._fail(f"the engine stopped: {frames[1].decode()}")

    def _deliver(self, ev: OutputEvent) -> None:
        """Hand ``ev`` to its request, with the text its tokens add (decoded here: the same
        decoder and stop strings as the engine's, so the text ends where the engine's stop
        decision does)."""
        with self._lock:
            entry = self._outputs.get(ev.rid)
            if ev.finish_reason is not None:
                self._outputs.pop(ev.rid, None)
        if entry is None:
            return
        on_output, text = entry
        if text is not None:
            for token in ev.new_token_ids:
                if text.matched is None:
                    text.push(token)
            final = ev.finish_reason is not None
            if final:
                text.finish()
            ev = dataclasses.replace(ev, text_delta=text.take_stream_delta(final=final))
        on_output(ev)

    def _watch(self) -> None:
        while not self._stopping:
            proc = self._proc
            if proc is not None and not proc.is_alive():
                if not self._stopping:
                    self._fail(f"the engine process exited (exit code {proc.exitcode})")
                return
            time.sleep(WATCH_S)

    def _fail(self, why: str) -> None:
        """The engine is gone: every live request ends (503, with why), calls fail."""
        if self.fatal_error is None:
            self.fatal_error = why
            log.error("%s; live requests end with 503", why)
        with self._lock:
            rids = list(self._outputs)
            calls, self._calls = self._calls, {}
        for rid in rids:
            reason = {"type": "abort", "message": why, "status_code": 503}
            self._deliver(OutputEvent(rid, (), 0, 0, reason))
        for fut in calls.values():
            fut.set_exception(RuntimeError(why))
        self._reap()

    def _reap(self) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.is_alive():
            proc.terminate()
            proc.join(5)
        if proc.is_alive():
            proc.kill()
        proc.join(5)

    def _close_sockets(self) -> None:
        for sock in (getattr(self, "_in", None), getattr(self, "_out", None)):
            if sock is not None:
                sock.close(linger=0)
        ctx = getattr(self, "_ctx", None)
        if ctx is not None:
            ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)  # the ipc socket files
