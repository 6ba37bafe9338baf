"""Recall kernel vs its torch reference (the Triton interpreter on a CPU-only machine)."""

from __future__ import annotations

import pytest
import torch

from sglang_echo.kernels.recall import recall_rows, recall_rows_reference

# Real kernels on a GPU machine, the Triton interpreter elsewhere (conftest sets it).
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(
    ("dtype", "width"),
    [(torch.bfloat16, 576), (torch.uint8, 656), (torch.float32, 20)],
)
@pytest.mark.parametrize("chunks", [512, 64], ids=["default", "64-piece-loop"])
def test_recall_matches_reference(dtype, width, chunks, monkeypatch):
    """Pieces per program and loop step: the default, and fewer (more loop trips)."""
    from sglang_echo.kernels import recall

    monkeypatch.setattr(recall, "DEFAULT_FLAT_CHUNKS", chunks)
    g = torch.Generator().manual_seed(width)
    host = torch.randint(0, 255, (300, width), generator=g).to(dtype)
    lanes, count = 37, 29
    ids = torch.randperm(299, generator=g)[:lanes].to(torch.int32) + 1
    slots = torch.randperm(60, generator=g)[:lanes].to(torch.int32) + 1
    host, ids, slots = host.to(DEV), ids.to(DEV), slots.to(DEV)
    poison = torch.full((62, width), 7, dtype=dtype, device=DEV)
    got, want = poison.clone(), poison.clone()
    n = torch.tensor([count], dtype=torch.int32, device=DEV)
    recall_rows(host, got, ids, slots, n)
    recall_rows_reference(host, want, ids, slots, n)
    assert torch.equal(got, want)
    # Lanes past the count moved nothing.
    untouched = torch.ones(62, dtype=torch.bool, device=DEV)
    untouched[slots[:count].long()] = False
    assert torch.equal(got[untouched], poison[untouched])


def test_recall_rejects_mismatched_rows():
    host = torch.zeros(4, 8)
    with pytest.raises(ValueError, match="same width"):
        recall_rows(
            host,
            torch.zeros(4, 9),
            torch.ones(1, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32),
        )


def test_manager_with_recall_kernel_matches_torch_path():
    """The same random steps through ECHO with and without the kernel: same state."""
    from sglang_echo.config import EchoConfig
    from sglang_echo.offload.echo_cache import EchoKVCache

    caches = [
        EchoKVCache(
            EchoConfig(offload=True, dev_cache_size=8),
            2,
            40,
            6,
            4,
            torch.float32,
            DEV,
            use_kernels=flag,
        )
        for flag in (False, True)
    ]
    assert caches[1].manager.use_kernels and not caches[0].manager.use_kernels
    g = torch.Generator().manual_seed(0)
    for step in range(30):
        locs = torch.tensor([step + 1])
        rows, keys = torch.randn(1, 6, generator=g), torch.randn(1, 4, generator=g)
        sel = torch.randint(1, step + 2, (2, 4), generator=g)
        sel[torch.rand(2, 4, generator=g) < 0.2] = -1
        locs, rows, keys, sel = (t.to(DEV) for t in (locs, rows, keys, sel))
        outs = []
        for cache in caches:
            for layer in range(2):
                cache.write(layer, locs, rows, keys)
                outs.append(cache.resolve(layer, sel)[1])
        assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[3])
    a, b = caches[0].cache, caches[1].cache
    assert torch.equal(a.rows[:, :-1], b.rows[:, :-1])  # all but the scratch slot
    for name in ("host_to_device", "priority", "free_count", "evictions", "misses"):
        x, y = getattr(a, name), getattr(b, name)
        assert torch.equal(x[..., :-1] if x.dim() > 1 else x, y[..., :-1] if y.dim() > 1 else y)
