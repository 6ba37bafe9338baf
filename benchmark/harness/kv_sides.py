"""The two KV machineries the harness compares, behind one small interface.

``EchoSide``: sglang 0.5.23's own HiSparse classes (HiSparseDSATokenToKVPool device rows,
HiSparseTokenToKVPoolAllocator, the request table, the MLATokenToKVPoolHost that the
coordinator builds) with the plugin's ``EchoCoordinator`` on top, driven as sglang's
scheduler and model runner drive them: PD pre-allocation and direct admission or local
prefill and staging, ``alloc_decode`` + ``map_last_loc_to_buffer`` per step (the previous
token's backup on the backup stream), ``swap_in_selected_pages`` per layer inside the
decode graph, ``request_finished`` inside one result-processing scope, then the logical
ids and request slot freed.

``PlainSide``: sglang's DSATokenToKVPool with every token on the device at a fixed row
(request slot x context + position), the table read directly: the same loop without
offload, the reference.

The one compiled sglang extension on the ECHO side's path, sgl_kernel's host<->device KV
copy (``backup_from_device_all_layer``: the decode backup and the prefill staging), is
stood in for by torch copies through the host pool's UVA alias, on the stream sglang puts
them on (``torch_backup``).
"""

from __future__ import annotations

import os
from array import array
from types import SimpleNamespace

import torch

PAGE = 64
KV_LORA, ROPE = 512, 64
FP8_ROW_BYTES = 656


def pool_args(rows: int, layers: int, fp8: bool, device: str) -> dict:
    return dict(
        size=rows,
        page_size=PAGE,
        kv_lora_rank=KV_LORA,
        dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16,
        qk_rope_head_dim=ROPE,
        layer_num=layers,
        device=device,
        index_head_dim=128,
        enable_memory_saver=False,
        kv_cache_dim=FP8_ROW_BYTES if fp8 else KV_LORA + ROPE,
    )


def cpu_shims() -> None:
    """No GPU: sglang asks the device capability while importing model code and pins its
    host pool with cudaHostRegister; neither exists on the CPU."""
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    import sglang.srt.mem_cache.pool_host.common as host_common

    host_common._cuda_host_register = lambda *a, **k: None


def ceil_page(n: int) -> int:
    return -(-n // PAGE) * PAGE


def flat_rows(buffer: torch.Tensor) -> torch.Tensor:
    """One layer's device rows as [rows, width]."""
    return buffer.view(buffer.shape[0], -1)


def make_req(rid: str, prompt: list[int]):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    return Req(rid, "", array("i", prompt), SamplingParams(max_new_tokens=1 << 20))


class _LayerStub:
    """What ``set_mla_kv_buffer`` reads of a RadixAttention layer: its id."""

    def __init__(self, layer_id: int) -> None:
        self.layer_id = layer_id


def torch_backup(coordinator) -> None:
    """Stand in for sgl_kernel's ``transfer_kv_all_layer_mla`` (the host pool's
    ``backup_from_device_all_layer``): per layer, the device rows' bytes are copied to
    the host ids through the pool's UVA alias, on the current stream (sglang calls it on
    its backup or staging stream), so nothing synchronises."""
    host = coordinator.host_rows.device_view  # [layers, N_H + 2, W] on the GPU
    if host is None:
        raise RuntimeError("the host pool has no UVA alias: the harness needs a pinned pool")

    def backup_from_device_all_layer(device_pool, host_indices, device_indices, io_backend):
        ids = host_indices.to(host.device, torch.int64)
        src_rows = device_indices.to(host.device, torch.int64)
        for layer, buf in enumerate(device_pool.kv_buffer):
            src = flat_rows(buf).index_select(0, src_rows)
            host[layer].index_copy_(0, ids, src.view(host.dtype))

    coordinator.mem_pool_host.backup_from_device_all_layer = backup_from_device_all_layer


class _DecodeMode:
    """sglang's ForwardMode as the indexer hook asks it: a decode batch."""

    def is_decode(self) -> bool:
        return True


class _TopkMetadata:
    """sglang's indexer metadata as the hook sees it: its top-k over the logits."""

    def __init__(self, model) -> None:
        self.model = model

    def topk_transform(self, logits: torch.Tensor, topk: int) -> torch.Tensor:
        return self.model.top(logits)


def _paged_topk(scores: torch.Tensor):
    """``Indexer._get_topk_paged`` of the toy indexer: its logits are ``scores``."""

    def get_topk_paged(indexer, forward_batch, layer_id, q_fp8, weights, metadata):
        return metadata.topk_transform(scores, scores.shape[1])

    return get_topk_paged


class EchoSide:
    name = "echo"

    def __init__(self, cfg, device: str, forward_stream, tp_group) -> None:
        from sglang.srt.mem_cache.allocator.hisparse import HiSparseTokenToKVPoolAllocator
        from sglang.srt.mem_cache.hisparse_memory_pool import HiSparseDSATokenToKVPool

        from sglang_echo.config import ENV_FUSE_DECODE, reset_settings
        from sglang_echo.sglang.coordinator import EchoCoordinator

        self.cfg, self.device = cfg, device
        rows = ceil_page(cfg.dev_cache + 1) + cfg.max_running * PAGE
        rows += ceil_page(cfg.max_prompt) * cfg.max_running if cfg.mode == "local" else 0
        ratio = -(-cfg.host_tokens // rows)
        self.pool = HiSparseDSATokenToKVPool(
            **pool_args(rows, cfg.layers, cfg.fp8, device), host_to_device_ratio=ratio
        )
        dtype = torch.float8_e4m3fn if cfg.fp8 else torch.bfloat16
        self.allocator = HiSparseTokenToKVPoolAllocator(
            rows, PAGE, dtype, device, self.pool, need_sort=False, host_to_device_ratio=ratio
        )
        self.req_to_token = make_req_to_token(cfg, device)
        os.environ["NSA_DEV_CACHE_SIZE"] = str(cfg.dev_cache)
        os.environ[ENV_FUSE_DECODE] = "1" if cfg.prefetch else "0"
        reset_settings()
        self.coord = EchoCoordinator(
            self.req_to_token,
            self.allocator,
            top_k=cfg.top_k,
            device_buffer_size=ceil_page(cfg.top_k),
            device=device,
            tp_group=tp_group,
            host_to_device_ratio=ratio,
        )
        if torch.device(device).type == "cuda":
            torch_backup(self.coord)
        self.coord.set_decode_producer_stream(forward_stream)
        self.layers = [_LayerStub(layer) for layer in range(cfg.layers)]

    # ------------------------------------------------------------ admission
    def rows(self, layer: int) -> torch.Tensor:
        return flat_rows(self.pool.kv_buffer[layer])

    def arrive_pd(self, req, prompt_rows: torch.Tensor) -> None:
        """PD decode: pre-allocate logical ids and host slots, land the prefill node's
        bytes in the pinned host pool (RDMA follows no stream), admit directly."""
        from sglang.srt.disaggregation.decode import alloc_for_decode_prealloc_hisparse

        n = prompt_rows.shape[0]
        assert self.req_to_token.alloc([req]) is not None, "no request slot"
        idx = req.kv.req_pool_idx
        locs = alloc_for_decode_prealloc_hisparse(
            self.allocator, req=req, fill_len=n, uses_swa_tail=False, swa_tail_len=0
        )
        self.req_to_token.write((idx, slice(0, n)), locs.to(torch.int32))
        host_ids = self.coord.mem_pool_host.alloc_paged_token_slots(
            self.coord.req_to_host_pool, self.coord.req_to_host_pool_allocated_len, idx, 0, n
        )
        host = self.coord.host_rows.rows  # [layers, N_H + 2, W] pinned CPU memory
        ids = host_ids.cpu().to(torch.int64)
        for layer in range(self.cfg.layers):
            host[layer].index_copy_(0, ids, prompt_rows[:, layer].view(host.dtype))
        self.coord.admit_request_direct(req)

    def prefill_local(self, req, nope_rope) -> None:
        """Local prefill: the prompt's rows written by sglang's pool into device rows
        (alloc_extend), staged to the host by the coordinator, admitted when staged."""
        n = len(req.origin_input_ids)
        dev = self.device
        assert self.req_to_token.alloc([req]) is not None, "no request slot"
        idx = req.kv.req_pool_idx
        zero_d = torch.zeros(1, dtype=torch.int64, device=dev)
        n_d = torch.tensor([n], dtype=torch.int64, device=dev)
        zero_c, n_c = torch.zeros(1, dtype=torch.int64), torch.tensor([n], dtype=torch.int64)
        locs = self.allocator.alloc_extend(zero_d, zero_c, n_d, n_c, zero_d - 1, n)
        assert locs is not None, "no device rows for the prompt"
        self.req_to_token.write((idx, slice(0, n)), locs.to(torch.int32))
        req.kv.kv_allocated_len = n
        req.extend_end = n
        for layer in range(self.cfg.layers):
            nope, rope = nope_rope(layer)
            self.pool.set_mla_kv_buffer(self.layers[layer], locs, nope, rope)
        self.coord.admit_request_into_staging(req)
        ready: list = []
        while not ready:  # the staging copy runs on its own stream; the scheduler polls
            ready = self.coord.collect_ready_reqs()
        assert ready == [req]

    # ------------------------------------------------------------ decode step
    def prepare(self, reqs, seq_lens: list[int]) -> torch.Tensor:
        """sglang's prepare_for_decode: one logical id per request, the request table,
        then the coordinator's backup of each previous token and the newest-row mapping."""
        dev = self.device
        idx_c = torch.tensor([r.kv.req_pool_idx for r in reqs], dtype=torch.int64)
        old_c = torch.tensor([s - 1 for s in seq_lens], dtype=torch.int64)
        idx, old = idx_c.to(dev), old_c.to(dev)
        last = self.req_to_token.req_to_token[idx, old - 1].to(torch.int64)
        out = self.allocator.alloc_decode(old + 1, old_c + 1, last)
        assert out is not None, "no logical ids left"
        self.req_to_token.write((idx, old), out.to(torch.int32))
        for r in reqs:
            r.kv.kv_allocated_len += 1
        self.coord.map_last_loc_to_buffer(old + 1, out, idx, old_c + 1, idx_c)
        return out

    def before_forward(self, num_real: int) -> None:
        """ModelRunner.forward_decode, on the forward stream: wait for the backup (it
        reads the newest rows this step overwrites), count the real requests."""
        self.coord.wait_for_pending_backup()
        self.coord.num_real_reqs.fill_(num_real)

    def write(self, layer: int, out_cache_loc, nope, rope) -> None:
        self.pool.set_mla_kv_buffer(self.layers[layer], out_cache_loc, nope, rope)

    def select(self, model, layer: int, context, req_pool_indices, seq_lens, current):
        """The toy indexer's top-k and weights; with the decode prefetch on, its top-k
        runs through the plugin's hook on sglang's ``Indexer._get_topk_paged``, as
        sglang's decode would (staging from the logits around the unchanged top-k)."""
        if self.coord.decode_prefetch is None:
            return model.select(layer, context, seq_lens, current)
        from sglang_echo.sglang.decode_prefetch import topk_with_decode_prefetch

        scores = model.scores(layer, context, seq_lens, current)
        batch = SimpleNamespace(
            forward_mode=_DecodeMode(), req_pool_indices=req_pool_indices, seq_lens=seq_lens
        )
        topk = topk_with_decode_prefetch(
            _paged_topk(scores), None, batch, layer, None, None, _TopkMetadata(model)
        )
        return topk, model.weights(scores, topk)

    def table(self, layer: int, req_pool_indices, seq_lens, topk) -> torch.Tensor:
        return self.coord.swap_in_selected_pages(req_pool_indices, seq_lens, topk, layer)

    # ------------------------------------------------------------ finish
    def finish_all(self, reqs) -> None:
        """One step's finished requests, as sglang's result processing finishes them
        (inside the coordinator's scope: one release for all), then release_kv_cache."""
        with self.coord.one_release_per_step():
            for req in reqs:
                self.coord.request_finished(req)
        for req in reqs:
            self._release_kv(req)

    def _release_kv(self, req) -> None:
        """sglang's release_kv_cache: the logical ids (through HiSparse's mapping), then
        the request slot."""
        locs = self.req_to_token.req_to_token[req.kv.req_pool_idx, : req.kv.kv_allocated_len]
        self.allocator.free(locs.to(torch.int64))
        self.req_to_token.free(req)

    def abort(self, req) -> None:
        """A client abort outside result processing: released at once."""
        self.coord.request_finished(req)
        self._release_kv(req)

    def counters(self) -> torch.Tensor:
        """[evictions, misses, hits] summed over layers, on the device (no sync)."""
        c = self.coord.cache
        return torch.stack((c.evictions.sum(), c.misses.sum(), c.hits.sum()))


def make_req_to_token(cfg, device: str):
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    if cfg.mode == "pd":
        from sglang.srt.disaggregation.decode import DecodeReqToTokenPool

        return DecodeReqToTokenPool(
            size=cfg.max_running, max_context_len=cfg.max_context, device=device,
            enable_memory_saver=False, pre_alloc_size=cfg.max_running,
        )  # fmt: skip
    return ReqToTokenPool(
        size=cfg.max_running, max_context_len=cfg.max_context, device=device,
        enable_memory_saver=False,
    )  # fmt: skip


class PlainSide:
    """Every token on the device (sglang's DSATokenToKVPool), at row 1 + slot x context +
    position: the reference the ECHO side must match bit for bit."""

    name = "plain"

    def __init__(self, cfg, device: str, forward_stream, tp_group) -> None:
        from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

        self.cfg, self.device = cfg, device
        slots = cfg.max_running * 2  # request slots (a finished one's slot is reused)
        rows = ceil_page(1 + slots * cfg.max_context)
        self.pool = DSATokenToKVPool(
            **pool_args(rows, cfg.layers, cfg.fp8, device), index_buf_size=rows
        )  # no decode-context parallelism: the index buffer is the pool's size
        self.free_slots = list(range(slots))
        self.slot_of: dict[str, int] = {}
        self.layers = [_LayerStub(layer) for layer in range(cfg.layers)]
        self.num_real = torch.zeros(1, dtype=torch.int32, device=device)

    def rows(self, layer: int) -> torch.Tensor:
        return flat_rows(self.pool.kv_buffer[layer])

    def _admit(self, req) -> int:
        slot = self.free_slots.pop(0)
        self.slot_of[req.rid] = slot
        req.kv.req_pool_idx = slot + 1  # 0 stays the padding request, as in sglang
        return slot

    def _locs(self, slot: int, start: int, n: int) -> torch.Tensor:
        base = 1 + slot * self.cfg.max_context
        return torch.arange(base + start, base + start + n, device=self.device)

    def arrive_pd(self, req, prompt_rows: torch.Tensor) -> None:
        slot = self._admit(req)
        locs = self._locs(slot, 0, prompt_rows.shape[0])
        for layer in range(self.cfg.layers):
            self.rows(layer)[locs] = prompt_rows[:, layer].to(self.device).view(self.rows(0).dtype)

    def prefill_local(self, req, nope_rope) -> None:
        slot = self._admit(req)
        locs = self._locs(slot, 0, len(req.origin_input_ids))
        for layer in range(self.cfg.layers):
            nope, rope = nope_rope(layer)
            self.pool.set_mla_kv_buffer(self.layers[layer], locs, nope, rope)

    def prepare(self, reqs, seq_lens: list[int]) -> torch.Tensor:
        locs = [
            int(self._locs(self.slot_of[r.rid], s - 1, 1))
            for r, s in zip(reqs, seq_lens, strict=True)
        ]
        return torch.tensor(locs, dtype=torch.int64, device=self.device)

    def before_forward(self, num_real: int) -> None:
        self.num_real.fill_(num_real)

    def write(self, layer: int, out_cache_loc, nope, rope) -> None:
        self.pool.set_mla_kv_buffer(self.layers[layer], out_cache_loc, nope, rope)

    def select(self, model, layer: int, context, req_pool_indices, seq_lens, current):
        return model.select(layer, context, seq_lens, current)

    def table(self, layer: int, req_pool_indices, seq_lens, topk) -> torch.Tensor:
        rows = torch.arange(topk.shape[0], device=topk.device)
        real = (rows < self.num_real.to(torch.int64))[:, None] & (topk >= 0)
        base = 1 + (req_pool_indices.to(torch.int64) - 1) * self.cfg.max_context
        table = base[:, None] + topk.to(torch.int64)
        return torch.where(real, table, torch.full_like(table, -1)).to(torch.int32)

    def finish_all(self, reqs) -> None:
        for req in reqs:
            self.free_slots.append(self.slot_of.pop(req.rid))

    def abort(self, req) -> None:
        self.finish_all([req])

    def counters(self) -> torch.Tensor:
        return torch.zeros(3, dtype=torch.int64, device=self.device)
