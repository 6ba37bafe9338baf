"""The DSA training path: training forward = inference forward, the indexer's gradients come
from its KL only, a few-step run of scripts/train_tiny_dsa.py writes a checkpoint that our
model and transformers load and agree on, and training is deterministic by seed."""

from __future__ import annotations

import json
import time

import pytest
import torch

from dsa_helpers import train_tiny, write_corpus
from research.topk.driver import run_requests
from research.train import loop as loop_module
from research.train.data import WindowSampler, eval_windows, load_corpus
from research.train.forward import train_forward
from research.train.loop import TrainConfig, Trainer, lr_at
from research.train.spec import build_model
from scripts.make_tiny_checkpoint import TinySpec
from sglang_echo.model.loader import load_model

from oracle_utils import hf_greedy, prefill_all_logits

LOGITS_ATOL = 1e-4  # float32

FORWARD_SPECS = {
    "default-rope": TinySpec(
        layers=2,
        dense_layers=2,
        hidden=48,
        heads=3,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=12,
        intermediate=64,
        index_heads=4,
        index_dim=16,
        index_topk=8,
        max_position=256,
        init_std=0.2,
    ),
    "yarn": TinySpec(
        layers=2,
        dense_layers=2,
        hidden=32,
        heads=2,
        q_lora_rank=16,
        kv_lora_rank=24,
        qk_nope_head_dim=12,
        qk_rope_head_dim=8,
        v_head_dim=20,
        intermediate=48,
        index_heads=3,
        index_dim=16,
        index_topk=12,
        rope="yarn",
        max_position=512,
        init_std=0.2,
    ),
}


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus") / "src")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus_dir):
    return train_tiny(tmp_path_factory.mktemp("trained"), corpus_dir)


@pytest.mark.parametrize("name", list(FORWARD_SPECS))
def test_training_forward_matches_inference_forward(name):
    spec = FORWARD_SPECS[name]
    model = build_model(spec, seed=3)
    gen = torch.Generator().manual_seed(1)
    long_ids = torch.randint(3, 259, (2, 3 * spec.index_topk), generator=gen)
    short_ids = long_ids[:, : spec.index_topk]  # every key fits the top-k: dense == sparse
    with torch.no_grad():
        sparse = train_forward(model, long_ids, mode="sparse", exact_topk=True, return_logits=True)
        dense = train_forward(model, short_ids, mode="dense", return_logits=True)
        dense_long = train_forward(model, long_ids, mode="dense", return_logits=True)
    for b in range(long_ids.shape[0]):
        ref, _ = prefill_all_logits(model, long_ids[b].tolist())
        diff = (sparse.logits[b] - ref).abs().max().item()
        assert diff < LOGITS_ATOL, f"{name}: sparse training logits differ by {diff}"
        ref_short, _ = prefill_all_logits(model, short_ids[b].tolist())
        diff = (dense.logits[b] - ref_short).abs().max().item()
        assert diff < LOGITS_ATOL, f"{name}: dense training logits differ by {diff}"
    # Beyond k keys, top-k attention differs from dense: the sparse path is really sparse.
    assert (dense_long.logits - sparse.logits).abs().max().item() > 1e-3


def test_indexer_learns_only_from_kl_and_model_only_from_lm():
    spec = FORWARD_SPECS["default-rope"]
    model = build_model(spec, seed=4)
    ids = torch.randint(3, 259, (2, 30), generator=torch.Generator().manual_seed(2))
    rows = torch.tensor([3, 11, 29])
    for mode in ("dense", "sparse"):
        out = train_forward(model, ids, ids, mode=mode, kl_rows=rows)
        assert torch.isfinite(out.kl_loss) and out.kl_loss.item() >= -1e-6
        assert len(out.kl_per_layer) == spec.layers
        for loss, want_indexer in ((out.lm_loss, False), (out.kl_loss, True)):
            model.zero_grad(set_to_none=True)
            loss.backward(retain_graph=True)
            for n, p in model.named_parameters():
                has = p.grad is not None and p.grad.abs().sum().item() > 0
                if (".indexer." in n) != want_indexer:
                    assert not has, f"{mode}: {n} got a gradient from the wrong loss"
            got = [
                n for n, p in model.named_parameters() if p.grad is not None and ".indexer." in n
            ]
            assert bool(got) == want_indexer


def test_training_is_deterministic_by_seed(corpus_dir):
    corpus = load_corpus([("t", corpus_dir)], eval_fraction=0.1)
    spec = FORWARD_SPECS["default-rope"]
    cfg = TrainConfig(
        seed=5, steps=3, dense_steps=1, seq_len=48, batch_size=2, long_every=0, kl_rows=8,
        warmup_steps=1, eval_every=100, eval_windows=2, log_every=1, amp="none",
    )  # fmt: skip
    states = []
    for _ in range(2):
        sampler = WindowSampler(corpus.train_tokens, "cpu", seed=cfg.seed)
        trainer = Trainer(
            lambda: build_model(spec, cfg.seed),
            sampler,
            cfg,
            torch.device("cpu"),
            eval_windows(corpus.eval_docs, 2, cfg.seq_len),
            log=lambda _m: None,
        )
        result = trainer.run(time.time())
        assert [c["phase"] for c in result.curve] == ["dense", "sparse", "sparse"]
        states.append({k: v.clone() for k, v in trainer.model.state_dict().items()})
    for name, value in states[0].items():
        assert torch.equal(value, states[1][name]), f"{name} differs between identical runs"
    init = build_model(spec, cfg.seed).state_dict()
    assert not torch.equal(init["lm_head.weight"], states[0]["lm_head.weight"])


def test_corpus_dedupes_and_splits_by_content(tmp_path, corpus_dir):
    corpus = load_corpus([("t", corpus_dir)], eval_fraction=0.1)
    assert corpus.skipped["duplicate"] == 1 and corpus.skipped["empty"] == 1
    assert len(corpus.train_files) + len(corpus.eval_files) == 60
    # Renaming files does not move them between splits.
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    for i, f in enumerate(sorted(corpus_dir.glob("*.py"))):
        (renamed / f"x{i}.py").write_bytes(f.read_bytes())
    again = load_corpus([("t", renamed)], eval_fraction=0.1)
    assert {f.sha1 for f in again.eval_files} == {f.sha1 for f in corpus.eval_files}
    assert again.fingerprint() == corpus.fingerprint()


def test_train_script_checkpoint_loads_in_ours_and_transformers(trained):
    from transformers import DeepseekV32ForCausalLM as HFModel

    ckpt, record = trained
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v32"
    assert cfg["mlp_layer_types"] == ["dense"] * cfg["num_hidden_layers"]
    for name in ("tokenizer.json", "tokenizer_config.json", "README.md", "train_spec.json"):
        assert (ckpt / name).is_file(), name
    card = (ckpt / "README.md").read_text()
    assert "--steps 4 --dense-steps 2" in card
    phases = [c["phase"] for c in record["curve"]]
    assert phases == ["dense", "dense", "sparse", "sparse"]
    assert all(c["tokens_per_s"] > 0 for c in record["curve"])
    assert {e["mode"] for e in record["evals"]} == {"dense", "sparse"}

    ours = load_model(ckpt)
    hf = HFModel.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    k = ours.config.index_topk
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 259, (n,), generator=gen).tolist() for n in (5, 3 * k, 40)]
    new_tokens = 16
    expected = [hf_greedy(hf, p, new_tokens) for p in prompts]
    got = run_requests(ours, prompts, [len(p) for p in prompts], new_tokens, greedy=True)
    assert got.generated.tolist() == expected


def test_lr_schedule_does_not_depend_on_counts_before_the_refit_points():
    cfg = TrainConfig(lr=1e-3, warmup_steps=10, decay_delay=5, min_lr_frac=0.1)
    dense = 40
    for total in (60, 200, 1000):
        lrs = [lr_at(cfg, s, total, dense) for s in range(total)]
        assert lrs[:10] == pytest.approx([1e-3 * (s + 1) / 10 for s in range(10)])
        assert all(x == 1e-3 for x in lrs[10 : dense + 5])  # re-fits happen in here
        assert lrs[-1] == pytest.approx(1e-4)
        assert all(a >= b for a, b in zip(lrs[dense + 5 :], lrs[dense + 6 :], strict=False))
    # With no sparse phase the decay covers everything after warm-up.
    assert lr_at(cfg, 99, 100, 100) == pytest.approx(1e-4)


class _FakeClock:
    """Stands in for ``time`` in the training loop: time moves only when a step or an
    evaluation runs, by a fixed cost, so the budget logic is checked deterministically."""

    def __init__(self, start: float = 1000.0):
        self.now = start

    def time(self) -> float:
        return self.now


@pytest.mark.parametrize("slowdown", [False, True], ids=["steady", "slowing-down"])
def test_time_budgeted_run_plans_and_honours_its_budget(corpus_dir, monkeypatch, slowdown):
    """Step and evaluation costs on a fake clock: steady costs -> the calibrated plan runs
    to its planned count inside the budget; sparse steps that keep getting slower after
    the last re-plan -> the run stops at the deadline. Either way no step starts after
    the deadline and the run (final evaluations included) ends within the budget."""
    corpus = load_corpus([("t", corpus_dir)], eval_fraction=0.1)
    spec = FORWARD_SPECS["default-rope"]
    cfg = TrainConfig(
        seq_len=32, batch_size=2, long_seq_len=64, long_batch_size=1, long_every=2,
        kl_rows=8, warmup_steps=2, decay_delay=2, eval_every=1000, eval_windows=2,
        log_every=5, amp="none", time_budget_s=6.0, reserve_s=0.5,
    )  # fmt: skip
    clock = _FakeClock()
    monkeypatch.setattr(loop_module, "time", clock)
    trainer = Trainer(
        lambda: build_model(spec, 0),
        WindowSampler(corpus.train_tokens, "cpu", seed=0),
        cfg,
        torch.device("cpu"),
        eval_windows(corpus.eval_docs, 2, cfg.seq_len),
        log=lambda _m: None,
    )
    real_step, real_eval, real_calibrate = trainer.train_step, trainer.evaluate, trainer.calibrate
    starts: list[float] = []
    state = {"calibrating": False, "sparse_steps": 0}

    def step(kind, lr):
        out = real_step(kind, lr)
        cost = {"dense": 0.1, "sparse": 0.15}[kind.mode] * kind.seq / cfg.seq_len
        if not state["calibrating"]:
            starts.append(clock.now)
            if kind.mode == "sparse":
                state["sparse_steps"] += 1
                if slowdown and state["sparse_steps"] > cfg.decay_delay:
                    cost *= 1 + 0.5 * (state["sparse_steps"] - cfg.decay_delay)
        clock.now += cost
        return out

    def evaluate(mode):
        clock.now += 0.05
        return real_eval(mode)

    def calibrate(t_start):
        state["calibrating"] = True
        try:
            return real_calibrate(t_start)
        finally:
            state["calibrating"] = False

    trainer.train_step, trainer.evaluate, trainer.calibrate = step, evaluate, calibrate
    t0 = clock.now
    result = trainer.run(t0)
    plans = result.calibration["plans"]
    assert plans[0]["at_step"] == 0 and {"dense", "dense_long", "sparse"} <= set(result.calibration)
    assert result.calibration["dense"] == pytest.approx(0.1)
    assert result.calibration["dense_long"] == pytest.approx(0.2)
    assert result.calibration["sparse"] == pytest.approx(0.15)
    assert len(starts) == result.steps_done >= 1
    deadline = t0 + cfg.time_budget_s - cfg.reserve_s
    assert max(starts) <= deadline  # no step starts after the deadline
    assert clock.now <= t0 + cfg.time_budget_s  # final evaluations fit the reserve
    if slowdown:
        assert result.stopped_by_time and result.steps_done < result.steps
    else:
        assert not result.stopped_by_time and result.steps_done == result.steps
        assert result.dense_steps < result.steps  # both phases ran
