"""A decode node's KV machinery from sglang 0.5.23's real classes, on the CPU.

Real: HiSparseDSATokenToKVPool (device rows), HiSparseTokenToKVPoolAllocator (logical
ids + device rows), ReqToTokenPool, MLATokenToKVPoolHost (built by the coordinator),
Req, and sglang's own PD pre-allocation (alloc_for_decode_prealloc_hisparse). Stubbed,
and nothing else: the CUDA host-register call (no CUDA here) and the device-capability
query (sglang asks it while importing model code).

``DecodeNode`` drives them the way sglang's scheduler does around the coordinator: PD
pre-allocation and direct admission, ``prepare_for_decode``'s allocation and
``map_last_loc_to_buffer``, the model's KV write, the backend's
``swap_in_selected_pages`` per layer, and ``request_finished`` + ``release_kv_cache``.
It records every token's bytes so tests can check each returned row independently.
"""

from __future__ import annotations

import os
from array import array
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest
import torch
import torch.distributed as dist

from benchmark.harness.kv_sides import ceil_page
from benchmark.harness.kv_sides import cpu_shims as apply_cpu_shims

PAGE = 64
KV_LORA, ROPE = 512, 64
FP8_ROW_BYTES = 656  # 512 fp8 + 4 fp32 scales + 64 bf16 rope


def init_process_group(tmp_dir: str) -> None:
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{tmp_dir}/pg", rank=0, world_size=1)


@pytest.fixture(scope="module", autouse=True)
def cpu_machine(tmp_path_factory):
    """What every scripted decode-node module needs first: sglang's classes on the CPU
    (the shims) and a one-rank gloo process group. Autouse in each module that imports it."""
    apply_cpu_shims()
    init_process_group(str(tmp_path_factory.mktemp("pg")))


def assert_coordinator_clean(coord, allocator) -> None:
    """No request left in the EchoCoordinator, its maps or ECHO's device cache."""
    from sglang_echo.offload.device_cache import ABSENT, FREE

    assert torch.all(coord.ring_rows == 0) and torch.all(coord.ring_start == 0)
    assert coord.kept_rows.empty, "no retracted request's host ids kept"
    assert torch.all(coord.req_to_host_pool == -1)
    assert torch.all(coord.req_to_host_pool_allocated_len == 0)
    assert torch.all(allocator.full_to_hisparse_device_index_mapping[:-1] == 0)
    cache = coord.cache
    assert torch.all(cache.free_count == cache.num_slots)
    assert torch.all(cache.device_to_host[:, 1 : cache.num_slots + 1] == FREE)
    assert torch.all(cache.host_to_device[:, 1:] == ABSENT)
    stats = coord.get_token_stats()
    assert stats.device_tokens == 0 and stats.host_tokens == 0


def build_pools(
    rows, ratio, layers, max_running, max_context, dtype, fp8=False, pre_alloc_size=None
):
    """sglang's HiSparse DSA device pool (fp8 rows or ``dtype``), its allocator and the
    request table, on the CPU. ``pre_alloc_size`` (a PD decode node's extra request
    slots for pre-allocated and in-transfer requests) builds sglang's
    DecodeReqToTokenPool instead of the plain ReqToTokenPool."""
    from sglang.srt.mem_cache.allocator.hisparse import HiSparseTokenToKVPoolAllocator
    from sglang.srt.mem_cache.hisparse_memory_pool import HiSparseDSATokenToKVPool
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    pool = HiSparseDSATokenToKVPool(
        size=rows,
        page_size=PAGE,
        kv_lora_rank=KV_LORA,
        dtype=torch.float8_e4m3fn if fp8 else dtype,
        qk_rope_head_dim=ROPE,
        layer_num=layers,
        device="cpu",
        index_head_dim=128,
        enable_memory_saver=False,
        kv_cache_dim=FP8_ROW_BYTES if fp8 else KV_LORA + ROPE,
        host_to_device_ratio=ratio,
    )
    allocator = HiSparseTokenToKVPoolAllocator(
        rows, PAGE, dtype, "cpu", pool, need_sort=False, host_to_device_ratio=ratio
    )
    if pre_alloc_size is None:
        req_to_token = ReqToTokenPool(
            size=max_running, max_context_len=max_context, device="cpu", enable_memory_saver=False
        )
    else:
        from sglang.srt.disaggregation.decode import DecodeReqToTokenPool

        req_to_token = DecodeReqToTokenPool(
            size=max_running,
            max_context_len=max_context,
            device="cpu",
            enable_memory_saver=False,
            pre_alloc_size=pre_alloc_size,
        )
    return pool, allocator, req_to_token


def stock_standins(coord) -> None:
    """What sglang's stock coordinator needs of sgl_kernel, as plain torch copies: the host
    pool's per-layer load to device rows and its all-layer backup from them (the CUDA
    transfer kernels, not in a CPU install). Only the bytes' movement is stood in; which
    rows move where is sglang's own code."""
    host = coord.mem_pool_host

    def load_to_device_per_layer(device_pool, host_indices, device_indices, layer_id, **_):
        dst = device_pool.kv_buffer[layer_id]
        dst[device_indices.long()] = host.kv_buffer[layer_id][host_indices.long()]

    def backup_from_device_all_layer(device_pool, host_indices, device_indices, **_):
        for layer, src in enumerate(device_pool.kv_buffer):
            host.kv_buffer[layer][host_indices.long()] = src[device_indices.long()]

    host.load_to_device_per_layer = load_to_device_per_layer
    host.backup_from_device_all_layer = backup_from_device_all_layer


class _Unpinned:
    """torch, except that ``tensor(..., pin_memory=True)`` makes a plain tensor: the stock
    coordinator pins its backup indices, which a CPU-only torch refuses."""

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def tensor(*args, pin_memory: bool = False, **kwargs):
        return torch.tensor(*args, **kwargs)


@contextmanager
def unpinned(active: bool):
    """While sglang's stock coordinator runs a step's preparation (CPU only)."""
    if not active:
        yield
        return
    import sglang.srt.managers.hisparse_coordinator as stock

    saved = stock.torch
    stock.torch = _Unpinned()
    try:
        yield
    finally:
        stock.torch = saved


@dataclass
class Token:
    req: object
    seq_len: int  # tokens in KV after this step's write, the current one included
    rows: torch.Tensor  # [positions, layers, D] bytes this request's tokens must hold


@dataclass
class DecodeNode:
    layers: int
    top_k: int
    dev_cache: int
    max_running: int
    host_tokens: int
    max_context: int
    dtype: torch.dtype = torch.bfloat16
    seed: int = 0
    # "torch": the test writes each new token's row; "sglang": the pool's own write path
    # (HiSparseDSATokenToKVPool.set_mla_kv_buffer: Triton, interpreted on the CPU).
    write: str = "torch"
    fp8: bool = False
    prefill_rows: int = 0  # device rows for local prefills, as the plugin's plan adds
    # True: sglang's stock HiSparseCoordinator instead of ECHO's (the plugin's oracle),
    # with sglang's own per-request reference swap-in (naive_load_topk); see stock_standins.
    stock: bool = False
    running: dict[str, Token] = field(default_factory=dict)
    retracted: dict[str, Token] = field(default_factory=dict)
    host_owners: dict[int, set[str]] = field(default_factory=dict)
    next_rid: int = 0

    def __post_init__(self) -> None:
        from sglang_echo.config import reset_settings
        from sglang_echo.sglang.coordinator import EchoCoordinator

        self.gen = torch.Generator().manual_seed(self.seed)
        rows = ceil_page(self.dev_cache + 1) + self.max_running * PAGE
        rows += ceil_page(self.prefill_rows)
        ratio = -(-self.host_tokens // rows)
        self.pool, self.allocator, self.req_to_token = build_pools(
            rows, ratio, self.layers, self.max_running, self.max_context,
            self.dtype, self.fp8,
        )  # fmt: skip
        self.start = self.counters()
        os.environ["NSA_DEV_CACHE_SIZE"] = str(self.dev_cache)
        # A hand-built coordinator is its own start-up: the settings are parsed afresh, from
        # this environment (config.settings(), as register() would in a scheduler).
        reset_settings()
        coordinator_class = EchoCoordinator
        if self.stock:
            from sglang.srt.managers.hisparse_coordinator import HiSparseCoordinator

            coordinator_class = HiSparseCoordinator
        self.coord = coordinator_class(
            self.req_to_token,
            self.allocator,
            top_k=self.top_k,
            device_buffer_size=ceil_page(self.top_k),
            device="cpu",
            tp_group=dist.group.WORLD,
            host_to_device_ratio=ratio,
        )
        if self.stock:
            stock_standins(self.coord)
        self.after_init = self.counters()
        self.width = self.pool.kv_buffer[0].shape[-1]
        self.row_dtype = self.pool.kv_buffer[0].dtype
        if self.write == "sglang":
            from sglang.srt.layers.radix_attention import RadixAttention

            self.attn = [
                RadixAttention(1, KV_LORA + ROPE, 1.0, 1, layer_id=layer, v_head_dim=KV_LORA)
                for layer in range(self.layers)
            ]

    # ------------------------------------------------------------ bookkeeping
    def counters(self) -> dict[str, int]:
        values = {
            "device_rows": self.allocator.hisparse_attn_allocator.available_size(),
            "logical": self.allocator.logical_attn_allocator.available_size(),
            "req_slots": self.req_to_token.available_size(),
        }
        coord = getattr(self, "coord", None)
        if coord is not None:
            values["host"] = coord.mem_pool_host.available_size()
        return values

    def layer_rows(self, layer: int) -> torch.Tensor:
        buf = self.pool.kv_buffer[layer]
        return buf.view(buf.shape[0], -1)

    def host_rows(self, layer: int) -> torch.Tensor:
        buf = self.coord.mem_pool_host.kv_buffer[layer]
        return buf.view(buf.shape[0], -1)

    def random_rows(self, n: int) -> torch.Tensor:
        if self.row_dtype == torch.uint8:
            return torch.randint(0, 256, (n, self.layers, self.width), generator=self.gen).to(
                torch.uint8
            )
        values = torch.randn(n, self.layers, self.width, generator=self.gen)
        return values.to(self.row_dtype)

    def model_write(self, logical_locs: torch.Tensor) -> torch.Tensor:
        """The model's KV write for ``logical_locs`` in every layer; returns the bytes
        that landed, [tokens, layers, D]."""
        n = logical_locs.numel()
        device_rows = self.pool.translate_loc_to_hisparse_device(logical_locs)
        if self.write == "torch":
            new = self.random_rows(n)
            for layer in range(self.layers):
                self.layer_rows(layer)[device_rows] = new[:, layer]
            return new
        landed = torch.empty(n, self.layers, self.width, dtype=self.row_dtype)
        for layer in range(self.layers):
            nope = torch.randn(n, 1, KV_LORA, generator=self.gen).to(torch.bfloat16)
            rope = torch.randn(n, 1, ROPE, generator=self.gen).to(torch.bfloat16)
            self.pool.set_mla_kv_buffer(self.attn[layer], logical_locs, nope, rope)
            landed[:, layer] = self.layer_rows(layer)[device_rows]
            if not self.fp8:  # bf16 rows are the latent then the rope part, verbatim
                assert torch.equal(landed[:, layer], torch.cat((nope, rope), -1).squeeze(1))
        return landed

    def prefill(self, prompt_len: int) -> str:
        """Non-disaggregated server: prefill writes the prompt into device rows (sglang's
        alloc_extend), the coordinator stages it to the host, then admits the request."""
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        rid = f"r{self.next_rid}"
        self.next_rid += 1
        req = Req(rid, "", array("i", [1] * prompt_len), SamplingParams(max_new_tokens=8))
        assert self.req_to_token.alloc([req]) is not None
        idx = req.kv.req_pool_idx
        zero = torch.zeros(1, dtype=torch.int64)
        n = torch.tensor([prompt_len], dtype=torch.int64)
        locs = self.allocator.alloc_extend(zero, zero, n, n, zero - 1, prompt_len)
        assert locs is not None, "no device rows left for the prompt"
        self.req_to_token.write((idx, slice(0, prompt_len)), locs.to(torch.int32))
        req.kv.kv_allocated_len = prompt_len
        req.extend_end = prompt_len
        rows = torch.zeros(self.max_context, self.layers, self.width, dtype=self.row_dtype)
        rows[:prompt_len] = self.model_write(locs)
        self.coord.admit_request_into_staging(req)
        ready = self.coord.collect_ready_reqs()
        assert ready == [req]
        self.running[rid] = Token(req, prompt_len, rows)
        return rid

    # --------------------------------------------------------------- requests
    def arrive(self, prompt_len: int, admit: bool = True) -> str:
        """PD decode: pre-allocate logical ids and host slots, 'RDMA' the prompt's KV
        into the host pool, then admit directly (no staging)."""
        from sglang.srt.disaggregation.decode import alloc_for_decode_prealloc_hisparse
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        rid = f"r{self.next_rid}"
        self.next_rid += 1
        req = Req(rid, "", array("i", [1] * prompt_len), SamplingParams(max_new_tokens=8))
        assert self.req_to_token.alloc([req]) is not None
        idx = req.kv.req_pool_idx
        kv_loc = alloc_for_decode_prealloc_hisparse(
            self.allocator, req=req, fill_len=prompt_len, uses_swa_tail=False, swa_tail_len=0
        )
        self.req_to_token.write((idx, slice(0, prompt_len)), kv_loc.to(torch.int32))
        host_ids = self.coord.mem_pool_host.alloc_paged_token_slots(
            self.coord.req_to_host_pool,
            self.coord.req_to_host_pool_allocated_len,
            idx,
            0,
            prompt_len,
        )
        rows = torch.zeros(self.max_context, self.layers, self.width, dtype=self.row_dtype)
        rows[:prompt_len] = self.random_rows(prompt_len)
        for layer in range(self.layers):
            self.host_rows(layer)[host_ids] = rows[:prompt_len, layer]
        for h in host_ids.tolist():
            self.host_owners.setdefault(h, set()).add(rid)
        req.output_ids.append(1)  # the prefill node's first token (its KV comes next step)
        if admit:
            self.coord.admit_request_direct(req)
        self.running[rid] = Token(req, prompt_len, rows)
        return rid

    def finish(self, rid: str) -> None:
        """Finish or abort: the coordinator releases, then release_kv_cache frees the
        logical ids (through HiSparse's mapping) and the request slot."""
        token = self.running.pop(rid)
        req = token.req
        self.coord.request_finished(req)
        self._release_kv(req)

    def _release_kv(self, req) -> None:
        locs = self.req_to_token.req_to_token[req.kv.req_pool_idx, : req.kv.kv_allocated_len]
        self.allocator.free(locs.to(torch.int64))
        self.req_to_token.free(req)

    def retract(self, rid: str, backup: str, backs_up: bool = True) -> bool:
        """sglang's release_req on a PD decode node: inside the coordinator's retraction
        scope (the plugin's hook on release_req), the coordinator's retract_req, then the
        retraction backup (sglang's backup_kv_cache with ``backup``, hooked by the plugin;
        ``backs_up=False``: a release that skips it), then release_kv_cache. Returns
        whether a backup was kept (False: sglang aborts it)."""
        from sglang.srt.mem_cache.common import backup_kv_cache

        token = self.running.pop(rid)
        req = token.req
        saved = False
        with self.coord.kept_rows.scope():
            self.coord.retract_req(req)
            try:
                if backs_up:
                    saved = backup_kv_cache(req, None, self.req_to_token, self.allocator, backup)
            finally:
                self._release_kv(req)
        if saved:
            self.retracted[rid] = token
        return saved

    def resume(self, rid: str) -> None:
        """sglang's resume of a retracted request (resume_retracted_reqs): _pre_alloc's
        HiSparse branch (a request slot, logical ids and host slots for the tokens it
        restores; the plugin's hook installs the kept host row first), then
        restore_kv_cache (hooked: the coordinator admits it directly)."""
        from sglang.srt.disaggregation.decode import (
            DecodePreallocQueue,
            alloc_for_decode_prealloc_hisparse,
        )
        from sglang.srt.mem_cache.common import restore_kv_cache

        from sglang_echo.sglang.retraction import kept_of

        token = self.retracted.pop(rid)
        req = token.req
        kept = kept_of(req)
        assert kept is not None
        fill = DecodePreallocQueue._pre_alloc_fill_len(req)
        with kept.owner.installing(kept):
            assert self.req_to_token.alloc([req]) is not None
            idx = req.kv.req_pool_idx
            kv_loc = alloc_for_decode_prealloc_hisparse(
                self.allocator, req=req, fill_len=fill, uses_swa_tail=False, swa_tail_len=0
            )
            self.req_to_token.write((idx, slice(0, fill)), kv_loc.to(torch.int32))
            self.coord.mem_pool_host.alloc_paged_token_slots(
                self.coord.req_to_host_pool, self.coord.req_to_host_pool_allocated_len, idx, 0, fill
            )
        restore_kv_cache(req, None, self.req_to_token, self.allocator, "none")
        self.running[rid] = token

    def discard(self, rid: str) -> None:
        """A retracted request aborted by its client (sglang's discard_kv_cache_backup)."""
        from sglang.srt.mem_cache.common import discard_kv_cache_backup

        discard_kv_cache_backup(self.retracted.pop(rid).req, None, "none")

    # ------------------------------------------------------------ decode step
    def step(
        self, rids: list[str], padded_bs: int, topk_for=None, select=None
    ) -> list[torch.Tensor]:
        """One decode step of ``rids`` (padded to ``padded_bs`` as a CUDA-graph replay
        pads). ``topk_for(layer, rid, seq_len)`` gives each request's selections, or
        ``select(layer, req_pool_indices, seq_lens)`` the whole [padded_bs, top_k] table
        (as sglang's indexer computes it, padding rows included).
        Returns each layer's [padded_bs, top_k] row table."""
        reqs = [self.running[r].req for r in rids]
        bs = len(reqs)
        idx = torch.tensor([r.kv.req_pool_idx for r in reqs], dtype=torch.int64)
        old = torch.tensor([self.running[r].seq_len for r in rids], dtype=torch.int64)
        last_loc = self.req_to_token.req_to_token[idx, old - 1].to(torch.int64)
        out_cache_loc = self.allocator.alloc_decode(old + 1, old + 1, last_loc)
        assert out_cache_loc is not None
        self.req_to_token.write((idx, old), out_cache_loc.to(torch.int32))
        for r in reqs:
            r.kv.kv_allocated_len += 1
        seq = old + 1
        with unpinned(self.stock):
            self.coord.map_last_loc_to_buffer(seq, out_cache_loc, idx, seq, idx)

        # ModelRunner.forward_decode: wait for the backup, count the real requests.
        self.coord.wait_for_pending_backup()
        self.coord.num_real_reqs.fill_(bs)
        new = self.model_write(out_cache_loc)
        for i, rid in enumerate(rids):
            token = self.running[rid]
            token.rows[token.seq_len] = new[i]
            token.seq_len += 1
            token.req.output_ids.append(1)  # the step's sampled token (its KV comes next)

        pad = padded_bs - bs
        pad_idx = torch.cat((idx, torch.zeros(pad, dtype=torch.int64)))
        pad_seq = torch.cat((seq, torch.ones(pad, dtype=torch.int64)))
        tables = []
        for layer in range(self.layers):
            if select is not None:
                topk = select(layer, pad_idx, pad_seq)
            else:
                topk = torch.full((padded_bs, self.top_k), -1, dtype=torch.int32)
                for i, rid in enumerate(rids):
                    sel = topk_for(layer, rid, int(seq[i]))
                    topk[i, : sel.numel()] = sel
                # Padding rows carry garbage selections that must be ignored.
                topk[bs:] = torch.randint(0, 8, (pad, self.top_k), generator=self.gen)
            if self.stock:  # sglang's reference swap-in, over the real rows only
                table = torch.full((padded_bs, self.top_k), -1, dtype=torch.int32)
                table[:bs] = self.coord.naive_load_topk(idx, seq, topk[:bs], layer)
            else:
                table = self.coord.swap_in_selected_pages(pad_idx, pad_seq, topk, layer)
            tables.append((topk.clone(), table.clone()))
        return tables
