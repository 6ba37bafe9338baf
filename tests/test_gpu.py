"""CUDA checks (run on the H200 with ``pytest -m gpu -s``): the transformers oracle in
float32 and bfloat16, and ECHO's lossless guarantee with decode steps captured in CUDA
graphs, the host pool read through its pinned UVA view, and no host synchronisation
inside ``append``/``resolve``. Set ECHO_REPORT_DIR to save a JSON report."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from sglang_echo.config import DEFAULT_RESOLVE_OVERLAP_FROM, EchoConfig
from sglang_echo.model.kv_cache import PlainKVCache
from sglang_echo.model.loader import load_model
from sglang_echo.offload.echo_cache import EchoKVCache
from sglang_echo.runtime.engine import Engine
from sglang_echo.runtime.kv_factory import echo_cache_for_model

from oracle_utils import hf_greedy, hf_prefill, prefill_all_logits, topk_set_mismatches

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
CONFIGS = ["default-rope", "yarn", "wide-moe"]  # transformers oracle configs
LOSSLESS_CONFIGS = [*CONFIGS, "fp8-indexer"]  # + the fp8 indexer (Triton logits kernel)
REPORT: dict = {}


def _save(key: str, value) -> None:
    REPORT[key] = value
    out = os.environ.get("ECHO_REPORT_DIR")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        report = {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"),
            "command": "pytest -m gpu -s tests/test_gpu.py",
            **REPORT,
        }
        (Path(out) / "gpu_checks.json").write_text(json.dumps(report, indent=2))


def _prompts(seed: int, lengths: list[int], vocab: int = 259) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", CONFIGS)
def test_oracle_on_cuda(checkpoints, name, dtype):
    from transformers import DeepseekV32ForCausalLM as HFModel

    ours = load_model(checkpoints[name], device="cuda", dtype=dtype)
    hf = HFModel.from_pretrained(str(checkpoints[name]), dtype=dtype).to("cuda").eval()
    result = {"max_abs_logit_diff": 0.0, "rel_l2": 0.0, "topk_mismatch_positions": 0}
    for prompt in _prompts(11, [60, 90]):
        logits, ours_topk = prefill_all_logits(ours, prompt, record_topk=True)
        ref, ref_topk = hf_prefill(hf, prompt)
        result["max_abs_logit_diff"] = max(
            result["max_abs_logit_diff"], (logits - ref).abs().max().item()
        )
        rel = ((logits - ref).norm() / ref.norm()).item()
        result["rel_l2"] = max(result["rel_l2"], rel)
        result["topk_mismatch_positions"] += sum(
            len(topk_set_mismatches(a.cpu(), b.cpu()))
            for a, b in zip(ours_topk, ref_topk, strict=True)
        )
    if dtype != torch.float32:
        # Two bf16 implementations differ from each other by bf16 rounding; what matters is
        # that ours is no further from the float32 reference than transformers' bf16 is.
        ref32 = HFModel.from_pretrained(str(checkpoints[name]), dtype=torch.float32).to("cuda")
        ours_err, hf_err = 0.0, 0.0
        for prompt in _prompts(11, [60, 90]):
            exact, _ = hf_prefill(ref32.eval(), prompt)
            mine, _ = prefill_all_logits(ours, prompt)
            theirs, _ = hf_prefill(hf, prompt)
            ours_err = max(ours_err, ((mine - exact).norm() / exact.norm()).item())
            hf_err = max(hf_err, ((theirs - exact).norm() / exact.norm()).item())
        result["rel_l2_vs_fp32_ours"] = ours_err
        result["rel_l2_vs_fp32_transformers"] = hf_err
        del ref32
    prompts = _prompts(5, [9, 33, 52])
    expected = [hf_greedy(hf, p, 32) for p in prompts]
    cfg = ours.config
    cap = sum(len(p) + 32 for p in prompts)
    cache = PlainKVCache.for_model(cfg, cap, dtype, "cuda")
    got = [r.output for r in Engine(ours, cache, cap, 3, 128, 4096, True).generate(prompts, 32)]
    same = [
        sum(int(a == b) for a, b in zip(x, y, strict=True))
        for x, y in zip(got, expected, strict=True)
    ]
    first_diff = [
        next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), 32)
        for x, y in zip(got, expected, strict=True)
    ]
    result["greedy_identical_prefix"] = first_diff
    result["greedy_tokens_equal"] = same
    _save(f"oracle/{name}/{str(dtype).split('.')[-1]}", result)
    print(name, dtype, result)
    if dtype == torch.float32:
        assert result["max_abs_logit_diff"] < 1e-3  # TF32 stays off for fp32 matmuls
        assert result["topk_mismatch_positions"] == 0
        assert got == expected
    else:
        assert result["rel_l2_vs_fp32_ours"] <= 1.5 * result["rel_l2_vs_fp32_transformers"] + 1e-2


def _lossless_pair(
    model,
    prompts,
    new_tokens,
    batch_size,
    chunk,
    use_graph,
    sync_check,
    fuse_decode=False,
    resolve_overlap=DEFAULT_RESOLVE_OVERLAP_FROM,
):
    cfg = model.config
    dtype = model.lm_head.weight.dtype
    cap = sum(len(p) + new_tokens for p in prompts)
    width = max(len(p) for p in prompts) + new_tokens
    n_g = EchoConfig().min_dev_cache_size(batch_size, cfg.index_topk, min(chunk, cap))
    # fuse_decode: SGLANG_NSA_FUSE_LOGITS_RECALL_DECODE=1 (decode prefetch on side streams)
    # and, with it, SGLANG_NSA_FUSE_LOGITS_RECALL_EXTEND=1 (prefill prefetch, same stream).
    echo_cfg = EchoConfig(
        offload=True,
        dev_cache_size=n_g,
        fuse_decode=fuse_decode,
        fuse_extend=bool(fuse_decode),
        resolve_overlap=resolve_overlap,
    )
    echo = echo_cache_for_model(echo_cfg, cfg, cap, dtype, "cuda")
    assert echo.host.pinned and echo.manager.graph_safe, "pinned host pool must have a UVA view"
    plain = PlainKVCache.for_model(cfg, cap, dtype, "cuda")
    outs = {}
    for name, cache in (("plain", plain), ("echo", echo)):
        engine = Engine(model, cache, cap, batch_size, width, chunk, True, use_cuda_graph=use_graph)
        if sync_check and name == "echo":
            _install_sync_check(echo)
        outs[name] = engine.generate(prompts, new_tokens, record_logits=True)
    for a, b in zip(outs["plain"], outs["echo"], strict=True):
        assert a.output == b.output
        for x, y in zip(a.step_logits, b.step_logits, strict=True):
            assert torch.equal(x, y)
    tel = echo.telemetry()
    assert echo.cache.free_count.tolist() == [n_g] * cfg.num_hidden_layers
    return {
        "dev_cache": n_g,
        "hit_rate": [round(r, 3) for r in tel["hit_rate"]],
        "evictions": sum(tel["evictions"]),
        "append_evictions": sum(tel["append_evictions"]),
        "prefetched_rows": sum(tel["prefetched_rows"]),
        "prefetch_hits": sum(tel["prefetch_hits"]),
        "prefetch_steps": tel["prefetch_steps"],  # auto: [on, all] decode steps
    }


def _install_sync_check(cache: EchoKVCache) -> None:
    """Make any host synchronisation inside append/resolve raise."""
    manager = cache.manager
    for op in ("append", "resolve", "prefetch"):
        original = getattr(manager, op)

        def checked(*args, _orig=original, **kwargs):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return _orig(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode(0)

        setattr(manager, op, checked)


@pytest.mark.parametrize("fuse_decode", [False, True, "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lossless_cuda_graph_decode(checkpoints, dtype, fuse_decode):
    import random

    reports = []
    for seed in range(12):
        rng = random.Random(seed)
        name = LOSSLESS_CONFIGS[seed % 4]
        model = load_model(checkpoints[name], device="cuda", dtype=dtype)
        prompts = [
            [rng.randrange(3, 259) for _ in range(rng.randint(20, 120))]
            for _ in range(rng.randint(2, 6))
        ]
        bs = rng.randint(1, 4)
        chunk = rng.choice([4, 8, 12])  # <= batch x top-k: the cache is at its minimum
        # The default (these batches resolve in line) and every step's resolve beside the
        # query's GEMMs (what batches from DEFAULT_RESOLVE_OVERLAP_FROM up run), in turn.
        overlap = DEFAULT_RESOLVE_OVERLAP_FROM if seed % 2 == 0 else 1
        r = _lossless_pair(
            model, prompts, 16, bs, chunk, use_graph=True, sync_check=False,
            fuse_decode=fuse_decode, resolve_overlap=overlap,
        )  # fmt: skip
        r.update(config=name, batch_size=bs, chunk=chunk, resolve_overlap=overlap)
        reports.append(r)
        model.set_graph_safe(False)
    # Eager mode, with host synchronisation made an error inside append/resolve/prefetch.
    # With prefetch: the fp8 indexer, i.e. the chunked logits and the staging kernels.
    name = "fp8-indexer" if fuse_decode else "default-rope"
    model = load_model(checkpoints[name], device="cuda", dtype=dtype)
    eager = _lossless_pair(
        model, _prompts(3, [40, 70, 25]), 12, 3, 32, use_graph=False, sync_check=True,
        fuse_decode=fuse_decode,
    )  # fmt: skip
    suffix = {False: "", True: "/prefetch", "auto": "/prefetch_auto"}[fuse_decode]
    _save(
        f"lossless_graph/{str(dtype).split('.')[-1]}{suffix}",
        {"graph_runs": reports, "eager_sync_checked": eager},
    )
    assert all(r["evictions"] > 0 for r in reports)
    # The resolve beside the query projection ran (model/attention.py), not only in line.
    from sglang_echo.model import attention

    assert attention._SIDE_STREAMS, "no decode resolve ran beside the query projection"
    assert {r["resolve_overlap"] for r in reports} == {1, DEFAULT_RESOLVE_OVERLAP_FROM}
    if fuse_decode:
        assert sum(r["prefetched_rows"] for r in reports) > 0
        assert sum(r["prefetch_hits"] for r in reports) > 0
    if fuse_decode == "auto":  # both decode graphs of a batch size ran: prefetch on and off
        on = sum(r["prefetch_steps"][0] for r in reports)
        assert 0 < on < sum(r["prefetch_steps"][1] for r in reports)
    print(json.dumps(reports, indent=1))
