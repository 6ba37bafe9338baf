"""CUDA: MTP rounds replayed from real CUDA graphs (runtime/spec_graphs.py) are lossless
under ECHO at the smallest legal cache for Q: the same tokens, accept lengths and
bit-identical verify logits as the plain pool replayed the same way, with evictions; every
round shape is captured (none fails) and replayed; the replayed verifies agree with eager
ones up to rounding (a value baked into a graph would not). Tokens against the eager
rounds of real drafts are printed (float GEMMs of other shapes may round differently)."""

from __future__ import annotations

import random

import pytest
import torch

from scripts.make_tiny_checkpoint import TinySpec, make_tiny_checkpoint
from sglang_echo.config import EchoConfig
from sglang_echo.model.kv_cache import PlainKVCache
from sglang_echo.model.loader import load_model, load_nextn
from sglang_echo.runtime.kv_factory import echo_cache_for_model
from sglang_echo.runtime.speculative import SpeculativeGenerator
from spec_drafts import script_generator_drafts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
SPEC = TinySpec(seed=4, num_nextn_predict_layers=1)
BATCH, CHUNK, CONTEXT, NEW, S = 3, 16, 128, 12, 2


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("spec_gpu") / "moe", SPEC)
    target = load_model(path, device="cuda")
    return target, load_nextn(path, "cuda", target=target)


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, SPEC.vocab_size) for _ in range(rng.randint(50, 70))]
            for _ in range(BATCH)]  # fmt: skip


def _capacity(prompts) -> int:
    return sum(len(p) + NEW + 4 for p in prompts)


def _generate(models, cache, prompts, graphs: bool):
    gen = SpeculativeGenerator(
        *models, cache, S, _capacity(prompts), BATCH, CONTEXT, chunk_size=CHUNK,
        cuda_graphs=graphs,
    )  # fmt: skip
    return gen, gen.generate(prompts, NEW)


def test_rounds_from_cuda_graphs_are_lossless_under_echo(models, monkeypatch):
    target, _ = models
    prompts = _prompts()
    dtype = target.lm_head.weight.dtype

    def plain():
        return PlainKVCache.for_model(target.config, _capacity(prompts), dtype, "cuda")

    _, reference = _generate(models, plain(), prompts, graphs=False)
    script_generator_drafts(  # every accept length commits
        monkeypatch,
        lambda live: {tuple(p): r.tokens for p, r in zip(prompts, reference, strict=True)}[
            tuple(live.seq.prompt)
        ],
        SPEC.vocab_size,
    )
    _, eager_plain = _generate(models, plain(), prompts, graphs=False)
    gen_plain, replayed_plain = _generate(models, plain(), prompts, graphs=True)
    # A value baked into a graph would show as wrong logits in a later replay: the replayed
    # verifies agree with the eager ones (the same scripted inputs) up to rounding (other
    # shapes, the MoE's graph-safe dispatch).
    for e, r in zip(eager_plain, replayed_plain, strict=True):
        assert e.accept_lens == r.accept_lens
        for a, b in zip(e.verify_logits, r.verify_logits, strict=True):
            assert torch.allclose(a, b, atol=1e-3, rtol=1e-3), (a - b).abs().max()
    n_g = EchoConfig(offload=True).min_dev_cache_size(
        BATCH, target.config.index_topk, CHUNK, queries_per_request=S + 1
    )
    echo_cache = echo_cache_for_model(
        EchoConfig(offload=True, dev_cache_size=n_g), target.config, _capacity(prompts),
        dtype, "cuda",
    )  # fmt: skip
    gen_echo, replayed_echo = _generate(models, echo_cache, prompts, graphs=True)
    for gen in (gen_plain, gen_echo):
        graphs = gen.rounds.graphs
        assert graphs.captures > 0 and graphs.capture_failures == 0, graphs.eager_shapes
    assert sum(echo_cache.telemetry()["evictions"]) > 0  # real pressure
    assert {n for o in replayed_echo for n in o.accept_lens} == set(range(1, S + 2))
    for p, e in zip(replayed_plain, replayed_echo, strict=True):
        assert e.tokens == p.tokens and e.accept_lens == p.accept_lens
        assert all(torch.equal(a, b) for a, b in zip(e.verify_logits, p.verify_logits, strict=True))
    same = sum(a.tokens == b.tokens for a, b in zip(replayed_echo, reference, strict=True))
    print(f"\nrounds from graphs vs eager: {same}/{BATCH} requests with equal tokens")
