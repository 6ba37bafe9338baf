"""The two-phase DSA-style training loop.

Phase 1 (dense warm-up): the model trains on the LM loss with dense causal attention while
each layer's indexer learns, from detached inputs, to match that layer's head-averaged
attention distribution (KL). Some phase-1 batches use long windows (flash attention makes
them cheap), so positions up to ``long_seq_len`` are seen. Phase 2 (sparse): every query
attends only to its indexer top-k; LM loss for the model, KL over the selected keys for
the indexer. Gradients of the two losses touch disjoint parameters and are clipped apart.

Learning rate: linear warm-up, constant through phase 1 and the first ``decay_delay``
sparse steps, then cosine decay to ``min_lr_frac`` over the rest of phase 2 (so the final,
sparse model is the annealed one).

Determinism: initialization, batch offsets and KL rows come from CPU generators seeded by
``seed``, so a fixed ``steps``/``dense_steps`` run repeats exactly on the CPU (on CUDA up
to kernel-level float nondeterminism). With ``steps=None`` the step counts are fitted to
the time budget: first from a short timed calibration (the model is then re-initialized),
then re-fitted from measured step times every ``log_every`` steps of phase 1 after warm-up
(both counts) and during the first ``decay_delay`` steps of phase 2 (the total). Until the
decay starts nothing depends on the counts except the phase switch itself, so the logged
final counts, passed as ``--steps``/``--dense-steps``, replay the very same run.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from research.train.data import WindowSampler
from research.train.forward import train_forward

AMP_MODES = ("bf16", "none")


class TrainConfigError(ValueError):
    """A training option is out of range."""


@dataclass
class TrainConfig:
    seed: int = 0
    steps: int | None = None  # optimizer steps in all; None = fit to the time budget
    dense_steps: int | None = None  # phase-1 steps; None = round(dense_frac * steps)
    dense_frac: float = 0.5
    seq_len: int = 4096
    batch_size: int = 16
    long_seq_len: int = 16384
    long_batch_size: int = 4
    long_every: int = 4  # every n-th phase-1 step uses a long batch; 0 = never
    kl_rows: int = 256  # query rows per sequence and layer for the indexer KL
    lr: float = 1.5e-3
    min_lr_frac: float = 0.1
    warmup_steps: int = 100
    decay_delay: int = 30  # constant-lr sparse steps before the decay (and the last re-fit)
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_windows: int = 8
    log_every: int = 10
    time_budget_s: float = 390.0  # wall time from process start, data loading included
    reserve_s: float = 20.0  # kept for the final evaluation and the checkpoint
    amp: str = "bf16"

    def validate(self) -> None:
        if self.amp not in AMP_MODES:
            raise TrainConfigError(f"--amp must be one of {AMP_MODES}, got {self.amp!r}")
        if self.steps is not None and self.steps < 1:
            raise TrainConfigError(f"--steps must be >= 1, got {self.steps}")
        if self.dense_steps is not None and (
            self.dense_steps < 0 or (self.steps is not None and self.dense_steps > self.steps)
        ):
            raise TrainConfigError("--dense-steps must be in [0, --steps]")
        if not 0.0 <= self.dense_frac <= 1.0:
            raise TrainConfigError("--dense-frac must be in [0, 1]")
        for name in ("seq_len", "batch_size", "kl_rows", "eval_every", "log_every", "warmup_steps"):
            if getattr(self, name) < 1:
                raise TrainConfigError(f"--{name.replace('_', '-')} must be >= 1")
        if self.long_every and (self.long_seq_len < 2 or self.long_batch_size < 1):
            raise TrainConfigError("--long-seq-len and --long-batch-size must be positive")
        if self.decay_delay < 0:
            raise TrainConfigError("--decay-delay must be >= 0")
        if self.time_budget_s <= 0:
            raise TrainConfigError("--time-budget-s must be positive")


@dataclass
class TrainResult:
    steps: int
    dense_steps: int
    stopped_by_time: bool
    curve: list[dict] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)
    calibration: dict = field(default_factory=dict)
    tokens_seen: int = 0
    train_seconds: float = 0.0
    steps_done: int = 0

    def final_eval(self, mode: str) -> dict | None:
        found = [e for e in self.evals if e["mode"] == mode]
        return found[-1] if found else None


@dataclass
class StepKind:
    mode: str
    batch: int
    seq: int

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


def step_kind(cfg: TrainConfig, step: int, dense_steps: int) -> StepKind:
    if step < dense_steps:
        if cfg.long_every and step % cfg.long_every == cfg.long_every - 1:
            return StepKind("dense", cfg.long_batch_size, cfg.long_seq_len)
        return StepKind("dense", cfg.batch_size, cfg.seq_len)
    return StepKind("sparse", cfg.batch_size, cfg.seq_len)


def decay_start(cfg: TrainConfig, total: int, dense_steps: int) -> int:
    """First step of the cosine decay: ``decay_delay`` steps into phase 2 (after warm-up)."""
    if dense_steps >= total:  # no sparse phase: decay over everything after warm-up
        return min(cfg.warmup_steps, max(0, total - 1))
    return max(cfg.warmup_steps, min(dense_steps + cfg.decay_delay, total - 1))


def lr_at(cfg: TrainConfig, step: int, total: int, dense_steps: int) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    start = decay_start(cfg, total, dense_steps)
    if step < start:
        return cfg.lr
    progress = min(1.0, (step - start) / max(1, total - 1 - start))
    return cfg.lr * (
        cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * progress))
    )


def _param_groups(model: nn.Module, weight_decay: float) -> tuple[list[dict], list, list]:
    main, indexer = [], []
    groups = []
    for is_indexer in (False, True):
        for decay in (True, False):
            params = [
                p
                for n, p in model.named_parameters()
                if (".indexer." in n) == is_indexer and (p.dim() >= 2) == decay
            ]
            if params:
                groups.append({"params": params, "weight_decay": weight_decay if decay else 0.0})
                (indexer if is_indexer else main).extend(params)
    return groups, main, indexer


class Trainer:
    """Owns the model, optimizer and generators of one run."""

    def __init__(
        self,
        build: Callable[[], nn.Module],
        sampler: WindowSampler,
        cfg: TrainConfig,
        device: torch.device,
        eval_data: tuple[torch.Tensor, torch.Tensor],
        log: Callable[[str], None] = print,
    ) -> None:
        cfg.validate()
        self.build, self.sampler, self.cfg, self.device = build, sampler, cfg, device
        self.eval_x, self.eval_y = eval_data
        self.log = log
        self.amp = cfg.amp == "bf16"
        self._reset()

    def _reset(self) -> None:
        self.model = self.build().to(self.device).train()
        groups, self.main_params, self.indexer_params = _param_groups(
            self.model, self.cfg.weight_decay
        )
        fused = self.device.type == "cuda"
        self.opt = torch.optim.AdamW(
            groups, lr=self.cfg.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused
        )
        self.row_gen = torch.Generator().manual_seed(self.cfg.seed + 1)

    def _autocast(self) -> torch.autocast:
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp)

    def _rows(self, seq: int) -> torch.Tensor:
        n = min(self.cfg.kl_rows, seq)
        rows = torch.randperm(seq, generator=self.row_gen)[:n].sort().values
        return rows.to(self.device)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def train_step(self, kind: StepKind, lr: float) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.sampler.sample(kind.batch, kind.seq)
        rows = self._rows(kind.seq)
        for group in self.opt.param_groups:
            group["lr"] = lr
        with self._autocast():
            out = train_forward(self.model, x, y, mode=kind.mode, kl_rows=rows)
        self.opt.zero_grad(set_to_none=True)
        (out.lm_loss + out.kl_loss).backward()
        torch.nn.utils.clip_grad_norm_(self.main_params, self.cfg.grad_clip)
        torch.nn.utils.clip_grad_norm_(self.indexer_params, self.cfg.grad_clip)
        self.opt.step()
        return out.lm_loss.detach(), out.kl_loss.detach()

    @torch.no_grad()
    def evaluate(self, mode: str) -> dict:
        self.model.eval()
        lm, kl, n = 0.0, 0.0, 0
        seq = self.eval_x.shape[1]
        gen = torch.Generator().manual_seed(self.cfg.seed + 2)
        rows = torch.randperm(seq, generator=gen)[: min(self.cfg.kl_rows, seq)].sort().values
        rows = rows.to(self.device)
        for s in range(0, self.eval_x.shape[0], self.cfg.batch_size):
            x = self.eval_x[s : s + self.cfg.batch_size].to(self.device)
            y = self.eval_y[s : s + self.cfg.batch_size].to(self.device)
            with self._autocast():
                out = train_forward(self.model, x, y, mode=mode, kl_rows=rows)
            lm += out.lm_loss.item() * x.shape[0]
            kl += out.kl_loss.item() * x.shape[0]
            n += x.shape[0]
        self.model.train()
        return {
            "mode": mode,
            "lm_loss": lm / n,
            "kl_loss": kl / n,
            "bits_per_token": lm / n / math.log(2),
        }

    # ------------------------------------------------------------------ planning
    def calibrate(self, t_start: float) -> dict:
        """Time each step kind (median of 3, after 2 warm-up steps) and one evaluation, then
        re-initialize model, optimizer and generators (calibration leaves no trace)."""
        cfg = self.cfg
        state = self.sampler.state()
        kinds = {"dense": StepKind("dense", cfg.batch_size, cfg.seq_len)}
        if cfg.long_every:
            kinds["dense_long"] = StepKind("dense", cfg.long_batch_size, cfg.long_seq_len)
        kinds["sparse"] = StepKind("sparse", cfg.batch_size, cfg.seq_len)
        times = {}
        for name, kind in kinds.items():
            for _ in range(2):  # warm-up: first-call kernel selection, allocator growth
                self.train_step(kind, 0.0)
            samples = []
            for _ in range(3):
                self._sync()
                t0 = time.time()
                self.train_step(kind, 0.0)
                self._sync()
                samples.append(time.time() - t0)
            times[name] = sorted(samples)[1]  # median
        t0 = time.time()
        self.evaluate("sparse")
        times["eval"] = time.time() - t0
        self.sampler.restore(state)
        self._reset()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        times["elapsed_at_plan_s"] = time.time() - t_start
        return times

    def _phase1_step_time(self, times: dict) -> float:
        cfg = self.cfg
        if not cfg.long_every:
            return times["dense"]
        return ((cfg.long_every - 1) * times["dense"] + times["dense_long"]) / cfg.long_every

    def plan(self, times: dict) -> tuple[int, int]:
        """Initial step counts from the calibration: phase-1 and phase-2 steps in the ratio
        dense_frac : 1 - dense_frac, filling the budget."""
        cfg = self.cfg
        # Evaluations: two at the phase boundary, two at the end, one every eval_every steps.
        left = cfg.time_budget_s - times["elapsed_at_plan_s"] - cfg.reserve_s - 4 * times["eval"]
        per_step = (
            cfg.dense_frac * self._phase1_step_time(times)
            + (1 - cfg.dense_frac) * times["sparse"]
            + times["eval"] / cfg.eval_every
        )
        steps = max(1, int(0.97 * left / per_step))
        return steps, round(cfg.dense_frac * steps)

    def _left(self, t_start: float, eval_s: float) -> float:
        return 0.97 * (
            t_start + self.cfg.time_budget_s - self.cfg.reserve_s - 2 * eval_s - time.time()
        )

    def _refit_dense(
        self, step: int, per_dense: float, t_start: float, times: dict
    ) -> tuple[int, int]:
        """At the end of warm-up: measured phase-1 step time -> both counts (the calibrated
        sparse step time scaled by the same measured/calibrated ratio)."""
        cfg = self.cfg
        per_sparse = times["sparse"] * per_dense / self._phase1_step_time(times)
        per_sparse += times["eval"] / cfg.eval_every
        left = self._left(t_start, times["eval"]) - 2 * times["eval"]  # + boundary evals
        if cfg.dense_steps is not None:  # phase 1 length fixed by the user
            dense = max(step, cfg.dense_steps)
            steps = dense + int((left - (dense - step) * per_dense) / per_sparse)
        else:
            f = cfg.dense_frac
            steps = int((left + step * per_dense) / (f * per_dense + (1 - f) * per_sparse))
            dense = round(f * steps)
        steps = max(step + 1, steps)
        return steps, max(step, min(steps, dense))

    def _refit_sparse(self, step: int, per_step: float, t_start: float, times: dict) -> int:
        """``decay_delay`` steps into phase 2: measured sparse step time -> total steps."""
        left = self._left(t_start, times["eval"])
        return max(step + 1, step + int(left / per_step))

    # ------------------------------------------------------------------ the run
    def run(self, t_start: float) -> TrainResult:
        cfg = self.cfg
        adaptive = cfg.steps is None
        calibration: dict = {}
        if adaptive:
            calibration = self.calibrate(t_start)
            steps, dense_steps = self.plan(calibration)
            if cfg.dense_steps is not None:
                dense_steps = min(cfg.dense_steps, steps)
            calibration["plans"] = [{"at_step": 0, "steps": steps, "dense_steps": dense_steps}]
            self.log(
                f"calibration {_fmt(calibration)} -> {steps} steps ({dense_steps} dense) "
                f"within {cfg.time_budget_s:.0f} s"
            )
        else:
            steps = cfg.steps
            dense_steps = (
                cfg.dense_steps if cfg.dense_steps is not None else round(cfg.dense_frac * steps)
            )
        result = TrainResult(steps, dense_steps, False, calibration=calibration)
        deadline = t_start + cfg.time_budget_s - cfg.reserve_s
        t_train = time.time()
        t_phase2 = t_train if dense_steps == 0 else None
        t_log, tok_log = time.time(), 0
        acc_lm = torch.zeros((), device=self.device)
        acc_kl = torch.zeros((), device=self.device)
        n_acc = 0
        step = 0
        while step < steps:
            refit_dense = (
                adaptive
                and cfg.warmup_steps <= step < dense_steps
                and (step == cfg.warmup_steps or step % cfg.log_every == 0)
            )
            if refit_dense:
                self._sync()
                per_step = (time.time() - t_train) / max(1, step)
                new = self._refit_dense(step, per_step, t_start, calibration)
                if new != (steps, dense_steps):
                    self._replanned(result, step, *new, per_step, quiet=step != cfg.warmup_steps)
                    steps, dense_steps = new
            if step == dense_steps and 0 < dense_steps < steps:
                for mode in ("dense", "sparse"):
                    result.evals.append({"step": step, **self.evaluate(mode)})
                self.log(f"phase boundary at step {step}: {result.evals[-2:]}")
                t_phase2 = time.time()
            refit_sparse = (
                adaptive
                and t_phase2 is not None
                and dense_steps < step <= dense_steps + cfg.decay_delay
                and (step == dense_steps + cfg.decay_delay or step % cfg.log_every == 0)
                and step < steps
            )
            if refit_sparse:
                self._sync()
                per_step = (time.time() - t_phase2) / (step - dense_steps)
                new_steps = self._refit_sparse(step, per_step, t_start, calibration)
                if new_steps != steps:
                    quiet = step != dense_steps + cfg.decay_delay
                    self._replanned(result, step, new_steps, dense_steps, per_step, quiet=quiet)
                    steps = new_steps
            if time.time() > deadline:
                result.stopped_by_time = True
                self.log(f"time budget reached: stopping at step {step} of {steps}")
                break
            kind = step_kind(cfg, step, dense_steps)
            lr = lr_at(cfg, step, steps, dense_steps)
            lm, kl = self.train_step(kind, lr)
            acc_lm += lm
            acc_kl += kl
            n_acc += 1
            tok_log += kind.tokens
            result.tokens_seen += kind.tokens
            step += 1
            if step % cfg.log_every == 0 or step == steps:
                self._sync()
                now = time.time()
                entry = {
                    "step": step,
                    "phase": kind.mode,
                    "lm_loss": (acc_lm / n_acc).item(),
                    "kl_loss": (acc_kl / n_acc).item(),
                    "lr": lr,
                    "tokens_per_s": tok_log / max(now - t_log, 1e-9),
                    "elapsed_s": now - t_start,
                }
                result.curve.append(entry)
                self.log(
                    f"step {step}/{steps} {kind.mode} lm {entry['lm_loss']:.4f} "
                    f"kl {entry['kl_loss']:.4f} lr {lr:.2e} "
                    f"{entry['tokens_per_s'] / 1e3:.0f}K tok/s {entry['elapsed_s']:.0f}s"
                )
                acc_lm.zero_()
                acc_kl.zero_()
                n_acc, t_log, tok_log = 0, now, 0
            if step % cfg.eval_every == 0 and step < steps:
                mode = "dense" if step < dense_steps else "sparse"
                result.evals.append({"step": step, **self.evaluate(mode)})
        result.steps, result.dense_steps, result.steps_done = steps, dense_steps, step
        for mode in ("dense", "sparse"):
            result.evals.append({"step": step, **self.evaluate(mode)})
        self.log(f"final held-out: {result.evals[-2:]}")
        result.train_seconds = time.time() - t_train
        return result

    def _replanned(
        self,
        result: TrainResult,
        step: int,
        steps: int,
        dense_steps: int,
        per_step: float,
        quiet: bool = False,
    ) -> None:
        result.calibration.setdefault("plans", []).append(
            {"at_step": step, "steps": steps, "dense_steps": dense_steps, "step_s": per_step}
        )
        if not quiet:
            self.log(
                f"re-fit at step {step} ({per_step:.3f} s/step): {steps} steps, {dense_steps} dense"
            )


def _fmt(d: dict) -> str:
    return ", ".join(f"{k} {v:.3f}" for k, v in d.items() if isinstance(v, (int, float)))


def config_dict(cfg: TrainConfig) -> dict:
    return asdict(cfg)
