"""Peers of the sparse-MLA kernel, measured beside it (issue 15, item 7). Benchmarks only.

FlashInfer's MLA paged decode (``BatchMLAPagedAttentionWrapper``, fa3 on Hopper) reads the
selected rows of our KV buffer in place when each query is a "request" whose pages are its
selected rows at page size 1: ``kv_indices`` = the query's row indices, ``kv_len`` = top-k.
The buffer [S, 576] is viewed as ckv [S, 1, 512] and kpe [S, 1, 64] (strided, no copy).
FlashInfer is optional: carry it as ``.peer/`` and install it on the GPU machine as
``benchmark/device_session.sh`` (stage ``kernels``) does; where it does not import, the peer
is reported as missing with the reason, never as zero.

Which properties decide whether a peer could serve as the CUDA default (the README's
rule: offload and no-offload stay bit-identical): its output must depend only on the
rows' contents and order, not on where they live. ``slot_invariant`` checks exactly that
for any kernel here: the same rows at other slots (the buffer permuted, the indices
mapped) must give ``torch.equal`` outputs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# (q [Q, H, lat + rope], buffer [S, lat + rope], rows [Q, K]) -> a thunk that attends those
# exact tensors (planned once, so it can be timed and captured in a CUDA graph).
Planner = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Callable[[], torch.Tensor]]
WORKSPACE_BYTES = 128 << 20


def flashinfer_mla(lat: int, scale: float, backend: str = "fa3") -> Planner | str:
    """FlashInfer's MLA decode as a ``Planner``, or the reason it cannot run here."""
    try:
        from flashinfer.mla import BatchMLAPagedAttentionWrapper
    except Exception as exc:  # optional: absent, or built for another torch/CUDA
        return f"flashinfer does not import: {type(exc).__name__}: {str(exc)[:200]}"

    def plan(q: torch.Tensor, buffer: torch.Tensor, rows: torch.Tensor):
        n_q, heads, width = q.shape
        topk, dev, i32 = rows.shape[1], q.device, torch.int32
        work = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
        wrapper = BatchMLAPagedAttentionWrapper(work, backend=backend)
        indices = rows.reshape(-1).to(i32)
        wrapper.plan(
            qo_indptr=torch.arange(n_q + 1, dtype=i32, device=dev),
            kv_indptr=torch.arange(n_q + 1, dtype=i32, device=dev) * topk,
            kv_indices=indices,
            kv_len_arr=torch.full((n_q,), topk, dtype=i32, device=dev),
            num_heads=heads,
            head_dim_ckv=lat,
            head_dim_kpe=width - lat,
            page_size=1,
            causal=False,
            sm_scale=scale,
            q_data_type=q.dtype,
            kv_data_type=buffer.dtype,
        )
        q_nope, q_pe = q[..., :lat].contiguous(), q[..., lat:].contiguous()
        ckv, kpe = buffer[:, :lat].unsqueeze(1), buffer[:, lat:].unsqueeze(1)  # no copies
        layout = "strided views of the buffer"
        try:
            wrapper.run(q_nope=q_nope, q_pe=q_pe, ckv_cache=ckv, kpe_cache=kpe)
        except Exception:  # a build that wants dense caches: time it on copies instead
            ckv, kpe = ckv.contiguous(), kpe.contiguous()
            layout = "contiguous copies of the buffer's two parts"
        keep = (work, indices)  # alive as long as the thunk

        def run() -> torch.Tensor:
            assert keep
            return wrapper.run(q_nope=q_nope, q_pe=q_pe, ckv_cache=ckv, kpe_cache=kpe)

        run.layout = layout  # type: ignore[attr-defined]
        return run

    return plan


def slot_invariant(
    plan: Planner, q: torch.Tensor, buffer: torch.Tensor, rows: torch.Tensor
) -> bool:
    """The same rows at other slots give the same bits (what offload vs no-offload needs):
    every row moves to a random new slot and the indices follow it."""
    gen = torch.Generator(device=buffer.device).manual_seed(11)
    perm = torch.randperm(buffer.shape[0], device=buffer.device, generator=gen)
    moved = torch.empty_like(buffer)
    moved[perm] = buffer
    return torch.equal(plan(q, buffer, rows)(), plan(q, moved, perm[rows])())
