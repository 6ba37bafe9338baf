"""Our DeepSeek-V3.2 model against transformers' DeepseekV32ForCausalLM (float32, CPU)."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV32ForCausalLM as HFModel

from sglang_echo.model.kv_cache import PlainKVCache
from sglang_echo.model.loader import load_model
from sglang_echo.runtime.engine import Engine

from oracle_utils import hf_greedy, hf_prefill, prefill_all_logits, topk_set_mismatches

LOGITS_ATOL = 1e-4  # float32; observed max abs diff is ~1e-6
CONFIGS = ["default-rope", "yarn", "wide-moe"]


def _prompts(seed: int, lengths: list[int], vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def models(checkpoints):
    out = {}
    for name in CONFIGS:
        path = checkpoints[name]
        out[name] = (load_model(path), HFModel.from_pretrained(str(path)).eval())
    return out


@pytest.mark.parametrize("name", CONFIGS)
def test_prefill_logits_and_topk_match_transformers(models, name):
    ours, hf = models[name]
    for prompt in _prompts(11, [60, 90], ours.config.vocab_size):
        assert len(prompt) > 2 * ours.config.index_topk  # sparsity is exercised
        logits, our_topk = prefill_all_logits(ours, prompt, record_topk=True)
        ref_logits, ref_topk = hf_prefill(hf, prompt)
        diff = (logits - ref_logits).abs().max().item()
        assert diff < LOGITS_ATOL, f"{name}: prefill logits differ by {diff}"
        assert len(our_topk) == len(ref_topk) == ours.config.num_hidden_layers
        for layer, (a, b) in enumerate(zip(our_topk, ref_topk, strict=True)):
            bad = topk_set_mismatches(a, b)
            assert not bad, f"{name} layer {layer}: top-k sets differ at positions {bad[:5]}"


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_generation_matches_transformers_single_and_batched(models, name):
    ours, hf = models[name]
    cfg = ours.config
    prompts = _prompts(5, [9, 33, 52], cfg.vocab_size)  # mixed lengths, one below top-k
    new_tokens = 32
    expected = [hf_greedy(hf, p, new_tokens) for p in prompts]

    def run(batch_size: int, chunk: int) -> list[list[int]]:
        capacity = sum(len(p) + new_tokens for p in prompts)
        cache = PlainKVCache.for_model(cfg, capacity, torch.float32, "cpu")
        engine = Engine(ours, cache, capacity, batch_size, 128, chunk, ignore_eos=True)
        return [r.output for r in engine.generate(prompts, new_tokens)]

    assert run(batch_size=1, chunk=4096) == expected  # one prompt at a time
    assert run(batch_size=3, chunk=4096) == expected  # mixed lengths packed in one batch
    assert run(batch_size=3, chunk=16) == expected  # chunked prefill across requests


def test_rope_yarn_frequencies_match_transformers(checkpoints):
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from sglang_echo.model.config import load_config
    from sglang_echo.model.rope import rope_inv_freq

    path = checkpoints["yarn"]
    ours = load_config(path)
    hf_cfg = AutoConfig.from_pretrained(str(path))
    ref_freq, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    freq, factor = rope_inv_freq(ours.rope, ours.qk_rope_head_dim)
    assert torch.allclose(freq, ref_freq, rtol=1e-6, atol=0)
    assert factor == pytest.approx(ref_factor)
