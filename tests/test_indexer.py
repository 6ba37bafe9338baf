"""Indexer building blocks: exact top-k with deterministic ties, and the fp8 + Hadamard mode."""

from __future__ import annotations

import json
import shutil

import torch

from sglang_echo.kernels.topk import select_topk
from sglang_echo.model.indexer import fp8_round_trip, hadamard_matrix
from sglang_echo.model.loader import load_model

from oracle_utils import prefill_all_logits


def test_select_topk_is_exact_causal_and_breaks_ties_to_lower_positions():
    scores = torch.tensor([[[0.0, 5.0, 0.0, 0.0, 9.0, 7.0]]])
    pos = select_topk(scores, torch.tensor([[3]]), topk=3)
    assert pos.tolist() == [[[1, 0, 2]]]  # 4 and 5 are in the future; ties -> lower first
    padded = select_topk(scores, torch.tensor([[1]]), topk=4)
    assert padded.tolist() == [[[1, 0, -1, -1]]]  # fewer visible keys than k: -1 pads


def test_select_topk_independent_of_padding_width():
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 3, (2, 5, 40), generator=g).float()  # many exact ties
    qpos = torch.randint(10, 40, (2, 5), generator=g)
    narrow = select_topk(scores, qpos, 8)
    wide = select_topk(torch.cat((scores, torch.randn(2, 5, 24)), -1), qpos, 8)
    assert torch.equal(narrow, wide)


def test_hadamard_is_orthonormal_and_fp8_round_trip_is_close():
    h = hadamard_matrix(64, torch.device("cpu"), torch.float64)
    assert torch.allclose(h @ h.T, torch.eye(64, dtype=torch.float64), atol=1e-12)
    x = torch.randn(32, 128)
    rel = ((fp8_round_trip(x) - x).norm() / x.norm()).item()
    assert 0 < rel < 0.05  # e4m3 keeps 3 mantissa bits


def test_fp8_hadamard_indexer_mode_selects_nearly_the_same_tokens(small_checkpoint, tmp_path):
    path = tmp_path / "fp8"
    shutil.copytree(small_checkpoint, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["indexer_mode"] = "fp8_hadamard"
    (path / "config.json").write_text(json.dumps(cfg))
    prompt = list(range(10, 120))
    exact = prefill_all_logits(load_model(small_checkpoint), prompt, record_topk=True)[1]
    model = load_model(path)
    assert model.config.indexer_mode == "fp8_hadamard"
    quant = prefill_all_logits(model, prompt, record_topk=True)[1]
    overlaps = []
    for a, b in zip(exact, quant, strict=True):
        for t in range(len(prompt)):
            x = {v for v in a[t].tolist() if v >= 0}
            y = {v for v in b[t].tolist() if v >= 0}
            overlaps.append(len(x & y) / len(x))
    mean = sum(overlaps) / len(overlaps)
    print(f"fp8+Hadamard indexer: mean top-k overlap with the exact indexer {mean:.3f}")
    assert 0.8 < mean < 1.0  # close, and really quantized (not the exact path)
