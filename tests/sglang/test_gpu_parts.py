"""The plugin's resolve path over buffers laid out as sglang's (a layer-first host pool,
per-layer device row buffers), without sglang. On a GPU (marker gpu): the host pool is
pinned as sglang pins it (plain memory + cudaHostRegister), read through its UVA alias by
the Triton kernels, and the resolve of every layer is captured in one CUDA graph and
replayed with new selections; an eager step must not synchronise with the host. On the
CPU the same steps run eagerly (the test's own logic, checked where CI runs).

What this cannot show (needs sglang on a GPU): the same call inside sglang's decode graph,
its streams, and FlashMLA reading the table."""

from __future__ import annotations

from dataclasses import dataclass

import plugin_testenv  # noqa: F401  first: sets the process up before triton loads
import pytest
import torch

from sglang_echo.kernels.topk_rows import RING
from sglang_echo.offload.manager import EchoManager
from sglang_echo.sglang.storage import (
    ExternalHostRows,
    ExternalRowsCache,
    device_layer_rows,
    host_layer_rows,
)
from sglang_echo.sglang.topk_resolve import TopkToRows

ROW_BYTES, ROW_BASE, LAYERS, MAX_REQS, CONTEXT = 656, 63, 3, 5, 1000


@dataclass
class World:
    host: torch.Tensor  # [layers, N_H + 2, 1, 656] uint8, on the CPU
    device: list[torch.Tensor]  # per layer [rows, 1, 656] uint8
    resolver: TopkToRows
    slots: int
    top_k: int


def build(device: str, slots: int, top_k: int, host_tokens: int) -> World:
    host = torch.randint(0, 256, (LAYERS, host_tokens + 2, 1, ROW_BYTES), dtype=torch.uint8)
    if device == "cuda":
        rc = int(torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.nbytes, 0))
        assert rc == 0, f"cudaHostRegister failed: {rc}"
    rows = ROW_BASE + slots + 2 + 64 * MAX_REQS
    buffers = [
        torch.zeros(rows, 1, ROW_BYTES, dtype=torch.uint8, device=device) for _ in range(LAYERS)
    ]
    host_rows = ExternalHostRows(host_layer_rows(host))
    cache = ExternalRowsCache(device_layer_rows(buffers, ROW_BASE, slots), host_tokens)
    manager = EchoManager(host_rows, cache)
    if device == "cuda":
        assert host_rows.pinned and host_rows.device_view is not None, "no UVA alias"
        assert manager.use_kernels and manager.graph_safe
    req_to_host = torch.full((MAX_REQS, 2 * CONTEXT), -1, dtype=torch.int64, device=device)
    ring = torch.zeros(MAX_REQS, RING, dtype=torch.int64, device=device)
    ring_start = torch.zeros(MAX_REQS, dtype=torch.int64, device=device)
    out = torch.full((MAX_REQS, top_k), -1, dtype=torch.int32, device=device)
    resolver = TopkToRows(manager, ROW_BASE, req_to_host, ring, ring_start, top_k, out)
    return World(host, buffers, resolver, slots, top_k)


class Inputs:
    """Static step inputs, rewritten in place between graph replays."""

    def __init__(self, w: World, bs: int, device: str, seed: int) -> None:
        self.w, self.bs = w, bs
        self.gen = torch.Generator().manual_seed(seed)
        self.idx = torch.zeros(bs, dtype=torch.int64, device=device)
        self.seq = torch.ones(bs, dtype=torch.int64, device=device)
        self.topk = torch.full((bs, w.top_k), -1, dtype=torch.int32, device=device)
        self.num_real = torch.zeros(1, dtype=torch.int32, device=device)

    def next(self) -> None:
        w, r = self.w, self.w.resolver
        host_tokens = w.host.shape[1] - 2
        perm = torch.randperm(host_tokens, generator=self.gen)[: self.bs * CONTEXT] + 1
        for i in range(self.bs):
            seq = int(torch.randint(w.top_k // 2, CONTEXT, (1,), generator=self.gen))
            r.req_to_host[i + 1].fill_(-1)
            r.req_to_host[i + 1, :CONTEXT] = perm[i * CONTEXT : (i + 1) * CONTEXT]
            # Its ring: a page of rows in shuffled order, entered decode 0-80 tokens ago.
            page = ROW_BASE + w.slots + 2 + RING * i
            r.ring_rows[i + 1] = page + torch.randperm(RING, generator=self.gen)
            r.ring_start[i + 1] = seq - 1 - int(torch.randint(0, 80, (1,), generator=self.gen))
            self.idx[i], self.seq[i] = i + 1, seq
            k = min(seq, w.top_k)
            self.topk[i].fill_(-1)
            self.topk[i, :k] = torch.randperm(seq, generator=self.gen)[:k].to(torch.int32)
        self.num_real.fill_(int(torch.randint(1, self.bs + 1, (1,), generator=self.gen)))

    def step(self) -> list[torch.Tensor]:
        r = self.w.resolver
        return [
            r(layer, self.idx, self.seq, self.topk, self.num_real).clone()
            for layer in range(LAYERS)
        ]

    def check(self, tables: list[torch.Tensor]) -> None:
        w, real = self.w, int(self.num_real)
        topk, seq, idx = self.topk.cpu(), self.seq.cpu(), self.idx.cpu()
        r = w.resolver
        req_to_host, ring, start = r.req_to_host.cpu(), r.ring_rows.cpu(), r.ring_start.cpu()
        for layer, table in enumerate(tables):
            table = table.cpu()
            rows = w.device[layer].view(w.device[layer].shape[0], -1).cpu()
            for i in range(self.bs):
                if i >= real:
                    assert torch.all(table[i] == -1)
                    continue
                lanes = topk[i] >= 0
                assert torch.all(table[i][~lanes] == -1)
                pos, got = topk[i][lanes].long(), table[i][lanes].long()
                in_ring = pos >= max(int(start[idx[i]]), int(seq[i]) - RING)
                assert torch.equal(got[in_ring], ring[idx[i], pos[in_ring] % RING])
                ids = req_to_host[idx[i], pos[~in_ring]]
                assert torch.equal(rows[got[~in_ring]], w.host[layer, ids, 0])


def test_resolve_steps_on_the_cpu():
    w = build("cpu", slots=64, top_k=16, host_tokens=5000)
    inputs = Inputs(w, bs=4, device="cpu", seed=0)
    for _ in range(4):
        inputs.next()
        inputs.check(inputs.step())
    assert torch.all(w.resolver.manager.cache.evictions > 0)


@pytest.mark.gpu
def test_resolve_graph_replays_match_host_rows():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    w = build("cuda", slots=512, top_k=128, host_tokens=6000)
    inputs = Inputs(w, bs=4, device="cuda", seed=0)  # 4 = slots // top_k: every step evicts
    try:
        inputs.next()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up (Triton compilation, workspaces), eagerly
                inputs.check(inputs.step())
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()

        torch.cuda.set_sync_debug_mode("error")
        try:
            eager = inputs.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        inputs.check(eager)

        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = inputs.step()
        for _ in range(12):
            inputs.next()
            graph.replay()
            torch.cuda.synchronize()
            inputs.check(captured)
        assert torch.all(w.resolver.manager.cache.evictions.cpu() > 0)
    finally:
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaHostUnregister(w.host.data_ptr())
