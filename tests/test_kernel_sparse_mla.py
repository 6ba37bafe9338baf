"""Sparse-MLA kernel (kernels/sparse_mla.py) vs the torch path, and lossless with it.

Tolerances (relative L2 error against the torch path on the same inputs): float32 within
1e-5 (IEEE float32 dots; observed ~2e-7), bfloat16 within 1e-2 of the float32 result on
the same bf16 inputs (observed ~4e-3, as close as the torch bf16 path itself). Exact
equality where it is the claim: the same rows presented through two different buffers
and indices give the same bits (what keeps offload == no-offload).
"""

from __future__ import annotations

import pytest
import torch

from sglang_echo.config import ENV_SPARSE_MLA, EchoSettings, reset_settings
from sglang_echo.kernels.fp8_kv import dequantize_kv_rows, fp8_row_bytes, quantize_kv_rows
from sglang_echo.kernels.sparse_mla import sparse_mla_from_buffer, sparse_mla_reference
from sglang_echo.model import attention as attention_module
from sglang_echo.model.attention import ModelKernels
from sglang_echo.model.config import ModelConfigError

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def _case(queries, heads, topk, slots, lat, rope, dtype, seed, index_dtype=torch.int64):
    """q, buffer and rows with ragged -1 (trailing padding and holes), every query live."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(queries, heads, lat + rope, generator=g) * 2
    buffer = torch.randn(slots, lat + rope, generator=g)
    rows = torch.randint(0, slots, (queries, topk), generator=g)
    for t in range(queries):
        live = int(torch.randint(1, topk + 1, (1,), generator=g))
        rows[t, live:] = -1  # fewer visible tokens than top-k
    holes = torch.rand(queries, topk, generator=g) < 0.2
    holes[:, 0] = False
    rows[holes] = -1
    return q.to(dtype).to(DEV), buffer.to(dtype).to(DEV), rows.to(index_dtype).to(DEV)


FP32, BF16 = torch.float32, torch.bfloat16


@pytest.mark.parametrize(
    ("dtype", "queries", "heads", "topk", "lat", "rope", "block_h", "block_k"),
    [
        # DeepSeek-V3.2 rows, the default blocks: K not a multiple of the row block, two
        # head blocks, the last one partial
        (FP32, 3, 40, 40, 512, 64, 32, 32),
        (BF16, 3, 40, 40, 512, 64, 32, 32),
        # tiny-model widths: neither part a power of two
        (FP32, 5, 3, 24, 24, 8, 32, 16),
        (BF16, 5, 3, 24, 24, 8, 32, 16),
    ],
)
def test_matches_reference(dtype, queries, heads, topk, lat, rope, block_h, block_k):
    seed = queries * 100 + heads + topk
    q, buffer, rows = _case(queries, heads, topk, 70, lat, rope, dtype, seed, torch.int32)
    scale = (lat + rope) ** -0.5
    got = sparse_mla_from_buffer(q, buffer, rows, lat, scale, block_h=block_h, block_k=block_k)
    assert got.dtype == dtype and got.shape == (queries, heads, lat)
    assert torch.isfinite(got).all()
    # The float32 torch path on the same (possibly bf16-valued) inputs.
    want = sparse_mla_reference(q.float(), buffer.float(), rows, lat, scale)
    assert _rel(got, want) <= TOL[dtype]
    if dtype == torch.bfloat16:  # and no farther from the bf16 torch path than bf16 allows
        assert _rel(got, sparse_mla_reference(q, buffer, rows, lat, scale)) <= TOL[dtype]


def test_query_without_selection_gives_zeros():
    """The torch path gives NaN for such a query (softmax over only -inf); the model never
    makes one (each query selects at least its own token); the kernel writes zeros."""
    q, buffer, rows = _case(3, 4, 16, 30, 32, 16, torch.float32, seed=7)
    rows[1] = -1
    got = sparse_mla_from_buffer(q, buffer, rows, 32, 0.2)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    want = sparse_mla_reference(q, buffer, rows, 32, 0.2)
    assert torch.isnan(want[1]).all()
    keep = torch.tensor([0, 2])
    assert _rel(got[keep], want[keep]) <= TOL[torch.float32]


@pytest.mark.parametrize("splits", [3])
def test_split_rows_merge_to_the_reference(splits):
    """K divided among ``splits`` programs and merged (3 splits of 2 row blocks: one split
    is empty): the same function, zeros for a query with no row, deterministic."""
    q, buffer, rows = _case(4, 3, 24, 40, 24, 8, FP32, seed=splits)
    rows[2] = -1
    got = sparse_mla_from_buffer(q, buffer, rows, 24, 0.3, block_k=16, splits=splits)
    want = sparse_mla_reference(q, buffer, rows, 24, 0.3)
    keep = torch.tensor([0, 1, 3])
    assert _rel(got[keep], want[keep]) <= TOL[FP32]
    assert torch.equal(got[2], torch.zeros_like(got[2]))
    again = sparse_mla_from_buffer(q, buffer, rows, 24, 0.3, block_k=16, splits=splits)
    assert torch.equal(again, got)


@pytest.mark.parametrize("dtype", [torch.bfloat16])  # float32: test_lossless_with_kernel
def test_same_rows_through_another_buffer_are_bit_identical(dtype):
    """Offload and no-offload hand the kernel the same rows in the same order from
    different buffers at different indices (int64 locations vs int32 slots): the output
    must not change by a bit. Nor may a query's output depend on the other queries of the
    launch. (Only bf16 at this width: a float32 IEEE variant takes ~10 s to compile for
    sm_90; the float32 model-level test below makes the same comparison.)"""
    q, buffer, rows = _case(4, 40, 40, 50, 512, 64, dtype, seed=11)
    g = torch.Generator().manual_seed(3)
    perm = torch.randperm(80, generator=g).to(DEV)  # slot of each original row, and junk
    moved = torch.randn(80, buffer.shape[1], generator=g).to(dtype).to(DEV)
    moved[perm[:50]] = buffer
    moved_rows = torch.where(rows >= 0, perm[rows.clamp(min=0)], -1).to(torch.int32)
    a = sparse_mla_from_buffer(q, buffer, rows, 512, 0.1)
    b = sparse_mla_from_buffer(q, moved, moved_rows, 512, 0.1)
    assert torch.equal(a, b)
    alone = sparse_mla_from_buffer(q[2:3], moved, moved_rows[2:3], 512, 0.1)
    assert torch.equal(alone[0], a[2])
    assert torch.equal(sparse_mla_from_buffer(q, buffer, rows, 512, 0.1), a)  # deterministic


# ---------------------------------------------------------------- fp8 rows
@pytest.mark.parametrize(
    ("dtype", "lat", "splits"), [(BF16, 512, 1), (BF16, 256, 2), (FP32, 128, 1)]
)
def test_fp8_rows_equal_the_kernel_on_their_dequantized_rows(dtype, lat, splits):
    """kernels/fp8_kv.py rows, dequantized in registers, give the bits the same kernel
    gives on the rows dequantized by the torch path (the one rounding to the query dtype
    is the same; the interpreter rounds float32 -> bf16 to nearest even, as the GPU does),
    and land near the float32 attention on those rows."""
    q, buffer, rows = _case(3, 40, 40, 70, lat, 64, FP32, seed=lat + splits)
    packed = quantize_kv_rows(buffer, lat)
    deq = dequantize_kv_rows(packed, lat, dtype)
    scale = (lat + 64) ** -0.5
    got = sparse_mla_from_buffer(q.to(dtype), packed, rows, lat, scale, splits=splits)
    same = sparse_mla_from_buffer(q.to(dtype), deq, rows, lat, scale, splits=splits)
    assert torch.equal(got, same)
    want = sparse_mla_reference(q.to(dtype).float(), deq.float(), rows, lat, scale)
    assert _rel(got, want) <= TOL[dtype]
    ref = sparse_mla_reference(q.to(dtype), packed, rows, lat, scale)  # the torch path
    assert _rel(ref, want) <= TOL[dtype]


def test_fp8_rows_through_another_buffer_are_bit_identical():
    """The lossless property at the fp8 KV dtype: the same fp8 rows moved to other slots."""
    q, buffer, rows = _case(3, 40, 40, 50, 512, 64, BF16, seed=21)
    packed = quantize_kv_rows(buffer, 512)
    g = torch.Generator().manual_seed(4)
    perm = torch.randperm(90, generator=g).to(DEV)
    moved = quantize_kv_rows(torch.randn(90, 576, generator=g).to(DEV), 512)
    moved[perm[:50]] = packed
    moved_rows = torch.where(rows >= 0, perm[rows.clamp(min=0)], -1).to(torch.int32)
    a = sparse_mla_from_buffer(q, packed, rows, 512, 0.1)
    assert torch.equal(sparse_mla_from_buffer(q, moved, moved_rows, 512, 0.1), a)


def test_fp8_row_format():
    """656 bytes at DeepSeek-V3.2's widths; the rope key exact, the latent within e4m3's
    precision per tile; an all-zero tile stays zero; widths the tiles cannot cover and
    buffers of the wrong row size are refused."""
    assert fp8_row_bytes(512, 64) == 656
    rows = torch.randn(7, 576) * torch.logspace(-3, 2, 7).unsqueeze(1)  # tiles of any range
    rows[2, :128] = 0
    packed = quantize_kv_rows(rows, 512)
    assert packed.dtype == torch.uint8 and packed.shape == (7, 656)
    back = dequantize_kv_rows(packed, 512, torch.float32)
    assert torch.equal(back[:, 512:], rows[:, 512:].bfloat16().float())
    assert torch.equal(back[2, :128], torch.zeros(128))
    err = (back[:, :512] - rows[:, :512]).view(7, 4, 128).abs().amax(-1)
    assert (err <= rows[:, :512].view(7, 4, 128).abs().amax(-1) / 16 + 1e-12).all()
    with pytest.raises(ValueError, match="multiple of 128"):
        fp8_row_bytes(200, 64)
    q, _, r = _case(2, 4, 16, 10, 512, 64, BF16, seed=1)
    with pytest.raises(ValueError, match="656-byte rows"):
        sparse_mla_from_buffer(q, packed[:, :-16].to(DEV), r, 512, 0.1)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda q, b, r: (q[0], b, r), "expects q"),
        (lambda q, b, r: (q, b[:, :-1], r), "row width"),
        (lambda q, b, r: (q, b.double(), r), "one dtype"),
        (lambda q, b, r: (q.half(), b.half(), r), "one dtype"),
        (lambda q, b, r: (q, b, r.float()), "int32 or int64"),
        (lambda q, b, r: (q, b, r[:1]), "queries"),
    ],
)
def test_rejects_bad_input(change, match):
    q, buffer, rows = _case(2, 2, 16, 10, 16, 16, torch.float32, seed=1)
    with pytest.raises(ValueError, match=match):
        sparse_mla_from_buffer(*change(q, buffer, rows), 16, 0.1)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        sparse_mla_from_buffer(q, buffer, rows, 32, 0.1)
    with pytest.raises(ValueError, match="block_k"):
        sparse_mla_from_buffer(q, buffer, rows, 16, 0.1, block_k=24)
    with pytest.raises(ValueError, match="splits"):
        sparse_mla_from_buffer(q, buffer, rows, 16, 0.1, splits=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors are the point")
def test_cpu_tensors_need_the_interpreter(monkeypatch):
    q, buffer, rows = _case(1, 2, 16, 10, 16, 16, torch.float32, seed=2)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        sparse_mla_from_buffer(q, buffer, rows, 16, 0.1)


# ---------------------------------------------------------------- the switch and the model
@pytest.fixture
def backend(monkeypatch):
    """Set SGLANG_ECHO_SPARSE_MLA (the settings are forgotten around each change)."""

    def set_to(value: str | None) -> None:
        if value is None:
            monkeypatch.delenv(ENV_SPARSE_MLA, raising=False)
        else:
            monkeypatch.setenv(ENV_SPARSE_MLA, value)
        reset_settings()

    yield set_to
    monkeypatch.undo()
    reset_settings()


def test_switch_reads_the_environment(backend):
    """The entry points hand the settings' value to the model (ModelKernels.from_settings);
    a bad value fails the start-up's parse, and a model built with one."""

    def handed_down() -> str:
        return ModelKernels.from_settings(EchoSettings.from_env()).sparse_mla

    backend(None)
    assert handed_down() == "auto"
    backend("torch")
    assert handed_down() == "torch"
    backend(" Kernel ")
    assert handed_down() == "kernel"
    backend("triton")
    with pytest.raises(ValueError, match=r"SGLANG_ECHO_SPARSE_MLA='triton'.*auto, torch, kernel"):
        handed_down()
    with pytest.raises(
        ModelConfigError, match=r"SGLANG_ECHO_SPARSE_MLA='triton'.*auto, torch, kernel"
    ):
        ModelKernels(sparse_mla="triton")


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="CPU (interpreter) run; test_cuda_lossless_with_kernel on GPUs",
)
def test_lossless_with_kernel(checkpoints, monkeypatch):
    """A tiny model end to end with SGLANG_ECHO_SPARSE_MLA=kernel: no-offload vs ECHO at
    the legal minimum cache, token ids and every step's logits torch.equal."""
    from sglang_echo.model.loader import load_model

    from test_lossless import Workload, run_pair

    # Count the prefill fallback that stages blocks (ECHO's cache too small for a chunk's
    # distinct rows); no-offload always takes the whole chunk straight from its buffer.
    calls = {"gather_selected": 0}
    original = attention_module.gather_selected

    def counted(*args, **kwargs):
        calls["gather_selected"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(attention_module, "gather_selected", counted)
    kernels = ModelKernels(sparse_mla="kernel")  # what an entry point passes under "kernel"
    model = load_model(checkpoints["default-rope"], dtype=torch.float32, kernels=kernels)
    backends = {m.sparse_mla_backend for m in model.modules() if hasattr(m, "sparse_mla_backend")}
    assert backends == {"kernel"}
    w = Workload(
        config="default-rope",
        dtype=torch.float32,
        batch_size=2,
        chunk=16,  # = top-k: a chunk's distinct rows overflow the minimum cache
        prompts=[[(5 * i + 11 * j) % 250 + 3 for j in range(n)] for i, n in enumerate((37, 9))],
        new_tokens=3,
    )
    report = run_pair(model, w)
    assert report["resolve_evictions"] > 0
    assert calls["gather_selected"] > 0


# ---------------------------------------------------------------- CUDA
def _permuted(buffer: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same rows at other slots (a random permutation) and the indices that find them:
    what offload and no-offload hand the kernel."""
    perm = torch.randperm(buffer.shape[0], device=DEV)
    moved = torch.empty_like(buffer)
    moved[perm] = buffer
    return moved, torch.where(rows >= 0, perm[rows.clamp(min=0)], -1).to(torch.int32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_decode_size_matches_reference(dtype):
    """DeepSeek-V3.2 decode: batch 8, top-k 2048, 128 heads, 576-wide rows; one pass and
    split in 4; the same rows through a permuted buffer give the same bits."""
    q, buffer, rows = _case(8, 128, 2048, 65_536, 512, 64, dtype, seed=5)
    scale = 576**-0.5
    want = sparse_mla_reference(q.float(), buffer.float(), rows, 512, scale)
    moved, moved_rows = _permuted(buffer, rows)
    for splits in (1, 4):
        got = sparse_mla_from_buffer(q, buffer, rows, 512, scale, splits=splits)
        assert torch.isfinite(got).all()
        assert _rel(got, want) <= TOL[dtype], splits
        assert torch.equal(sparse_mla_from_buffer(q, buffer, rows, 512, scale, splits=splits), got)
        again = sparse_mla_from_buffer(q, moved, moved_rows, 512, scale, splits=splits)
        assert torch.equal(again, got), splits


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fp8_decode_size_equals_its_dequantized_rows():
    """DeepSeek-V3.2 decode at fp8 KV (656-byte rows): the bits of the bf16 kernel on the
    dequantized rows, one pass and split in 4, and the same through a permuted buffer."""
    q, buffer, rows = _case(8, 128, 2048, 65_536, 512, 64, BF16, seed=6)
    packed = quantize_kv_rows(buffer, 512)
    deq = dequantize_kv_rows(packed, 512, BF16)
    scale = 576**-0.5
    want = sparse_mla_reference(q.float(), deq.float(), rows, 512, scale)
    moved, moved_rows = _permuted(packed, rows)
    for splits in (1, 4):
        got = sparse_mla_from_buffer(q, packed, rows, 512, scale, splits=splits)
        assert torch.equal(got, sparse_mla_from_buffer(q, deq, rows, 512, scale, splits=splits))
        assert _rel(got, want) <= TOL[BF16], splits
        assert torch.equal(
            sparse_mla_from_buffer(q, moved, moved_rows, 512, scale, splits=splits), got
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_lossless_with_kernel(checkpoints, dtype):
    """With the kernel: decode captured in CUDA graphs, then eager with host
    synchronisation made an error inside ECHO's append/resolve; torch.equal throughout."""
    from sglang_echo.model.loader import load_model
    from test_gpu import _lossless_pair, _prompts

    kernels = ModelKernels(sparse_mla="kernel")
    model = load_model(checkpoints["default-rope"], device="cuda", dtype=dtype, kernels=kernels)
    prompts = _prompts(5, [60, 23, 90])
    graph = _lossless_pair(model, prompts, 12, 3, 8, use_graph=True, sync_check=False)
    model.set_graph_safe(False)
    eager = _lossless_pair(model, prompts, 6, 3, 48, use_graph=False, sync_check=True)
    print("kernel lossless", dtype, graph, eager)
    assert graph["evictions"] > 0 and eager["evictions"] > 0


def test_split_merge_bits_do_not_depend_on_its_tile(monkeypatch):
    """The merge of split partials is tiled small (no spills on sm_90a); each element's
    arithmetic is the same whatever the tile, so a whole-row tile gives the same bits, at
    head counts and latent widths that are not multiples of the tile."""
    from sglang_echo.kernels import sparse_mla as k

    q, buffer, rows = _case(3, 40, 40, 70, 200, 8, FP32, seed=5)  # 3 x 2 tiles vs 1 x 1
    small = sparse_mla_from_buffer(q, buffer, rows, 200, 0.3, block_k=16, splits=3)
    monkeypatch.setattr(k, "COMBINE_BLOCK_H", 64)
    monkeypatch.setattr(k, "COMBINE_BLOCK_C", 1024)
    whole = sparse_mla_from_buffer(q, buffer, rows, 200, 0.3, block_k=16, splits=3)
    assert torch.equal(small, whole)
    want = sparse_mla_reference(q, buffer, rows, 200, 0.3)
    assert _rel(small, want) <= TOL[FP32]
    assert torch.isfinite(small).all()
