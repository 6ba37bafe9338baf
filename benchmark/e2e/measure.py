"""Timed decode steps, block by block: a block's engines are built together and live
together; each (engine, phase) admits its requests as the engine's capacity rules allow,
warms up (ECHO and the HiSparse-like backend: on until the cache evicts, for the steady
state), times ``--steps`` decode steps (CUDA events on a GPU, the wall clock too), profiles
the first repeat where asked, keeps every request's greedy output for the lossless checks,
releases everything and checks nothing leaked. A failing engine or phase is logged as an
error and the rest run on; ``--deadline-s`` stops new engines and repeats."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

import torch

from benchmark.e2e.engines import build, eviction_counter, kv_device_bytes, leak_free
from benchmark.e2e.plan import Engine, Phase, StudyPlan, prompt_len, tag
from benchmark.e2e.profiler import profile_breakdown
from benchmark.e2e.timing import elapsed, log, median, spread
from benchmark.study.decode_node import DecodeNode
from benchmark.study.moe import LocalRoutedMoE
from sglang_echo.runtime.step_runner import StepRunner
from sglang_echo.runtime.synthetic_kv import SyntheticKV


class DecodeBench:
    """Measures the plan's blocks on one device over one worker model: each result goes to
    ``runs`` (and ``save`` rewrites the record after it), each failure to ``errors``."""

    def __init__(
        self,
        setup: StudyPlan,
        model,
        directions,
        device: torch.device,
        runs: list[dict],
        errors: list[str],
        save: Callable[[], object],
    ) -> None:
        self.setup = setup
        self.args, self.plan, self.cfg = setup.args, setup.plan, setup.cfg
        self.max_new = setup.max_new
        self.model, self.directions = model, directions
        self.device = device
        self.cuda = device.type == "cuda"
        self.runs, self.errors = runs, errors
        self.save = save
        self.node: DecodeNode | None = None

    def past_deadline(self) -> float | None:
        """Seconds since the start when past ``--deadline-s`` (None: not past, or none)."""
        spent = elapsed()
        return spent if self.args.deadline_s and spent > self.args.deadline_s else None

    def run_block(self, steps: list[tuple[Engine, Phase]]) -> None:
        """One block of the schedule: its engines are built at their first step and freed
        at its end, so a ratio's two sides share the GPU's state while they alternate."""
        built: dict[str, tuple] = {}
        dropped: set[str] = set()
        for eng, phase in steps:
            if eng.label in dropped:
                continue
            late = self.past_deadline()
            if eng.label not in built:
                if late is not None:
                    msg = f"{eng.label}: skipped at {late:.0f}s, past the {self.args.deadline_s}s deadline"
                    log(msg)
                    self.errors.append(msg)
                    dropped.add(eng.label)
                    continue
                try:
                    built[eng.label] = self.build_logged(eng)
                except Exception as exc:
                    msg = f"{eng.label}: {type(exc).__name__}: {exc}"
                    log("ERROR " + msg)
                    self.errors.append(msg)
                    dropped.add(eng.label)
                    gc.collect()
                    if self.cuda:
                        torch.cuda.empty_cache()
                    continue
            elif phase.repeat and late is not None:
                msg = (f"{eng.label}/{tag(phase)}: repeat skipped at {late:.0f}s, past the "
                       f"{self.args.deadline_s}s deadline")  # fmt: skip
                log(msg)
                self.errors.append(msg)
                continue
            self.run_step(eng, phase, *built[eng.label])
        built.clear()
        self.node = None
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def build_logged(self, eng: Engine) -> tuple:
        """``build`` with its sizes logged; also the KV state's device bytes once built."""
        log(f"engine {eng.label}: building ({eng.backend}, pool {eng.pool}, "
            f"N_G {eng.dev_cache}, host {eng.host})")  # fmt: skip
        kv, runner, timer = build(self.setup, eng, self.model, self.device)
        dev_bytes = kv_device_bytes(kv)
        if self.cuda:
            log(f"  built: KV state {dev_bytes / 2**30:.2f} GiB on the GPU, "
                f"{torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated")  # fmt: skip
        return kv, runner, timer, dev_bytes

    def run_step(self, eng: Engine, phase: Phase, kv, runner, timer, dev_bytes: int) -> None:
        """Measure one phase and keep its result; a failure is an error, not the end."""
        try:
            res = self.run_phase(eng, phase, kv, runner, timer)
        except Exception as exc:  # keep what the other phases measure
            msg = f"{eng.label}/{tag(phase)}: {type(exc).__name__}: {exc}"
            log("ERROR " + msg)
            self.errors.append(msg)
            if self.node is not None:
                self.node.release_all()
            return
        res["kv_device_bytes"] = kv_device_bytes(kv) if eng.backend != "no-offload" else dev_bytes
        self.runs.append(res)
        self.save()

    def run_phase(self, eng: Engine, phase: Phase, kv, runner: StepRunner, timer) -> dict:
        """Admit, warm up (fill), time ``--steps`` decode steps, profile, release: one result."""
        a = self.args
        synth = SyntheticKV(self.cfg, self.directions, phase.locality, self.plan.dtype, self.device)
        node = self.node = DecodeNode(runner, synth, self.cfg.vocab_size)
        admit_s, admitted = [], []
        seed = 0
        while phase.batch is None or len(node.running) < phase.batch:
            n = prompt_len(self.plan, seed)
            if not node.fits(n, self.max_new):
                break
            t = time.perf_counter()
            admitted.append(node.admit(n, seed, self.max_new))
            if self.cuda:
                torch.cuda.synchronize()
            admit_s.append(time.perf_counter() - t)
            seed += 1
        b = len(node.running)
        if b == 0 or (phase.batch is not None and b < phase.batch):
            raise RuntimeError(f"admitted {b} requests, wanted {phase.batch or '>= 1'}")
        ctx = [r.cached_len for r in node.running]
        log(f"  {eng.label}/{tag(phase)}: admitted {b} requests (context {min(ctx)}-{max(ctx)}), "
            f"admission {max(admit_s):.3f}s max each")  # fmt: skip
        for _ in range(a.warmup):
            node.step()
        filled = 0
        counters = eviction_counter(kv)
        if counters is not None and phase.fill:
            # Steady state: a cache that has not filled yet never evicts. Warm up on until
            # it does (or fill_max steps), so the measured steps pay evictions.
            start = int(counters.sum())
            while filled < a.fill_max and int(counters.sum()) == start:
                node.step()
                filled += 1
        moes = [m for m in self.model.modules() if isinstance(m, LocalRoutedMoE)]
        if counters is not None:
            (kv.cache if eng.backend == "echo" else kv).reset_telemetry()
        for m in moes:
            m.touched.zero_()
            m.forwards.zero_()
        if timer is not None:
            timer.events.clear()
        wall, prep, post = [], [], []
        for _ in range(a.steps):
            t0 = time.perf_counter()
            node.step()
            t1 = time.perf_counter()
            wall.append((t1 - t0) * 1e3)
            if timer is not None:
                prep.append((timer.entered - t0) * 1e3)
                post.append((t1 - timer.left) * 1e3)
        if self.cuda:
            torch.cuda.synchronize()
            device_ms = [s.elapsed_time(e) for s, e in timer.events]
        else:
            device_ms = list(wall)
        step_ms = median(device_ms)
        res = {
            "engine": eng.label,
            "backend": eng.backend,
            "phase": phase.label,
            "repeat": phase.repeat,
            "pool": eng.pool,
            "dev_cache": eng.dev_cache,
            "host_pool": eng.host,
            "batch": b,
            "context": [min(ctx), max(ctx)],
            "fill_steps": filled,
            "locality_source": phase.locality.source,
            "admission_s": {"median": median(admit_s), "max": max(admit_s)},
            "step_ms_device": step_ms,
            "step_ms_device_p10_p90": spread(device_ms),
            "step_ms_wall": median(wall),
            "host_ms": {
                "before_launch": median(prep),
                "after_graph_launch": median(post),
                "wall_minus_device": median(wall) - step_ms if self.cuda else None,
            },
            "layer_us_device": step_ms * 1e3 / self.plan.layers,
            "tokens_per_s_device": b / step_ms * 1e3,
            "tokens_per_s_wall": b / median(wall) * 1e3,
            "experts_touched_per_layer": touched(moes),
        }
        if counters is not None:
            tel = kv.telemetry()
            res["hit_rate_per_layer"] = [round(h, 4) for h in tel["hit_rate"]]
            res["evictions_per_step"] = sum(tel["evictions"]) / a.steps
            res["recalled_mb_per_step"] = sum(tel["recalled_bytes"]) / a.steps / 2**20
        if phase.profile and self.cuda:
            try:
                res["breakdown"] = profile_breakdown(node, a.profile_steps)
            except Exception as exc:
                res["breakdown"] = {"error": f"{type(exc).__name__}: {exc}"}
        # Greedy outputs of every admitted request: backends that ran the same seeds at the
        # same batch must agree token for token (ECHO is lossless).
        res["outputs"] = [list(r.output) for r in admitted]
        node.release_all()
        res["leak_free"] = leak_free(eng, kv, runner)
        hit = res.get("hit_rate_per_layer")
        log(f"  {eng.label}/{tag(phase)}: b={b} step {step_ms:.3f} ms device, "
            f"{res['step_ms_wall']:.3f} ms wall, {res['tokens_per_s_device']:.1f} tok/s"
            + (f", hit {min(hit):.3f}-{max(hit):.3f}, evict/step {res['evictions_per_step']:.0f}"
               if hit else "") + f", leak_free {res['leak_free']}")  # fmt: skip
        return res


def touched(moes: list[LocalRoutedMoE]) -> float | None:
    """Experts a layer's MoE computed per forward, over the measured steps."""
    calls = sum(int(m.forwards) for m in moes)
    if not calls:
        return None
    return round(sum(int(m.touched) for m in moes) / calls, 3)
