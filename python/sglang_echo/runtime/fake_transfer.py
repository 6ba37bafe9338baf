"""A decode node's "transfer" with SGLang's fake backend: prompt KV synthesized on the node.

A PD decode node receives each prompt's KV (and the first token) from a prefill node. To
measure a decode node alone, SGLang's fake transfer backend skips the transfer; here the
KV a prompt would bring is generated on the node instead: deterministic rows and indexer
keys for every layer (``runtime/synthetic_kv.py``), seeded by the prompt's token ids, so
the same prompt gets the same KV on a no-offload and an ECHO server and their outputs can
be compared token for token. The keys' locality (the stable fraction of each step's top-k)
is the model loader's to set (``synthetic_kv_locality`` in its info, runtime/model_loader.py;
default 0, random keys): only a loader that also biased the indexers' weights toward the
same favoured directions makes it mean anything, and the runtime never changes weights.
Rows go where a transfer would put them: the device pool without offload, the host pool
(index keys on the device, no cache slots) under ECHO; the host rows of the prompt's long
runs of locations go by copy engine, as an RDMA arrival takes no SM (offload/host_extents.py).
Its first token stands in for the prefill node's.

On CUDA the "transfer" runs as a real one does, beside decoding: the rows are generated
and written on a side stream while the running batch keeps stepping, and the request joins
the batch (its first token emitted) once its transfer's event has fired. Synthesizing a
100K-token prompt's 8 layers takes tens of milliseconds of GPU time; on the decode stream
that stalled every running request once per admission, which a decode node that admits
several requests a second cannot afford (it cut the measured HTTP throughput, not the model's).
The engine thread's share is kept to the bookkeeping: locations, the table row, a seed.
The MLA rows come from a bank made at start-up (runtime/synthetic_kv.py), copied stretch by
stretch by copy engine: only the index keys are generated per prompt, so an arrival takes
a few SM-milliseconds, as an RDMA arrival takes none.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
import random
import time
import zlib
from array import array
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from sglang_echo.kernels.host_copy import upload
from sglang_echo.model.config import DeepseekV32Config
from sglang_echo.model.deepseek_v32 import DeepseekV32ForCausalLM
from sglang_echo.model.kv_cache import KVCache
from sglang_echo.offload.host_extents import HostExtents, split_extents
from sglang_echo.runtime.request import SeqState, ServeRequest, TokenLogprob
from sglang_echo.runtime.scheduler_stats import Laps
from sglang_echo.runtime.step_runner import StepRunner
from sglang_echo.runtime.synthetic_kv import Locality, SyntheticKV, favoured_directions


def prompt_seed(ids: list[int]) -> int:
    """A stable seed from the prompt's ids (the same on every server and run): the CRC-32
    of their little-endian int64 bytes."""
    return zlib.crc32(array("q", ids))


def first_token_logprob(req: SeqState, token: int, vocab_size: int) -> TokenLogprob | None:
    """The stand-in first token's log-probability, when the request asked for them.

    Why: a real prefill node sends its first token's log-probability with the KV, and a
    client that asked for them gets one per output token. The fake transfer draws its
    first token uniformly from the vocabulary, so under that draw every token has
    probability 1 / V: the chosen one and its alternatives (the lowest other ids) get
    -ln V, the truth about the stand-in, and the counts line up with the tokens."""
    params = getattr(req, "params", None)
    if not isinstance(req, ServeRequest) or params is None or not params.logprobs:
        return None
    lp = -math.log(vocab_size)
    others = (i for i in range(vocab_size) if i != token)
    top = tuple((i, lp) for i in [token, *others][: params.top_logprobs])
    return TokenLogprob(token, lp, top)


# The parts of ``FakeTransfer.start`` timed on the engine thread (in order; see ``start``).
START_PARTS = ("alloc", "place", "seed", "reserve", "submit")


@dataclass(eq=False)  # identity: `in` and `remove` must not compare 100K-id prompts
class _Transfer:
    req: SeqState
    first_token: int
    first_logprob: TokenLogprob | None
    started: float  # time.perf_counter() at the start
    slots: torch.Tensor | None = None  # ECHO's pinned device slots [layers, n]
    locs: torch.Tensor | None = None  # the prompt's locations on the device
    job: Future | None = None  # the writer thread's launches (None: written in line, CPU)
    done: torch.cuda.Event | None = None  # recorded after the last write (CUDA)
    draft: tuple[int, torch.Tensor] | None = None  # under MTP: the draft's carry

    @property
    def error(self) -> BaseException | None:
        """The writer's exception, if its launches failed."""
        return self.job.exception() if self.job is not None and self.job.done() else None

    def ready(self) -> bool:
        """Every write launched and finished, or the writer failed (never blocks)."""
        if self.job is None:
            return True
        if not self.job.done():
            return False
        return self.error is not None or self.done is None or self.done.query()

    def wait(self) -> None:
        """Until the writes are done (a failed writer's error is the caller's to read)."""
        if self.job is not None:
            concurrent.futures.wait([self.job])
        if self.done is not None and self.error is None:
            self.done.synchronize()


class FakeTransfer:
    def __init__(
        self,
        model: DeepseekV32ForCausalLM,
        kv_cache: KVCache,
        steps: StepRunner,
        locality: float,
        dtype: torch.dtype,
    ) -> None:
        cfg = model.config
        # Seed 0: the directions a locality-setting loader biased the indexers toward.
        directions = favoured_directions(
            cfg.num_hidden_layers, cfg.index_head_dim, cfg.qk_rope_head_dim
        )
        self.locality = Locality(locality)
        self.synth = SyntheticKV(cfg, directions, self.locality, dtype, steps.device)
        self.synth.bank()  # at start-up, not in the first arrival
        self.num_layers = cfg.num_hidden_layers
        self.kv_cache = kv_cache
        self.steps = steps
        self.vocab_size = cfg.vocab_size
        device = steps.device
        # The lowest priority a stream can have (0): the engine's steps run on the highest
        # (runtime/streams.py), so the GPU schedules the decode's blocks first and the
        # transfer's generation fills what is left, as an RDMA arrival costs a real decode
        # node's GPU nothing. Its launches come from a thread of their own, as a real
        # transfer costs the engine thread nothing: the engine thread only takes the
        # locations (and ECHO's slots) and hands the rest over.
        self.stream = torch.cuda.Stream(device, priority=0) if device.type == "cuda" else None
        # The host rows' copies on a stream of their own: they take no SM, and on the
        # transfer's stream they waited behind its kernels, which the decode's blocks
        # delay (the copies alone run at the host link's speed). None: one stream.
        self.copy_stream = torch.cuda.Stream(device, priority=0) if device.type == "cuda" else None
        self._writer = (
            ThreadPoolExecutor(1, thread_name_prefix="echo-transfer")
            if self.stream is not None
            else None
        )
        self._transfers: list[_Transfer] = []  # started, first token not yet taken
        # Transfers whose writer failed: (request, error), for the scheduler to end them.
        self.failed: list[tuple[SeqState, BaseException]] = []
        self.transfers = 0  # arrived so far
        self.transfer_s = 0.0  # their start-to-arrival times (seen at the step's poll), summed
        # ``start``'s engine-thread seconds by part (the admission's cost, /metrics by part)
        self.start_part_s = dict.fromkeys(START_PARTS, 0.0)
        self.start_part_cpu_s = dict.fromkeys(START_PARTS, 0.0)  # its CPU seconds
        self.directions = directions
        self.dtype = dtype
        self.draft_cache: KVCache | None = None  # under MTP (with_draft)
        self.draft_synth: SyntheticKV | None = None
        self._drafts: dict[int, tuple[int, torch.Tensor]] = {}  # id(request) -> carry

    def with_draft(self, draft_cache: KVCache, draft_config: DeepseekV32Config) -> None:
        """Under MTP: each arrival also brings what a prefill node sends for the draft, the
        NextN layer's KV rows over the prompt (into the draft's one-layer pool, at the
        prompt's locations) and its carry (the first draft token and the NextN state that
        made it), synthesized like the target's and seeded by the prompt."""
        self.draft_cache = draft_cache
        self.draft_synth = SyntheticKV(
            draft_config, self.directions[:1], Locality(0.0), self.dtype, self.steps.device
        )
        self.draft_synth.bank()  # now, not in the first arrival (as the target's)

    @property
    def pending(self) -> int:
        return len(self._transfers)

    def start(self, req: SeqState) -> None:
        """Begin placing ``req``'s prompt KV (the request is admitted: it has a table row).
        ``arrived`` hands its first output token back once the rows are in place.

        On the engine thread and the decode stream: the locations, the table row and, under
        ECHO, the prompt's device slots (reserved and pinned there, in order with the steps
        that share the free stacks). The rows themselves are generated and written by the
        writer thread on the transfer's stream, beside the steps."""
        lap = Laps(self.start_part_s, self.start_part_cpu_s)
        started = lap.started
        n = len(req.prompt)
        locs = self.steps.allocator.alloc(n)
        lap("alloc")
        loc_t = self.steps.place(req, 0, locs)  # on the device (queued, not waited for)
        req.cached_len = n
        lap("place")
        seed = getattr(req, "prompt_seed", None)
        if seed is None:  # not computed where the request was parsed
            seed = prompt_seed(req.prompt)
        first = random.Random(seed).randrange(self.vocab_size)
        first_lp = first_token_logprob(req, first, self.vocab_size)
        transfer = _Transfer(req, first, first_lp, started)
        if self.draft_synth is not None:
            transfer.draft = self._draft_carry(seed)
        lap("seed")
        if self.stream is None:
            transfer.slots = self.kv_cache.reserve_prompt(loc_t)
            lap("reserve")
            self._write(loc_t, seed, transfer.slots, locs)
            self._transfers.append(transfer)
            lap("submit")  # here the writes themselves: no writer thread on the CPU
            return
        current = torch.cuda.current_stream(self.steps.device)
        transfer.slots = self.kv_cache.reserve_prompt(loc_t)
        # The writes start after everything the decode stream has queued: the locations may
        # have been a finished request's, and the slots were reserved there.
        self.stream.wait_stream(current)
        if self.copy_stream is not None:
            self.copy_stream.wait_stream(current)
            loc_t.record_stream(self.copy_stream)
        # Both were made on the decode stream and are read on the transfer's: without this
        # the allocator could hand their memory to the decode stream again as soon as the
        # writer thread lets go of them, while the transfer's kernels still read it (seen
        # on the H200: index_copy_ out of bounds). The transfer keeps them until it arrives.
        loc_t.record_stream(self.stream)
        if transfer.slots is not None:
            transfer.slots.record_stream(self.stream)
        transfer.locs = loc_t
        transfer.done = torch.cuda.Event()
        lap("reserve")
        if self.kv_cache.fills_prompt_in_place:
            transfer.job = self._writer.submit(self._write_on_stream, loc_t, seed, transfer, locs)
        else:  # a backend whose write also moves its own maps: launched from this thread
            self._write_on_stream(loc_t, seed, transfer, locs)
        self._transfers.append(transfer)
        lap("submit")

    def _write(
        self,
        locs: torch.Tensor,
        seed: int,
        slots: torch.Tensor | None,
        host_locs: Sequence[int],
        host_stream: torch.cuda.Stream | None = None,
    ) -> None:
        """Every layer's rows and index keys of the prompt at ``locs`` (positions 0..n-1;
        ``host_locs``, the same on the CPU, lay out the host writes: offload/host_extents.py).
        The host rows first, on ``host_stream`` when given (copies, no SM), then the index
        keys and the placed device rows on the current stream."""
        if self.draft_synth is not None:  # the NextN layer's rows over the prompt
            self.draft_synth.write(self.draft_cache, locs, seed)
        if not self.kv_cache.fill_takes_extents:  # the plain pool, HiSparse-like
            self.synth.write(self.kv_cache, locs, seed)
            return
        n = int(locs.numel())
        windows = [self.synth.kv_window(layer, n, seed) for layer in range(self.num_layers)]
        on_host_stream = (
            torch.cuda.stream(host_stream) if host_stream is not None else contextlib.nullcontext()
        )
        with on_host_stream:
            extents = split_extents(host_locs)
            extents = HostExtents(extents.runs, upload(extents.rest, locs.device))
            for layer, window in enumerate(windows):
                self.kv_cache.fill_prompt(layer, locs, window, None, None, extents, part="host")
        for group in self.synth.layer_groups(n):
            keys = self.synth.keys_of(group, n, seed)
            for i, layer in enumerate(group):
                slot = None if slots is None else slots[layer]
                self.kv_cache.fill_prompt(
                    layer, locs, windows[layer], keys[i], slot, None, part="device"
                )

    def _write_on_stream(
        self, locs: torch.Tensor, seed: int, transfer: _Transfer, host_locs: Sequence[int]
    ) -> None:
        """The writer thread: the writes on the transfer's streams, then its event (after
        both). Tensors made here belong to those streams' allocator pools, so none is
        reused while they run."""
        with torch.cuda.device(self.steps.device), torch.cuda.stream(self.stream):
            self._write(locs, seed, transfer.slots, host_locs, self.copy_stream)
            if self.copy_stream is not None:
                self.stream.wait_stream(self.copy_stream)
            transfer.done.record(self.stream)

    def _draft_carry(self, seed: int) -> tuple[int, torch.Tensor]:
        """The stand-in for the prefill node's first draft token and NextN state."""
        token = random.Random(seed * 7 + 1).randrange(self.vocab_size)
        gen = torch.Generator(device=self.steps.device).manual_seed(seed * 7 + 2)
        width = self.draft_synth.config.hidden_size
        hidden = torch.randn(width, generator=gen, device=self.steps.device)
        return token, hidden.to(self.dtype)

    def arrived(self, wait: bool = False) -> list[tuple[SeqState, int, TokenLogprob | None]]:
        """(request, first token, its log-probability or None) of every transfer that has
        finished, in admission order (under MTP each request's draft carry is then
        ``draft_of``'s). ``wait``: block until the oldest has (the caller has nothing else
        to run)."""
        if wait and self._transfers:
            self._transfers[0].wait()
        ready = [t for t in self._transfers if t.ready()]
        if not ready:
            return []
        self._transfers = [t for t in self._transfers if t not in ready]
        failed = [t for t in ready if t.error is not None]
        if failed and self.stream is not None:  # whatever the failed writers launched lands
            current = torch.cuda.current_stream(self.steps.device)  # first
            current.wait_stream(self.stream)
            if self.copy_stream is not None:
                current.wait_stream(self.copy_stream)
        self.failed.extend((t.req, t.error) for t in failed)
        ready = [t for t in ready if t.error is None]
        now = time.perf_counter()
        self.transfers += len(ready)
        self.transfer_s += sum(now - t.started for t in ready)
        for t in ready:  # the decode stream reads these rows from the next step on
            if t.done is not None:
                torch.cuda.current_stream(self.steps.device).wait_event(t.done)
            self.kv_cache.unpin_prompt(t.slots)
            if t.draft is not None:
                self._drafts[id(t.req)] = t.draft
        return [(t.req, t.first_token, t.first_logprob) for t in ready]

    def draft_of(self, req: SeqState) -> tuple[int, torch.Tensor] | None:
        """Under MTP: the arrived request's draft carry (first draft token, NextN state),
        once; None without MTP."""
        return self._drafts.pop(id(req), None)

    def forget(self, req: SeqState) -> None:
        """``req`` ends before its first token (an abort): let its transfer finish writing
        before its locations (and slots) go back to the pool."""
        self._drafts.pop(id(req), None)
        for t in self._transfers:
            if t.req is req:
                t.wait()
                self._transfers.remove(t)
                return

    def close(self) -> None:
        """Stop the writer thread (after its queued writes)."""
        if self._writer is not None:
            self._writer.shutdown(wait=True)
