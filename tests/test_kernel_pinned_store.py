"""kernels/pinned_store.py: device results stored into pinned host memory by a kernel (not
a copy engine), the ring of slots the engine reads each step's tokens from, and the
refusal to hand back a slot that a later readback took. CPU (the interpreter, with a CPU
buffer standing in for the UVA alias) and CUDA (the real alias of pinned memory)."""

from __future__ import annotations

import pytest
import torch

from sglang_echo.kernels import pinned_store
from sglang_echo.kernels.pinned_store import (
    PinnedReadback,
    as_bytes,
    copy_by_torch,
    store_bytes,
    store_bytes_reference,
)

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("n", [0, 1, 15, 1023, 1024, 1025, 5000])
def test_store_bytes_matches_its_reference(n: int) -> None:
    g = torch.Generator().manual_seed(n)
    src = torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).to(DEV)
    out, ref = (
        torch.zeros(n + 7, dtype=torch.uint8, device=DEV),
        torch.zeros(n + 7, dtype=torch.uint8, device=DEV),
    )
    store_bytes(src, out[3 : 3 + n])  # at an odd offset: the kernel's unaligned case
    store_bytes_reference(src, ref[3 : 3 + n])
    assert torch.equal(out, ref)
    assert int(out[:3].sum()) == 0 and int(out[3 + n :].sum()) == 0  # nothing outside


def test_store_bytes_refuses_what_it_cannot_store() -> None:
    with pytest.raises(ValueError, match="uint8"):
        store_bytes(torch.zeros(4, dtype=torch.int32), torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="4 bytes into 5"):
        store_bytes(torch.zeros(4, dtype=torch.uint8), torch.zeros(5, dtype=torch.uint8))
    with pytest.raises(ValueError, match="contiguous"):
        as_bytes(torch.zeros(4, 4)[:, 1])


def test_the_kernel_compiles_once_for_every_size_and_offset() -> None:
    kernel = pinned_store._store_bytes_kernel
    if hasattr(kernel, "params"):
        values = {p.name for p in kernel.params if p.do_not_specialize}
        aligned = {p.name for p in kernel.params if p.do_not_specialize_on_alignment}
    else:  # the interpreter keeps the decorator's arguments
        values = set(kernel.kwargs.get("do_not_specialize") or ())
        aligned = set(kernel.kwargs.get("do_not_specialize_on_alignment") or ())
    assert values == {"n"} and aligned == {"src_ptr", "dst_ptr"}


def _step_results(rows: int, seed: int) -> list[torch.Tensor]:
    """What a decode step reads back: tokens, finite flags, chosen log-probabilities."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 1 << 40, (rows,), generator=g, dtype=torch.int64)
    finite = torch.rand(rows, generator=g) > 0.3
    chosen = torch.randn(rows, generator=g)
    top = torch.randn(rows, 5, generator=g)
    return [t.to(DEV) for t in (tokens, finite, chosen, top)]


def _ring(slots: int = 3) -> PinnedReadback:
    ring = PinnedReadback(DEV, slot_bytes=1024, slots=slots)
    if ring.alias is None:  # the CPU: a plain buffer is its own "alias"
        ring.host = torch.zeros(slots, 1024, dtype=torch.uint8)
        ring.alias = ring.host
    return ring


def test_readbacks_return_each_steps_values_exactly() -> None:
    ring = _ring()
    for step, rows in enumerate((1, 7, 16, 33)):
        values = _step_results(rows, step)
        host = ring.copy(values).wait()
        assert [h.device.type for h in host] == ["cpu"] * 4
        for h, v in zip(host, values, strict=True):
            assert h.dtype == v.dtype and torch.equal(h, v.cpu())


def test_a_slot_reused_before_it_was_read_is_refused() -> None:
    ring = _ring(slots=2)
    first = ring.copy(_step_results(4, 0))
    ring.copy(_step_results(4, 1))
    third = ring.copy(_step_results(4, 2))  # takes the first one's slot
    with pytest.raises(RuntimeError, match="reused before it was read"):
        first.wait()
    assert torch.equal(third.wait()[0], _step_results(4, 2)[0].cpu())


def test_more_bytes_than_a_slot_go_by_torchs_copy() -> None:
    ring = _ring()
    big = torch.arange(1000, dtype=torch.int64, device=DEV)  # 8,000 bytes > 1,024
    readback = ring.copy([big])
    assert readback.ring is None  # not through a slot
    assert torch.equal(readback.wait()[0], big.cpu())
    assert torch.equal(copy_by_torch([big]).wait()[0], big.cpu())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the UVA alias of pinned memory")
def test_on_cuda_the_ring_stores_through_the_alias_behind_queued_work() -> None:
    ring = PinnedReadback(DEV)
    assert ring.alias is not None and ring.host.is_pinned()
    x = torch.randn(4096, 4096, device=DEV)
    for step in range(20):  # the value is made by work queued just before the readback
        y = (x @ x).sum(dim=1)[:64] * 0 + step
        got = ring.copy([y.to(torch.int64)]).wait()[0]
        assert torch.equal(got, torch.full((64,), step, dtype=torch.int64))
    kernel = pinned_store._store_bytes_kernel
    before = len(kernel.device_caches[torch.cuda.current_device()][0])
    for rows in (1, 3, 17, 64):
        ring.copy(_step_results(rows, rows)).wait()
    assert len(kernel.device_caches[torch.cuda.current_device()][0]) == before
