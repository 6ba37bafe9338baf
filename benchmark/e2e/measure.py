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
from dataclasses import dataclass, field

import torch

from benchmark.e2e.engines import (
    build,
    eviction_counter,
    kv_device_bytes,
    leak_free,
    placed_unselected,
)
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
        self.nodes: list[DecodeNode] = []  # of the phases running now (released on failure)

    def past_deadline(self) -> float | None:
        """Seconds since the start when past ``--deadline-s`` (None: not past, or none)."""
        spent = elapsed()
        return spent if self.args.deadline_s and spent > self.args.deadline_s else None

    def run_block(self, steps: list[tuple[Engine, Phase]]) -> None:
        """One block of the schedule: its engines are built at their first step and freed
        at its end, so a ratio's two sides share the GPU's state while they alternate."""
        built: dict[str, tuple] = {}
        dropped: set[str] = set()
        for group in joint_groups(steps):
            ready = [(eng, phase) for eng, phase in group if self.ready(eng, phase, built, dropped)]
            if len(ready) > 1:
                self.run_joint([(eng, phase, *built[eng.label]) for eng, phase in ready])
            elif ready:
                eng, phase = ready[0]
                self.run_step(eng, phase, *built[eng.label])
        built.clear()
        self.nodes = []
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    def ready(self, eng: Engine, phase: Phase, built: dict, dropped: set[str]) -> bool:
        """Whether (eng, phase) runs: its engine built (now, at its first step) and the
        deadline not passed for a repeat; a skip or a failed build is logged as an error."""
        if eng.label in dropped:
            return False
        late = self.past_deadline()
        if eng.label not in built:
            if late is not None:
                msg = f"{eng.label}: skipped at {late:.0f}s, past the {self.args.deadline_s}s deadline"
                log(msg)
                self.errors.append(msg)
                dropped.add(eng.label)
                return False
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
                return False
        elif phase.repeat and late is not None:
            msg = (f"{eng.label}/{tag(phase)}: repeat skipped at {late:.0f}s, past the "
                   f"{self.args.deadline_s}s deadline")  # fmt: skip
            log(msg)
            self.errors.append(msg)
            return False
        return True

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
        """Measure one phase (admit, warm up, time ``--steps`` decode steps, profile,
        release) and keep its result; a failure is an error, not the end."""
        self.run_joint([(eng, phase, kv, runner, timer, dev_bytes)])

    def run_joint(self, items: list[tuple]) -> None:
        """Measure phases of several engines together, their timed steps alternating one
        engine after the other (A B C A B C ...), so that each step of one has its partners'
        steps beside it in time: the GPU's drift over the run cancels in their ratios
        (``step_ms_device_steps``). A failure is an error for every engine of the group,
        not the end."""
        self.nodes = []
        try:
            lives = [self.start_phase(eng, phase, kv, runner, timer) for eng, phase, kv, runner, timer, _ in items]  # fmt: skip
            for _ in range(self.args.steps):
                for live in lives:
                    live.timed_step()
            results = [self.finish_phase(live) for live in lives]
        except Exception as exc:  # keep what the other phases measure
            for eng, phase, *_ in items:
                msg = f"{eng.label}/{tag(phase)}: {type(exc).__name__}: {exc}"
                log("ERROR " + msg)
                self.errors.append(msg)
            for node in self.nodes:
                node.release_all()
            return
        for res, (eng, _, kv, _, _, dev_bytes) in zip(results, items, strict=True):
            res["kv_device_bytes"] = (
                kv_device_bytes(kv) if eng.backend != "no-offload" else dev_bytes
            )
            if len(items) > 1:
                res["alternated_with"] = [e.label for e, *_ in items if e.label != eng.label]
            self.runs.append(res)
        self.save()

    def start_phase(self, eng: Engine, phase: Phase, kv, runner: StepRunner, timer) -> LivePhase:
        """Admit the phase's requests, warm up (and fill), reset the counters: ready for
        its timed steps."""
        a = self.args
        synth = SyntheticKV(self.cfg, self.directions, phase.locality, self.plan.dtype, self.device)
        node = DecodeNode(runner, synth, self.cfg.vocab_size)
        self.nodes.append(node)
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
        counters = eviction_counter(kv)
        curve: list[list[int]] = []  # [steps since admission, hits, misses] (all layers)
        for _ in range(a.warmup):
            node.step()
            note_hits(curve, kv, counters)
        filled = 0
        if counters is not None and phase.fill:
            # Steady state: a cache that has not filled yet never evicts, and one that still
            # holds placed prompt rows no step selected (ECHO places a transferred prompt in
            # free slots; they are the first victims) has less room for selected rows than
            # it will have. Warm up on until it evicts and those rows are gone (or fill_max
            # steps), so the measured steps pay a steady state's evictions.
            start = int(counters.sum())
            while filled < a.fill_max and (
                int(counters.sum()) == start or placed_unselected(kv) > 0
            ):
                node.step()
                filled += 1
                note_hits(curve, kv, counters)
        moes = [m for m in self.model.modules() if isinstance(m, LocalRoutedMoE)]
        warm_counts = None
        if counters is not None:
            tel = kv.telemetry()
            warm_counts = (tel["hits"], tel["misses"], a.warmup + filled)
            (kv.cache if eng.backend == "echo" else kv).reset_telemetry()
        for m in moes:
            m.touched.zero_()
            m.forwards.zero_()
        if timer is not None:
            timer.events.clear()
        live = LivePhase(
            eng, phase, kv, runner, timer, node, admitted, admit_s, ctx, filled, moes, warm_counts
        )
        live.hit_curve = curve
        return live

    def finish_phase(self, live: LivePhase) -> dict:
        """The phase's result after its timed steps: device and wall times, telemetry, the
        profile (where asked), every request's greedy output; then release and check."""
        a, eng, phase, kv, node = self.args, live.eng, live.phase, live.kv, live.node
        wall, prep, post = live.wall, live.prep, live.post
        if self.cuda:
            torch.cuda.synchronize()
            device_ms = [s.elapsed_time(e) for s, e in live.timer.events]
        else:
            device_ms = list(wall)
        step_ms = median(device_ms)
        b = len(node.running)
        res = {
            "engine": eng.label,
            "backend": eng.backend,
            "phase": phase.label,
            "repeat": phase.repeat,
            "pool": eng.pool,
            "dev_cache": eng.dev_cache,
            "host_pool": eng.host,
            "batch": b,
            "context": [min(live.ctx), max(live.ctx)],
            "fill_steps": live.filled,
            "locality_source": phase.locality.source,
            "admission_s": {"median": median(live.admit_s), "max": max(live.admit_s)},
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
            "experts_touched_per_layer": touched(live.moes),
        }
        if phase.paired:  # each timed step, for the ratios of steps taken side by side
            res["step_ms_device_steps"] = [round(x, 5) for x in device_ms]
        if eng.backend == "echo":
            res["echo_options"] = {
                "decode_place": eng.decode_place,
                "resolve_overlap": eng.resolve_overlap,
                "fuse_decode": eng.fuse_decode,
            }
        if eviction_counter(kv) is not None:
            tel = kv.telemetry()
            res["hit_rate_per_layer"] = [round(h, 4) for h in tel["hit_rate"]]
            if live.warm_counts is not None:  # every step since admission, warm-up included
                res.update(hit_rate_from_admission(live.warm_counts, tel, a.steps))
                res["hit_curve_from_admission"] = live.hit_curve
            res["evictions_per_step"] = sum(tel["evictions"]) / a.steps
            res["recalled_mb_per_step"] = sum(tel["recalled_bytes"]) / a.steps / 2**20
            if tel.get("prefetch_steps"):  # decode prefetch under auto: [on, all] steps
                res["prefetch_steps"] = tel["prefetch_steps"]
                res["prefetched_rows"] = sum(tel["prefetched_rows"])
                res["prefetch_hits"] = sum(tel["prefetch_hits"])
        if phase.profile and self.cuda:
            try:
                res["breakdown"] = profile_breakdown(node, a.profile_steps)
            except Exception as exc:
                res["breakdown"] = {"error": f"{type(exc).__name__}: {exc}"}
        # Greedy outputs of every admitted request: backends that ran the same seeds at the
        # same batch must agree token for token (ECHO is lossless).
        res["outputs"] = [list(r.output) for r in live.admitted]
        node.release_all()
        res["leak_free"] = leak_free(eng, kv, live.runner)
        hit = res.get("hit_rate_per_layer")
        log(f"  {eng.label}/{tag(phase)}: b={b} step {step_ms:.3f} ms device, "
            f"{res['step_ms_wall']:.3f} ms wall, {res['tokens_per_s_device']:.1f} tok/s"
            + (f", hit {min(hit):.3f}-{max(hit):.3f}, evict/step {res['evictions_per_step']:.0f}"
               if hit else "") + f", leak_free {res['leak_free']}")  # fmt: skip
        return res


def note_hits(curve: list[list[int]], kv, counters) -> None:
    """Append the cache's hits and misses so far (summed over layers) at this step since
    admission; nothing for a backend without counters.

    Why: a served request lives only as many steps as it has output tokens, and the
    workload's hit rate grows with a request's age, so a served hit rate is to be set
    beside the study's at the same ages (benchmark/served_vs_study.py), not beside its
    timed steps'. Read in the untimed warm-up and fill steps only."""
    if counters is None:
        return
    tel = kv.telemetry()
    curve.append([len(curve) + 1, int(sum(tel["hits"])), int(sum(tel["misses"]))])


def hit_rate_from_admission(warm_counts: tuple, tel: dict, timed_steps: int) -> dict:
    """The hit rate per layer over every decode step since admission (warm-up, fill and
    timed steps), beside the timed steps' own.

    Why: the synthetic workload's locality grows as requests decode (their own keys join
    the stable part: benchmark/study/locality.py), so the timed steps, which come after a
    long fill, hit more than a request's first steps do. A server's requests are seen at
    every step from their first, so this is the study's figure to set beside a served
    run's hit rate, with the number of steps it spans."""
    hits0, misses0, steps0 = warm_counts
    rates = [
        round((h0 + h) / (h0 + h + m0 + m), 4) if h0 + h + m0 + m else 1.0
        for h0, m0, h, m in zip(hits0, misses0, tel["hits"], tel["misses"], strict=True)
    ]
    return {"hit_rate_from_admission": rates, "decode_steps_from_admission": steps0 + timed_steps}


@dataclass
class LivePhase:
    """One engine's phase between its admission and its result: its node and requests,
    and the clocks of its timed steps so far."""

    eng: Engine
    phase: Phase
    kv: object
    runner: StepRunner
    timer: object
    node: DecodeNode
    admitted: list
    admit_s: list[float]
    ctx: list[int]
    filled: int
    moes: list
    warm_counts: tuple[list[int], list[int], int] | None  # hits, misses, steps before the timed
    wall: list[float] = field(default_factory=list)
    prep: list[float] = field(default_factory=list)
    post: list[float] = field(default_factory=list)
    hit_curve: list[list[int]] = field(default_factory=list)  # note_hits, warm-up and fill

    def timed_step(self) -> None:
        t0 = time.perf_counter()
        self.node.step()
        t1 = time.perf_counter()
        self.wall.append((t1 - t0) * 1e3)
        if self.timer is not None:
            self.prep.append((self.timer.entered - t0) * 1e3)
            self.post.append((t1 - self.timer.left) * 1e3)


def joint_groups(steps: list[tuple[Engine, Phase]]) -> list[list[tuple[Engine, Phase]]]:
    """The block's steps in order, consecutive steps of one paired phase (same label and
    repeat, different engines) grouped to run alternated; every other step alone."""
    groups: list[list[tuple[Engine, Phase]]] = []
    for eng, phase in steps:
        last = groups[-1] if groups else None
        if (
            last
            and phase.paired
            and last[-1][1].paired
            and (last[-1][1].label, last[-1][1].repeat) == (phase.label, phase.repeat)
            and all(e.label != eng.label for e, _ in last)
        ):
            last.append((eng, phase))
        else:
            groups.append([(eng, phase)])
    return groups


def touched(moes: list[LocalRoutedMoE]) -> float | None:
    """Experts a layer's MoE computed per forward, over the measured steps."""
    calls = sum(int(m.forwards) for m in moes)
    if not calls:
        return None
    return round(sum(int(m.touched) for m in moes) / calls, 3)
