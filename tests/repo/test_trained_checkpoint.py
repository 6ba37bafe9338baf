"""The committed trained model (issue 6, trained on the H200 by scripts/train_tiny_dsa.py):
it is small enough to commit, transformers and our model produce the same greedy tokens
from it, it has learned something (lower loss on text than its untrained twin), and ECHO
at its legal minimum cache is lossless on it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from research.topk.driver import run_requests
from sglang_echo.model.loader import load_model
from sglang_echo.tokenizer import load_tokenizer

from oracle_utils import hf_greedy, prefill_all_logits
from test_lossless import Workload, run_pair

ROOT = Path(__file__).resolve().parents[2]
CKPT = ROOT / "models" / "tiny-dsv32-trained"
SOURCE = ROOT / "python" / "sglang_echo" / "runtime" / "scheduler.py"  # text it never saw


@pytest.fixture(scope="module")
def model():
    return load_model(CKPT, dtype=torch.float32)


@pytest.fixture(scope="module")
def code_ids() -> list[int]:
    return load_tokenizer(CKPT).encode(SOURCE.read_text()).ids


def test_checkpoint_is_complete_and_small():
    for name in ("config.json", "tokenizer.json", "README.md", "train_spec.json"):
        assert (CKPT / name).is_file(), name
    size = sum(p.stat().st_size for p in CKPT.iterdir())
    assert size <= 40 * 2**20, f"{size / 2**20:.1f} MiB exceeds the 40 MB limit"
    card = (CKPT / "README.md").read_text()
    assert "scripts/train_tiny_dsa.py" in card  # the retrain command
    record = json.loads((ROOT / "benchmark/results/topk_train.json").read_text())
    assert record["metrics"]["steps_done"] > record["metrics"]["dense_steps"] > 0


def test_transformers_and_ours_give_the_same_greedy_tokens(model, code_ids):
    from transformers import DeepseekV32ForCausalLM as HFModel

    hf = HFModel.from_pretrained(str(CKPT), dtype=torch.float32).eval()
    k = model.config.index_topk
    prompts = [code_ids[: 3 * k], code_ids[500 : 500 + k + 40]]  # both longer than top-k
    new_tokens = 24
    expected = [hf_greedy(hf, p, new_tokens) for p in prompts]
    got = run_requests(model, prompts, [len(p) for p in prompts], new_tokens, greedy=True)
    assert got.generated.tolist() == expected


def test_trained_model_predicts_unseen_code(model, code_ids):
    """Its loss on source it never saw is far below a byte-uniform guess (ln 256 = 5.55
    nats, where random weights sit); the trace record says the same against its twin."""
    logits, _ = prefill_all_logits(model, code_ids[:768])
    target = torch.tensor(code_ids[1:768])
    nll = torch.nn.functional.cross_entropy(logits[:-1].float(), target).item()
    assert nll < 3.0, f"{nll:.2f} nats per byte"
    side = json.loads((ROOT / "benchmark/results/topk_traces.json").read_text())
    pair = side["metrics"]["side_by_side"]["heldout_prefill_nll"]
    assert pair["trained"] < pair["untrained"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_echo_is_lossless_on_the_trained_model(code_ids, dtype):
    """Three code prompts, longer than the cache, at ECHO's legal minimum: identical ids
    and logits, with evictions in every layer."""
    m = load_model(CKPT, dtype=dtype)
    prompts = [code_ids[:300], code_ids[300:700], code_ids[700:860]]
    w = Workload("trained", dtype, batch_size=2, chunk=64, prompts=prompts, new_tokens=12)
    report = run_pair(m, w)
    assert report["resolve_evictions"] > 0
    assert report["misses"] > 0
