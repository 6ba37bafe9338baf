"""Top-k traces: the tracer records exactly the model's selections, the LRU simulation
matches a plain reference, the histogram/threshold helpers are right, and trace.py +
analyze.py run end to end on a freshly trained tiny checkpoint."""

from __future__ import annotations

import importlib.util
import json
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch

from dsa_helpers import train_tiny, write_corpus
from research.topk.cache_sim import (
    CacheTooSmall,
    per_request_hit_rate,
    shared_cache_hit_rate,
    simulate_lru,
)
from research.topk.driver import run_requests
from research.topk.tracer import TopkTracer, fp16_key_bins, fp32_key_bins, threshold_bin
from sglang_echo.model.loader import load_model

from oracle_utils import prefill_all_logits

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus") / "src")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus_dir):
    return train_tiny(tmp_path_factory.mktemp("trained"), corpus_dir)


def _script(name: str):
    path = REPO / "benchmark" / "topk" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"topk_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reference_lru(selections, appended, initial, capacity) -> list[int]:
    """Plain OrderedDict LRU with the documented semantics (ties: lower id first)."""
    stamp: dict[int, int] = OrderedDict((int(i), 0) for i in initial if i >= 0)
    hits = []

    def evict(n: int, now: int) -> None:
        victims = sorted((s, i) for i, s in stamp.items() if s < now)[:n]
        if len(victims) < n:
            raise CacheTooSmall("reference: too small")
        for _, i in victims:
            del stamp[i]

    for t in range(selections.shape[0]):
        now = t + 1
        for i in appended[t]:
            if i >= 0 and int(i) not in stamp:
                if len(stamp) + 1 > capacity:
                    evict(len(stamp) + 1 - capacity, now)
                stamp[int(i)] = now
        sel = sorted({int(i) for i in selections[t].ravel() if i >= 0})
        present = [i for i in sel if i in stamp]
        hits.append(len(present))
        for i in present:
            stamp[i] = now
        misses = [i for i in sel if i not in stamp]
        if len(stamp) + len(misses) > capacity:
            evict(len(stamp) + len(misses) - capacity, now)
        for i in misses:
            stamp[i] = now
    return hits


@pytest.mark.parametrize("seed", range(6))
def test_lru_simulation_matches_reference(seed):
    rng = np.random.default_rng(seed)
    steps, queries, k, universe = 30, 3, 6, 60
    sel = np.stack(
        [
            [rng.choice(universe, size=k, replace=False) for _ in range(queries)]
            for _ in range(steps)
        ]
    )
    sel[rng.random(sel.shape) < 0.1] = -1
    appended = universe + np.arange(steps * queries).reshape(steps, queries)
    initial = rng.choice(universe, size=k, replace=False)
    capacity = queries * k + queries + int(rng.integers(0, 20))
    got = simulate_lru(sel, appended, initial, capacity)
    assert got.hits.tolist() == reference_lru(sel, appended, initial, capacity)
    assert 0.0 <= got.hit_rate <= 1.0


def test_lru_cache_sizes_and_policies():
    steps, n_req, k = 20, 2, 4
    prompt_lens = np.array([50, 80])
    sel = np.stack([[np.arange(4) + (r * 7 + t) % 30 for r in range(n_req)] for t in range(steps)])
    init = sel[0]
    small = shared_cache_hit_rate(sel, prompt_lens, init, n_req * k + n_req)
    big = shared_cache_hit_rate(sel, prompt_lens, init, 1000)
    assert big.hit_rate >= small.hit_rate and big.evictions == 0
    # A per-request buffer as large as all distinct tokens never misses after warm-up.
    per_req = per_request_hit_rate(sel, prompt_lens, init, 64)
    assert per_req.hit_rate == big.hit_rate
    with pytest.raises(CacheTooSmall):
        shared_cache_hit_rate(sel, prompt_lens, init, n_req * k - 1)


def test_order_preserving_key_bins_and_threshold_bin():
    gen = torch.Generator().manual_seed(0)
    x = torch.cat((torch.randn(500, generator=gen) * 10, torch.tensor([0.0, 1e-30, -1e-30, -3e4])))
    order = torch.argsort(x)
    for fn in (fp32_key_bins, fp16_key_bins):
        bins = fn(x)[order]
        assert torch.all(bins[1:] >= bins[:-1]), fn.__name__  # monotone in the value
        assert bins.min() >= 0 and bins.max() <= 255
    scores = torch.randn(4, 300, generator=gen)
    valid = torch.ones_like(scores, dtype=torch.bool)
    valid[1, 100:] = False
    k = 20
    for fn in (fp32_key_bins, fp16_key_bins):
        bins = fn(scores)
        size, above = threshold_bin(bins, valid, k)
        for r in range(4):
            v = scores[r][valid[r]]
            kth = v.topk(k).values[-1]
            b_kth = int(fn(kth.view(1))[0])
            row_bins = bins[r][valid[r]]
            assert int(size[r]) == int((row_bins == b_kth).sum())
            assert int(above[r]) == int((row_bins > b_kth).sum())
            assert int(above[r]) < k <= int(above[r] + size[r])


def test_tracer_records_the_models_own_selection(trained):
    ckpt, _ = trained
    model = load_model(ckpt)
    k = model.config.index_topk
    gen = torch.Generator().manual_seed(3)
    tokens = [torch.randint(3, 259, (n,), generator=gen).tolist() for n in (40, 26)]
    prompt_lens, steps = [30, 16], 9
    tracer = TopkTracer(model)
    with tracer:
        out = run_requests(model, tokens, prompt_lens, steps, tracer=tracer)
    arr = tracer.arrays()
    assert arr["sel"].shape == (model.config.num_hidden_layers, steps, 2, k)
    # Hooks are gone: the class methods are back.
    assert "select" not in vars(model.model.layers[0].self_attn.indexer)
    for r, n in enumerate(prompt_lens):
        full = tokens[r][: n + steps]
        logits, topk = prefill_all_logits(model, full, record_topk=True)
        ref_nll = torch.nn.functional.cross_entropy(
            logits[n - 1 : n + steps - 1], torch.tensor(tokens[r][n : n + steps])
        )
        decode_nll = torch.cat((out.prefill_nll[r][-1:], out.decode_nll[: steps - 1, r]))
        assert torch.allclose(decode_nll.mean(), ref_nll, atol=1e-4)
        for layer, sel in enumerate(topk):
            for t in range(steps):
                want = {int(x) for x in sel[n + t].tolist() if x >= 0}
                got = {int(x) for x in arr["sel"][layer, t, r] if x >= 0}
                assert got == want, f"layer {layer} request {r} step {t}"
            last = {int(x) for x in sel[n - 1].tolist() if x >= 0}
            assert {int(x) for x in arr["prefill_sel"][layer, r] if x >= 0} == last
    # The k-th score is the smallest selected score, and theta follows the EMA.
    theta, kth = arr["theta"], arr["kth"]
    assert np.allclose(theta[:, 1:], 0.5 * kth[:, :-1] + 0.5 * theta[:, :-1], atol=1e-6)
    assert np.allclose(theta[:, 0], arr["prefill_kth"], atol=1e-6)
    assert np.all((arr["recall"] >= 0) & (arr["recall"] <= 1))


def test_trace_and_analyze_end_to_end(trained, tmp_path):
    """No --data-roots: the held-out files come from the training run's own roots."""
    ckpt, _ = trained
    npz = _script("trace").main(
        [
            "--model", str(ckpt), "--out-npz", str(tmp_path / "t.npz"), "--lengths", "70,120",
            "--per-length", "2", "--decode-steps", "12", "--device", "cpu",
            "--oracle-prompts", "2", "--oracle-prompt-len", "40",
            "--oracle-tokens", "8",
        ]
    )  # fmt: skip
    out = tmp_path / "results"
    path = _script("analyze").main(
        [
            "--npz",
            str(npz),
            "--train-json",
            str(ckpt.parent / "topk_train.json"),
            "--out-dir",
            str(out),
        ]
    )
    record = json.loads(path.read_text())
    assert {"name", "device", "date", "command", "metrics"} <= set(record)
    assert record["setup"]["oracle"]["identical"] is True
    assert all("mod_" in name for name in record["setup"]["requests"])  # the training corpus
    side = record["metrics"]["side_by_side"]
    for key, pair in side.items():
        assert set(pair) == {"trained", "untrained"}, key
        if "hit_rate" in key or key in ("consecutive_overlap", "recall_of_attention_topk"):
            assert all(0.0 <= v <= 1.0 for v in pair.values()), key
    for tag in ("trained", "untrained"):
        layers = record["metrics"][tag]["topk"]["per_layer"]
        assert len(layers) == 2
        hits = [layers[0]["echo_shared_hit_rate"][s] for s in ("1.25", "2", "8")]
        assert hits == sorted(hits)  # a larger LRU cache never hits less on the same trace
    for png in ("topk_overlap_hits.png", "topk_threshold.png", "topk_train_loss.png"):
        assert (out / png).stat().st_size > 10_000, png
    with np.load(npz) as z:
        assert z["trained__sel"].dtype == np.uint16
        assert z["trained__sel"].shape == (2, 12, 4, 8)
