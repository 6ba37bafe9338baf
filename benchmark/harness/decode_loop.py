"""sglang's choreography around a decode step, reproduced over either KV side.

What the loop reproduces (sglang 0.5.23's overlap scheduler and CUDA-graph runner):
- two streams: the schedule stream builds and prepares step N+1 (logical ids, the
  request table, the coordinator's backup of each previous token on its own backup
  stream) while step N still runs on the forward stream; the forward stream waits for
  the schedule stream before each step;
- step N+1's input tokens are step N's outputs, read on the device (the host never
  waits for them before launching);
- the results of step N are processed after step N+1 was launched: requests that reach
  their length finish then (others are aborted by their client before the next step,
  each released at once outside result processing), while step N+1 (which still decodes them once more, as
  sglang's overlap does) is in flight; their KV is released in one result-processing
  scope; new requests arrive (PD: KV landed in the host pool; local: prefill and
  staging) between steps;
- decode CUDA graphs captured once per padded batch size and replayed with the batch
  padded (padding rows: request 0, length 1), eager beyond the largest; IDLE steps (no
  request: a DP-attention rank with nothing to run) replay the smallest graph with no
  real row.

The model is ``toy_model.ToyModel``: both sides compute the same functions over the rows
their table points at, so equal logits mean every row ECHO handed to attention held the
bytes the plain pool holds.
"""

from __future__ import annotations

import random
from contextlib import nullcontext
from dataclasses import dataclass, field, replace

import torch

from benchmark.harness.kv_sides import FP8_ROW_BYTES, KV_LORA, ROPE, ceil_page
from benchmark.harness.toy_model import ToyModel, ToyShape


@dataclass(frozen=True)
class HarnessConfig:
    fp8: bool = True
    mode: str = "pd"  # "pd": KV arrives in the host pool; "local": prefill + staging
    layers: int = 4
    top_k: int = 64
    dev_cache: int = 256  # N_G: a step of max_running x top_k selections fills it
    max_running: int = 4
    max_prompt: int = 448
    max_context: int = 768
    vocab: int = 512
    requests: int = 10
    min_new: int = 6
    max_new: int = 60
    graph_sizes: tuple[int, ...] = (1, 2, 4)
    graphs: bool = True
    seed: int = 0
    # SGLANG_NSA_FUSE_LOGITS_RECALL_DECODE=1: the ECHO side's top-k goes through the plugin's
    # indexer hook (sglang/decode_prefetch.py), staging from the toy indexer's logits.
    prefetch: bool = False
    # As under DP attention, where every rank replays the batch size of the largest rank:
    # each step runs the largest graph, its rows past the real requests padding.
    pad_to_max: bool = False

    @property
    def host_tokens(self) -> int:
        return 4 * self.max_running * self.max_context

    @property
    def row_width(self) -> int:
        return FP8_ROW_BYTES if self.fp8 else KV_LORA + ROPE


@dataclass
class Spec:
    rid: str
    arrival: int  # loop iteration at which it may be admitted
    prompt: list[int]
    quota: int  # decode steps
    abort_at: int = 0  # > 0: the client aborts it once it has this many tokens


@dataclass
class Running:
    spec: Spec
    req: object
    seq_len: int  # tokens in KV once this step's token is written
    first_token: int
    tokens: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    finished: bool = False
    aborting: bool = False


# An arrival that waits for the node to run dry; the loop then runs IDLE_STEPS steps
# with no request (a DP-attention rank with nothing to run) and admits it.
LATE = 1 << 40
IDLE_STEPS = 3


def make_specs(cfg: HarnessConfig) -> list[Spec]:
    """Arrivals in bursts with gaps, the last one after the node ran dry (IDLE steps),
    prompts longer than top-k (so selections leave tokens out), lengths that finish at
    different steps."""
    rng = random.Random(cfg.seed)
    specs, t = [], 0
    for i in range(cfg.requests):
        t += rng.choice((0, 0, 1, 3, 25)) if i else 0
        n = rng.randint(cfg.top_k // 2, cfg.max_prompt)
        prompt = [rng.randrange(cfg.vocab) for _ in range(n)]
        quota = rng.randint(cfg.min_new, min(cfg.max_new, cfg.max_context - n - 2))
        if i == cfg.requests - 1 and i:  # the last one comes after everything ran dry
            t = LATE
        abort_at = rng.randint(1, quota - 1) if i % 3 == 1 and quota > 1 else 0
        specs.append(Spec(f"r{i}", t, prompt, quota, abort_at))
    return specs


class DecodeLoop:
    def __init__(self, side_cls, cfg: HarnessConfig, device: str, tp_group) -> None:
        self.cfg, self.device = cfg, device
        self.cuda = torch.device(device).type == "cuda"
        self.schedule_stream = torch.cuda.current_stream() if self.cuda else None
        self.forward_stream = torch.cuda.Stream() if self.cuda else None
        self.side = side_cls(cfg, device, self.forward_stream, tp_group)
        shape = ToyShape(cfg.layers, cfg.top_k, cfg.vocab, cfg.max_context, cfg.row_width)
        self.model = ToyModel(shape, device, seed=cfg.seed)
        g = max(cfg.graph_sizes)
        i64 = dict(dtype=torch.int64, device=device)
        self.req_idx = torch.zeros(g, **i64)
        self.seq = torch.ones(g, **i64)
        self.out_loc = torch.zeros(g, **i64)
        self.tokens_in = torch.zeros(g, **i64)
        self.next_out = torch.zeros(g, **i64)
        self.logits_out = torch.zeros(g, cfg.vocab, dtype=torch.float32, device=device)
        self.context_tokens = torch.zeros(4 * cfg.max_running + 2, cfg.max_context, **i64)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.stats = {"graph_replays": 0, "eager_steps": 0, "idle_steps": 0, "steps": 0}
        self.step_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.counter_log: list[torch.Tensor] = []
        self._keep: list = []  # inputs of steps still in flight

    # ------------------------------------------------------------ the forward
    def _body(self, bs: int) -> None:
        """One decode step of the first ``bs`` static rows (what a graph captures)."""
        m, side = self.model, self.side
        req, seq = self.req_idx[:bs], self.seq[:bs]
        loc, tok = self.out_loc[:bs], self.tokens_in[:bs]
        pos = seq - 1
        self.context_tokens[req, pos] = tok
        context = self.context_tokens[req]
        hidden = torch.zeros(bs, m.shape.hidden, dtype=torch.float32, device=self.device)
        for layer in range(self.cfg.layers):
            nope, rope = m.kv(layer, tok, pos)
            side.write(layer, loc, nope, rope)
            topk, weights = side.select(m, layer, context, req, seq, tok)
            table = side.table(layer, req, seq, topk)
            valid = table >= 0
            rows = side.rows(layer)[table.clamp(min=0).to(torch.int64)]
            rows = torch.where(valid[..., None], rows.to(torch.float32), 0.0)
            hidden = hidden + m.attend(rows, torch.where(valid, weights, 0.0))
        logits = m.logits(hidden)
        self.logits_out[:bs] = logits
        self.next_out[:bs] = logits.argmax(-1)

    def capture(self) -> None:
        """One graph per padded batch size, captured on the forward stream after an
        eager warm-up (Triton compiles there), with padding inputs and no real row."""
        if not (self.cuda and self.cfg.graphs):
            return
        for bs in self.cfg.graph_sizes:
            self._pad_inputs(0, bs)
            with torch.cuda.stream(self.forward_stream):
                self.side.before_forward(0)
                self._body(bs)
            self.forward_stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=self.forward_stream):
                self._body(bs)
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def _pad_inputs(self, n: int, bs: int) -> None:
        self.req_idx[n:bs] = 0
        self.seq[n:bs] = 1
        self.out_loc[n:bs] = 0
        self.tokens_in[n:bs] = 0

    def _padded(self, n: int) -> int | None:
        fits = [g for g in self.cfg.graph_sizes if g >= max(n, 1)]
        if not (fits and self.graphs):
            return None
        return max(fits) if self.cfg.pad_to_max else min(fits)

    def step_ms(self) -> list[float]:
        """Device time of each graph-replayed step with real rows (CUDA events around the
        replay, read after the loop: every event has completed)."""
        return [start.elapsed_time(end) for start, end in self.step_events]

    def launch(self, batch: list[Running], prev_rows: list[int]):
        """Prepare (schedule stream) and launch (forward stream) one step; returns what
        the result processing needs. ``prev_rows[i]``: the row of batch[i] in the step
        before, -1 for a request's first decode step."""
        n, dev = len(batch), self.device
        out_loc = None
        if n:
            out_loc = self.side.prepare([r.req for r in batch], [r.seq_len for r in batch])
        idx = torch.tensor([r.req.kv.req_pool_idx for r in batch], dtype=torch.int64, device=dev)
        seq = torch.tensor([r.seq_len for r in batch], dtype=torch.int64, device=dev)
        prev = torch.tensor(prev_rows, dtype=torch.int64, device=dev)
        first = torch.tensor([r.first_token for r in batch], dtype=torch.int64, device=dev)
        self._keep = [*self._keep[-6:], (idx, seq, prev, first, out_loc)]
        for r in batch:
            r.seq_len += 1  # the next step's length (this one is launched with the old)
        padded = self._padded(n)
        bs = padded or max(n, 1)
        if self.forward_stream is not None:
            self.forward_stream.wait_stream(self.schedule_stream)
        ctx = torch.cuda.stream(self.forward_stream) if self.cuda else nullcontext()
        with ctx:
            self.side.before_forward(n)
            if n:
                inputs = torch.where(prev >= 0, self.next_out[prev.clamp(min=0)], first)
                self.tokens_in[:n] = inputs
                self.req_idx[:n] = idx
                self.seq[:n] = seq
                self.out_loc[:n] = out_loc
            self._pad_inputs(n, bs)
            if padded is not None:
                timed = n > 0 and self.cuda
                if timed:
                    start = torch.cuda.Event(enable_timing=True)
                    start.record()
                self.graphs[padded].replay()
                if timed:
                    end = torch.cuda.Event(enable_timing=True)
                    end.record()
                    self.step_events.append((start, end))
                self.stats["graph_replays"] += 1
            else:
                self._body(bs)
                self.stats["eager_steps"] += 1
            tokens = self.next_out[:n].to("cpu", non_blocking=self.cuda)
            logits = self.logits_out[:n].to("cpu", non_blocking=self.cuda)
            self.counter_log.append(self.side.counters().clone())
            done = torch.cuda.Event() if self.cuda else None
            if done is not None:
                done.record()
        self.stats["steps"] += 1
        self.stats["idle_steps"] += n == 0
        return batch, tokens, logits, done

    # ------------------------------------------------------------ admission
    def admit(self, spec: Spec) -> Running:
        from benchmark.harness.kv_sides import make_req

        req = make_req(spec.rid, spec.prompt)
        prompt = torch.tensor(spec.prompt, dtype=torch.int64, device=self.device)
        positions = torch.arange(len(spec.prompt), device=self.device)

        def nope_rope(layer: int):
            return self.model.kv(layer, prompt, positions)

        if self.forward_stream is not None:  # prefill after the steps in flight
            self.schedule_stream.wait_stream(self.forward_stream)
        if self.cfg.mode == "pd":
            self.side.arrive_pd(req, self.prefill_node_rows(nope_rope, len(spec.prompt)))
        else:
            self.side.prefill_local(req, nope_rope)
        self.context_tokens[req.kv.req_pool_idx, : len(spec.prompt)] = prompt
        first = self.model.first_token(spec.prompt)
        return Running(spec, req, len(spec.prompt) + 1, first)

    def prefill_node_rows(self, nope_rope, n: int) -> torch.Tensor:
        """The bytes a prefill node would send: the prompt written by sglang's own DSA
        pool (its fp8 quantisation), read back as [n, layers, W] on the CPU."""
        from benchmark.harness.kv_sides import flat_rows, pool_args

        if getattr(self, "_prefill_pool", None) is None:
            from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

            rows = ceil_page(self.cfg.max_prompt + 1)
            args = pool_args(rows, self.cfg.layers, self.cfg.fp8, self.device)
            self._prefill_pool = DSATokenToKVPool(**args, index_buf_size=rows)
        pool = self._prefill_pool
        locs = torch.arange(1, n + 1, device=self.device)
        out = []
        for layer in range(self.cfg.layers):
            nope, rope = nope_rope(layer)
            pool.set_mla_kv_buffer(self.side.layers[layer], locs, nope, rope)
            out.append(flat_rows(pool.kv_buffer[layer])[locs].cpu())
        return torch.stack(out, 1)

    # ------------------------------------------------------------ the run
    def run(self, specs: list[Spec], profile_at: int = 1 << 30) -> dict[str, Running]:
        """Every request to its end; returns them by id (their tokens and logits). On a GPU
        the first step at or after iteration ``profile_at`` whose batch is the widest the
        run can take (``max_running`` requests, or all of them) is profiled: ECHO's
        launches per step, ``launch_counts``, at ``launch_batch`` requests. The widest
        batch, because the allocation path depends on the lanes (batch x top-k): profiling
        an early, narrower step would show the one-program path where wider steps take
        the multi-launch one."""
        self.capture()
        pending = sorted((replace(s) for s in specs), key=lambda s: s.arrival)
        running: list[Running] = []
        done: dict[str, Running] = {}
        inflight = None
        prev_batch: list[Running] = []
        it = idle = 0
        self.launch_counts = None
        self.launch_batch = 0
        widest = min(self.cfg.max_running, len(specs))
        while True:
            if pending and not running and idle >= IDLE_STEPS:
                pending[0].arrival = it  # the late arrival, after IDLE_STEPS idle steps
            while pending and pending[0].arrival <= it and len(running) < self.cfg.max_running:
                running.append(self.admit(pending.pop(0)))
            self._abort([r for r in running if r.aborting], running, done)
            if not (pending or running):
                if inflight is None:
                    break
                self._finish(self._process(inflight), running, done)
                inflight = None
                continue
            row_of = {id(r): i for i, r in enumerate(prev_batch)}
            batch = list(running)  # an empty batch is an IDLE step (arrivals pending)
            prev_rows = [row_of.get(id(r), -1) for r in batch]
            if (
                self.launch_counts is None
                and it >= profile_at
                and self.cuda
                and len(batch) >= widest
            ):
                self.launch_counts, current = count_launches(self.launch, batch, prev_rows)
                self.launch_batch = len(batch)
            else:
                current = self.launch(batch, prev_rows)
            prev_batch = batch
            idle = idle + 1 if not batch else 0
            if inflight is not None:  # step N's results, while step N + 1 runs
                self._finish(self._process(inflight), running, done)
            inflight = current
            it += 1
            if it > 4 * sum(s.quota + 2 + s.arrival % LATE for s in specs) + 100:
                raise RuntimeError("the harness loop does not terminate")
        if self.cuda:
            torch.cuda.synchronize()
        return done

    def _abort(self, aborted: list[Running], running: list[Running], done: dict) -> None:
        """Client aborts, between steps and outside result processing (each released at
        once), while the step that still decodes them may be in flight."""
        for r in aborted:
            r.finished = True
            self.side.abort(r.req)
            running.remove(r)
            done[r.spec.rid] = r

    def _finish(self, finished: list[Running], running: list[Running], done: dict) -> None:
        if finished:
            self.side.finish_all([r.req for r in finished])
            for r in finished:
                running.remove(r)
                done[r.spec.rid] = r

    def _process(self, step) -> list[Running]:
        """sglang's result processing of one step: its tokens, then who finished."""
        batch, tokens, logits, event = step
        if event is not None:
            event.synchronize()
        finished = []
        for i, r in enumerate(batch):
            if r.finished:  # decoded once more after its end (overlap): discarded
                continue
            r.tokens.append(int(tokens[i]))
            r.logits.append(logits[i].clone())
            if len(r.tokens) == r.spec.quota:
                r.finished = True
                finished.append(r)
            elif len(r.tokens) == r.spec.abort_at:
                r.aborting = True  # the abort reaches the scheduler before the next step
        return finished

    def counters_per_step(self) -> torch.Tensor:
        """[steps, 3] evictions / misses / hits of each step (differences)."""
        log = torch.stack(self.counter_log).cpu()
        return torch.diff(log, dim=0, prepend=torch.zeros_like(log[:1]))


def echo_kernel_names() -> tuple[str, ...]:
    """Every Triton kernel of ``sglang_echo.kernels`` (where all of ECHO's kernels live), by
    the name the CUDA profiler reports it under, found by walking the package.

    Why not a list: a list fell behind when the multi-launch resolve's kernels were renamed,
    and the harness then counted none of them (its record showed the resolve's launches
    without the allocation's)."""
    import importlib
    import pkgutil

    import sglang_echo.kernels as package

    names: set[str] = set()
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for name, obj in vars(module).items():
            is_triton = type(obj).__module__.startswith("triton")  # jit, autotune, interpreter
            if name.endswith("_kernel") and is_triton:
                names.add(name)
    return tuple(sorted(names, key=len, reverse=True))  # longest first: exact before prefix


def count_launches(fn, *args):
    """ECHO's kernel launches (by name) while ``fn(*args)`` runs, from the CUDA profiler
    (a replayed graph's kernels are reported one by one)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        result = fn(*args)
        torch.cuda.synchronize()
    kernels = echo_kernel_names()
    counts: dict[str, int] = {}
    for event in prof.events():
        name = event.name
        hit = next((k for k in kernels if name == k or name.startswith(k)), None)
        if hit is not None:
            counts[hit] = counts.get(hit, 0) + 1
    return counts, result
