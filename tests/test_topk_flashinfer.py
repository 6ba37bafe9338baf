"""FlashInfer's top-k behind our contract (kernels/topk_flashinfer.py).

On the CPU: the backend switch (bad values refused when the model is built, ``flashinfer``
asked for where it cannot run refused with the reason), and the adapter's finishing
step, which must turn any order of the right picks into the radix select's very tensor.
On the H200 (``-m gpu``, FlashInfer carried as benchmark/device_session.sh installs it):
the adapter's output equals the radix select's, ties, short rows and a CUDA graph's replay
included, and the model's decode is the same tensor with either top-k.
"""

from __future__ import annotations

import pytest
import torch

from sglang_echo.config import ENV_TOPK, EchoSettings
from sglang_echo.kernels import topk_flashinfer as tf
from sglang_echo.kernels.topk import topk_positions_reference


def topk_backend(environ: dict) -> str:
    """SGLANG_ECHO_TOPK as the registry parses it (config.py)."""
    return EchoSettings.from_env(environ).topk


def test_a_bad_backend_is_refused_with_the_allowed_values() -> None:
    with pytest.raises(ValueError, match="radix, flashinfer"):
        topk_backend({ENV_TOPK: "fast"})
    assert topk_backend({}) == "radix"
    assert topk_backend({ENV_TOPK: " FlashInfer "}) == "flashinfer"


def test_the_radix_select_is_the_default_and_flashinfer_says_why_it_cannot() -> None:
    scores = torch.zeros(2, 10)
    assert not tf.use_flashinfer(scores, 4)
    assert not tf.use_flashinfer(scores, 4, topk_backend({ENV_TOPK: "radix"}))
    with pytest.raises(RuntimeError, match=r"not on a CUDA device.*unset SGLANG_ECHO_TOPK"):
        tf.use_flashinfer(scores, 4, topk_backend({ENV_TOPK: "flashinfer"}))


def test_a_bad_backend_fails_when_the_model_is_built(small_checkpoint, monkeypatch) -> None:
    """At start-up (the settings' parse), and in a model built with it (handed down)."""
    from sglang_echo.config import load_settings
    from sglang_echo.model.attention import ModelKernels
    from sglang_echo.model.config import load_config
    from sglang_echo.model.indexer import LightningIndexer

    monkeypatch.setenv(ENV_TOPK, "fastest")
    with pytest.raises(ValueError, match="SGLANG_ECHO_TOPK='fastest' is not understood"):
        load_settings()
    with pytest.raises(ValueError, match="SGLANG_ECHO_TOPK='fastest' is not understood"):
        ModelKernels(topk="fastest")
    with pytest.raises(ValueError, match="'fastest' is not one of radix, flashinfer"):
        LightningIndexer(load_config(small_checkpoint), "fastest")


def _shuffled_picks(scores: torch.Tensor, qpos: torch.Tensor, k: int, seed: int):
    """The reference set in a random order, with a masked (-inf) pick where a row has
    fewer than k visible keys, as FlashInfer may return them."""
    g = torch.Generator().manual_seed(seed)
    ref = topk_positions_reference(scores, qpos, k)
    picks = ref.clone()
    for r in range(len(picks)):
        visible = int(qpos[r]) + 1
        if visible < k:  # a peer may fill the rest with -1 or keep a -inf key's index
            picks[r, visible] = visible if visible < scores.shape[1] else -1
        picks[r] = picks[r, torch.randperm(k, generator=g)]
    return ref, picks


@pytest.mark.parametrize("seed", range(3))
def test_ascending_picks_turns_any_order_into_the_radix_selects_tensor(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    rows, n, k = 6, 300, 40
    scores = (torch.randn(rows, n, generator=g) * 4).round() / 4  # ties at the k-th
    qpos = torch.randint(0, n, (rows,), generator=g)
    qpos[0], qpos[1] = 10, n - 1  # a short row and a full one
    masked = scores.masked_fill(torch.arange(n) > qpos.unsqueeze(1), float("-inf"))
    ref, picks = _shuffled_picks(masked, qpos, k, seed)
    got = tf.ascending_picks(masked, picks.to(torch.int32))
    assert got.dtype == torch.int64
    assert torch.equal(got, ref)
    # a different set is not hidden by the sort
    wrong = picks.clone()
    outside = [i for i in range(n) if i not in set(ref[1].tolist())]
    wrong[1, 0] = outside[0]  # the full row: one pick swapped for a key outside the set
    assert not torch.equal(tf.ascending_picks(masked, wrong), ref)


def _flashinfer_on_cuda() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    return tf.flashinfer_unavailable()


@pytest.mark.gpu
def test_flashinfer_adapter_equals_the_radix_select_on_the_gpu() -> None:
    reason = _flashinfer_on_cuda()
    if reason:
        pytest.skip(f"FlashInfer's top-k cannot run here: {reason}")
    from sglang_echo.kernels.topk import topk_positions

    g = torch.Generator(device="cuda").manual_seed(5)
    for rows, n, k in ((7, 3000, 256), (48, 20_000, 2048), (1, 100_000, 2048), (3, 1500, 2048)):
        scores = torch.randn(rows, n, device="cuda", generator=g)
        qpos = torch.randint(0, n, (rows,), device="cuda", generator=g)
        qpos[0] = n - 1
        for x in (scores, (scores * 2).round() / 2, torch.zeros_like(scores)):
            ours = topk_positions(x, qpos, k)
            for ragged in (True, False):
                got = tf.topk_positions_flashinfer(x, qpos, k, ragged=ragged)
                assert torch.equal(got, ours), (rows, n, k, ragged)
    # replayed from a CUDA graph on new contents of the captured input
    static = torch.randn(8, 5000, device="cuda", generator=g)
    qpos = torch.full((8,), 4999, device="cuda")
    tf.topk_positions_flashinfer(static, qpos, 512)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tf.topk_positions_flashinfer(static, qpos, 512)
    for _ in range(3):
        static.copy_(torch.randn(8, 5000, device="cuda", generator=g).round())
        graph.replay()
        assert torch.equal(out, topk_positions(static, qpos, 512))


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["default-rope", "fp8-indexer"])
def test_the_model_decodes_the_same_tensors_with_either_top_k(checkpoints, config, monkeypatch):
    """Greedy tokens and every step's logits, ECHO under eviction, replayed from CUDA
    graphs: FlashInfer's top-k against the radix select."""
    reason = _flashinfer_on_cuda()
    if reason:
        pytest.skip(f"FlashInfer's top-k cannot run here: {reason}")
    from sglang_echo.config import EchoConfig
    from sglang_echo.model.attention import ModelKernels
    from sglang_echo.model.loader import load_model
    from sglang_echo.runtime.engine import Engine
    from sglang_echo.runtime.kv_factory import echo_cache_for_model

    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 259, (n,), generator=g).tolist() for n in (90, 40, 120)]
    model = load_model(checkpoints[config], device="cuda", dtype=torch.bfloat16)
    cfg, new_tokens, batch, chunk = model.config, 16, 3, 8
    cap = sum(len(p) + new_tokens for p in prompts)
    width = max(len(p) for p in prompts) + new_tokens
    n_g = EchoConfig().min_dev_cache_size(batch, cfg.index_topk, chunk)
    outs = {}
    for backend in ("radix", "flashinfer"):
        ModelKernels(topk=backend).apply(model)  # as if the model was built with it
        echo = echo_cache_for_model(
            EchoConfig(offload=True, dev_cache_size=n_g), cfg, cap, torch.bfloat16, "cuda"
        )
        engine = Engine(model, echo, cap, batch, width, chunk, True, use_cuda_graph=True)
        outs[backend] = engine.generate(prompts, new_tokens, record_logits=True)
        assert sum(echo.telemetry()["evictions"]) > 0
        model.set_graph_safe(False)
    for a, b in zip(outs["radix"], outs["flashinfer"], strict=True):
        assert a.output == b.output
        assert all(torch.equal(x, y) for x, y in zip(a.step_logits, b.step_logits, strict=True))
