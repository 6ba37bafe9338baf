"""fp8 KV rows end to end (``--kv-cache-dtype fp8_e4m3``, kernels/fp8_kv.py) on the CPU.

Lossless means offload equals no-offload at the same KV dtype: token ids and every step's
logits ``torch.equal`` for ECHO (its cache at the legal minimum, evicting) and for the
HiSparse-like backend, through the torch path and through the sparse-MLA kernel under the
interpreter. The pools really hold 656-byte-class fp8 rows (bytes), the output is close to
(not equal to) the bf16 KV run's, and widths the fp8 tiles cannot cover are refused with
a message that says what to use instead.
"""

from __future__ import annotations

import random

import pytest
import torch

from scripts.make_tiny_checkpoint import TinySpec, make_tiny_checkpoint
from sglang_echo.config import EchoConfig
from sglang_echo.kernels.fp8_kv import fp8_row_bytes
from sglang_echo.model.attention import ModelKernels
from sglang_echo.model.kv_cache import PlainKVCache
from sglang_echo.model.loader import load_model
from sglang_echo.offload.hisparse_cache import HiSparseKVCache
from sglang_echo.runtime.engine import Engine
from sglang_echo.runtime.kv_factory import echo_cache_for_model

NEW, BATCH, CHUNK = 6, 3, 8


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """A tiny model whose latent is one fp8 tile wide (kv_lora_rank 128)."""
    spec = TinySpec(seed=7, layers=2, kv_lora_rank=128, index_topk=12)
    return make_tiny_checkpoint(tmp_path_factory.mktemp("fp8kv") / "m", spec)


def _prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(3, 259) for _ in range(rng.randint(20, 70))] for _ in range(5)]


def _generate(model, cache, capacity: int, prompts):
    max_context = max(len(p) for p in prompts) + NEW
    engine = Engine(model, cache, capacity, BATCH, max_context, CHUNK, ignore_eos=True)
    return engine.generate(prompts, NEW, record_logits=True)


def _assert_equal(a_runs, b_runs, name: str) -> None:
    for a, b in zip(a_runs, b_runs, strict=True):
        assert a.output == b.output, name
        for step, (x, y) in enumerate(zip(a.step_logits, b.step_logits, strict=True)):
            assert torch.equal(x, y), f"{name}: logits differ at step {step}"


@pytest.mark.parametrize("backend", ["torch", "kernel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_kv_offload_equals_no_offload(fp8_checkpoint, backend, dtype, monkeypatch):
    if backend == "kernel":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    # SGLANG_ECHO_SPARSE_MLA=backend, as an entry point hands it to the model it builds.
    model = load_model(fp8_checkpoint, dtype=dtype, kernels=ModelKernels(sparse_mla=backend))
    cfg = model.config
    prompts = _prompts()
    capacity = sum(len(p) + NEW for p in prompts)
    plain = PlainKVCache.for_model(cfg, capacity, dtype, "cpu", kv_cache_dtype="fp8_e4m3")
    assert plain.kv.dtype == torch.uint8
    assert plain.kv.shape[-1] == fp8_row_bytes(cfg.kv_lora_rank, cfg.qk_rope_head_dim)
    legal_min = EchoConfig(offload=True).min_dev_cache_size(BATCH, cfg.index_topk, CHUNK)
    echo = echo_cache_for_model(
        EchoConfig(offload=True, dev_cache_size=legal_min), cfg, capacity, dtype, "cpu",
        kv_cache_dtype="fp8_e4m3",
    )  # fmt: skip
    assert echo.host.rows.dtype == echo.cache.rows.dtype == torch.uint8
    hisparse = HiSparseKVCache.for_model(
        cfg, capacity, BATCH, cfg.index_topk + 2, dtype, "cpu", kv_cache_dtype="fp8_e4m3"
    )
    base = _generate(model, plain, capacity, prompts)
    _assert_equal(base, _generate(model, echo, capacity, prompts), "echo")
    _assert_equal(base, _generate(model, hisparse, capacity, prompts), "hisparse-like")
    assert sum(echo.telemetry()["evictions"]) > 0  # under real cache pressure
    assert sum(hisparse.evictions.tolist()) > 0
    # fp8 rows are not the model dtype's: the first token's logits (same prompt, same
    # weights) differ from an unquantized pool's, by about what row noise of e4m3's size
    # gives: this random tiny model amplifies the rows' ~2.6% error to ~10-20% of its
    # logits (random 2.6% noise on the rows does the same); a bug would be far off.
    unquantized = _generate(
        model, PlainKVCache.for_model(cfg, capacity, dtype, "cpu"), capacity, prompts
    )
    for a, b in zip(base, unquantized, strict=True):
        x, y = a.step_logits[0].double(), b.step_logits[0].double()
        assert not torch.equal(x, y) and (x - y).norm() / y.norm() < 0.35


def test_fp8_kv_needs_whole_tiles(small_checkpoint, tmp_path, capsys):
    """The test models' latent (32) is not a whole fp8 tile: refused, with the fix named,
    by the cache factory, the server and the offline CLI."""
    from sglang_echo.generate import main as generate_main
    from sglang_echo.runtime.server_args import ServerArgError, ServerArgs
    from sglang_echo.runtime.serving import build_serving

    cfg = load_model(small_checkpoint).config
    with pytest.raises(ValueError, match="multiple of 128"):
        PlainKVCache.for_model(cfg, 100, torch.float32, "cpu", kv_cache_dtype="fp8_e4m3")
    args = ServerArgs(model_path=str(small_checkpoint), device="cpu", kv_cache_dtype="fp8_e4m3")
    with pytest.raises(ServerArgError, match="--kv-cache-dtype auto"):
        build_serving(args, echo=EchoConfig(offload=False))
    with pytest.raises(ValueError, match="bfloat16 model"):
        PlainKVCache.for_model(cfg, 100, torch.float32, "cpu", kv_cache_dtype="bfloat16")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"input_ids": [5, 6, 7]}\n')
    rc = generate_main(
        ["--model-path", str(small_checkpoint), "--prompts-file", str(prompts),
         "--max-new-tokens", "2", "--output", str(tmp_path / "o.jsonl"),
         "--kv-cache-dtype", "fp8_e4m3"]
    )  # fmt: skip
    assert rc == 2 and "multiple of 128" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fp8_kv_offload_equals_no_offload_with_graphs(fp8_checkpoint):
    """On the GPU: bf16 model, fp8 KV rows, decode captured in CUDA graphs, the sparse-MLA
    kernel dequantizing in registers and ECHO's recall copying 656-byte-class rows: ECHO
    at its legal minimum (evicting) and the HiSparse-like backend equal the plain pool."""
    model = load_model(fp8_checkpoint, device="cuda", dtype=torch.bfloat16)
    cfg = model.config
    prompts = _prompts()
    capacity = sum(len(p) + NEW for p in prompts)
    max_context = max(len(p) for p in prompts) + NEW
    legal_min = EchoConfig(offload=True).min_dev_cache_size(BATCH, cfg.index_topk, CHUNK)
    caches = {
        "plain": PlainKVCache.for_model(cfg, capacity, torch.bfloat16, "cuda", "fp8_e4m3"),
        "echo": echo_cache_for_model(
            EchoConfig(offload=True, dev_cache_size=legal_min), cfg, capacity, torch.bfloat16,
            "cuda", kv_cache_dtype="fp8_e4m3",
        ),
        "hisparse-like": HiSparseKVCache.for_model(
            cfg, capacity, BATCH, cfg.index_topk + 2, torch.bfloat16, "cuda",
            kv_cache_dtype="fp8_e4m3",
        ),
    }  # fmt: skip
    runs = {}
    for name, cache in caches.items():
        engine = Engine(
            model, cache, capacity, BATCH, max_context, CHUNK, ignore_eos=True,
            use_cuda_graph=True,
        )  # fmt: skip
        runs[name] = engine.generate(prompts, NEW, record_logits=True)
        model.set_graph_safe(False)
    for name in ("echo", "hisparse-like"):
        _assert_equal(runs["plain"], runs[name], name)
    assert sum(caches["echo"].telemetry()["evictions"]) > 0
