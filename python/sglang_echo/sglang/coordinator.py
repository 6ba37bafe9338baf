"""EchoCoordinator: SGLang's HiSparse coordinator with ECHO's shared per-layer cache.

HiSparse (sglang 0.5.23, ``--enable-hisparse``) keeps every token's MLA rows in a pinned
host pool and gives each running request its own small LRU buffer per layer. ECHO
replaces those per-request buffers by one device cache per layer of N_G slots
(``NSA_DEV_CACHE_SIZE``) shared by all requests, managed by ``EchoManager``. Everything
else stays HiSparse's: the host pool and its page allocator, the host-id table
``req_to_host_pool``, PD direct-to-host admission, staging after a local prefill, and the
per-step backup of the previous token.

Device rows (one row-index space shared by all layers, HiSparseDSATokenToKVPool):
- ``[row_base, row_base + N_G + 2)``: ECHO's cache, reserved once at start-up; slot ``s``
  of layer ``l`` is row ``row_base + s`` of layer ``l``'s buffer;
- one 64-row page per running request: its newest token (written by the model this
  step, backed up to the host at the next step);
- in a non-disaggregated server, the prompt rows of requests being prefilled (freed when
  the request is admitted to decode).

Finished requests release their host ids from ECHO's cache together: sglang processes a
step's results (``SchedulerBatchResultProcessor.process_batch_result_*``) inside a scope
the coordinator opens (an AROUND hook registered when the first coordinator is built), and
the host ids of every request finished in it are unmapped from every layer in one
``EchoManager.release`` when it closes, then given back to the host pool. Finishes outside
a step's processing (aborts, retraction, transfer failures) release at once.

Imports sglang: loaded only by ``sglang_echo.sglang.install`` when ``NSA_KV_OFFLOAD=1``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import sglang.srt.managers.hisparse_coordinator as hisparse
import torch

from sglang_echo.config import ENV_DEV_CACHE, ConfigError, decode_prefetch_mode, settings
from sglang_echo.kernels.topk_rows import RING
from sglang_echo.offload.manager import EchoManager
from sglang_echo.sglang import retraction
from sglang_echo.sglang.args import ECHO_EXTRA_KEY
from sglang_echo.sglang.decode_prefetch import install_decode_prefetch, uninstall_decode_prefetch
from sglang_echo.sglang.guards import capacity_problems, decode_graphs_enabled, graph_problem
from sglang_echo.sglang.observe import install_metrics_hook, startup_line
from sglang_echo.sglang.prefill_budget import EchoPrefillBudget
from sglang_echo.sglang.retraction import KeptHostIds, install_retraction
from sglang_echo.sglang.storage import (
    ExternalHostRows,
    ExternalRowsCache,
    device_layer_rows,
    host_layer_rows,
)
from sglang_echo.sglang.topk_resolve import TopkToRows

logger = logging.getLogger(__name__)

# sglang's processing of one step's results: where its scheduler finishes requests.
RESULT_PROCESSOR = (
    "sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor"
)
STEP_RESULT_TARGETS = tuple(
    f"{RESULT_PROCESSOR}.{name}"
    for name in (
        "process_batch_result_decode",
        "process_batch_result_prefill",
        "process_batch_result_prebuilt",
    )
)
_step_release_installed = False


def release_finished_together(original, processor, *args, **kwargs):
    """AROUND sglang's processing of one step's results: the host ids of every request it
    finishes are released from ECHO's cache in one call when it returns."""
    coordinator = getattr(processor, "hisparse_coordinator", None)
    if not isinstance(coordinator, EchoCoordinator):
        return original(processor, *args, **kwargs)
    with coordinator.one_release_per_step():
        return original(processor, *args, **kwargs)


def install_step_release() -> None:
    """Register ``release_finished_together`` on sglang's result processing, once per
    process (the coordinator is built after the plugin's hooks were applied, so they are
    applied again; targets already patched are skipped). If sglang cannot apply it (it
    only logs that), finished requests release one at a time: slower, equally correct."""
    global _step_release_installed
    if _step_release_installed:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookSource, HookType

    source = HookSource(plugin_name="echo", dist_name="sglang-echo")
    for target in STEP_RESULT_TARGETS:
        HookRegistry.register(target, release_finished_together, HookType.AROUND, source=source)
    HookRegistry.apply_hooks()
    _step_release_installed = True
    missing = [t for t in STEP_RESULT_TARGETS if t not in HookRegistry._patched]
    if missing:
        logger.warning(
            "sglang-echo: could not wrap %s; finished requests release their host ids one "
            "request at a time (correct, one release launch per request).",
            ", ".join(missing),
        )


def echo_settings() -> dict:
    """ECHO's plan as resolved in the launcher (hisparse_config's extra keys: N_G, T, S);
    N_G from the environment when nothing is published (a coordinator built by hand)."""
    from sglang.srt.mem_cache.sparsity import parse_hisparse_config

    try:
        extra = dict(parse_hisparse_config().sparse_extra_config)
    except ValueError:  # no published server args
        extra = {}
    extra.setdefault(ECHO_EXTRA_KEY, settings().dev_cache_size)
    return extra


class _CpuStream(torch.cpu.Stream):
    """torch.cpu.Stream with HiSparse's ``synchronize``: CPU work is already synchronous."""

    def synchronize(self) -> None:
        return None


class EchoCoordinator(hisparse.HiSparseCoordinator):
    def __init__(
        self,
        req_to_token_pool,
        token_to_kv_pool_allocator,
        top_k: int,
        device_buffer_size: int,
        device: str,
        tp_group,
        host_to_device_ratio: int = 2,
        swap_in_block_size: int = 960,
        shared_index_layers: list[bool] | None = None,
        num_draft_tokens: int = 0,
    ) -> None:
        if num_draft_tokens:
            raise ConfigError(
                "sglang-echo does not support speculative decoding; launch without "
                "--speculative-algorithm or without NSA_KV_OFFLOAD=1."
            )
        # No shared-index prefetch plan: ECHO resolves every layer on its own.
        super().__init__(
            req_to_token_pool,
            token_to_kv_pool_allocator,
            top_k=top_k,
            device_buffer_size=device_buffer_size,
            device=device,
            tp_group=tp_group,
            host_to_device_ratio=host_to_device_ratio,
            swap_in_block_size=swap_in_block_size,
            shared_index_layers=None,
            num_draft_tokens=0,
        )
        if self.is_dsv4_hisparse or self.is_m3_hisparse:
            raise ConfigError(
                "sglang-echo supports DSA models (DeepSeek-V3.2, GLM-5); launch this "
                "model without NSA_KV_OFFLOAD=1."
            )
        self.is_cuda = torch.device(device).type == "cuda"
        if not self.is_cuda:
            self._use_torch_transfers()
        self._drop_per_request_buffers()
        plan = echo_settings()
        self.num_slots = int(plan[ECHO_EXTRA_KEY])
        self.reserved_host_ids = self._reserve_host_pages()
        self.reserved_logical_ids = self._match_logical_to_host()
        problems = capacity_problems(
            plan,
            device_rows=self.mem_pool_device.size,
            host_tokens=self.mem_pool_host.available_size(),
        )
        if problems:
            raise ConfigError("\n".join(problems))
        self.reserved_device_rows, self.row_base = self._reserve_device_rows()

        device_rows = device_layer_rows(
            self.mem_pool_device.kv_buffer, self.row_base, self.num_slots
        )
        host_rows = host_layer_rows(self.mem_pool_host.kv_buffer)
        if host_rows.dtype != device_rows[0].dtype or host_rows.shape[2] != device_rows[0].shape[1]:
            raise ConfigError(
                f"host rows ({host_rows.dtype}, {host_rows.shape[2]}) and device rows "
                f"({device_rows[0].dtype}, {device_rows[0].shape[1]}) differ; "
                "use --kv-cache-dtype bfloat16 or fp8_e4m3."
            )
        self.host_rows = ExternalHostRows(host_rows)
        self.cache = ExternalRowsCache(device_rows, self.host_rows.num_tokens)
        self.manager = EchoManager(self.host_rows, self.cache)
        problem = graph_problem(
            is_cuda=self.is_cuda,
            graph_safe=self.manager.graph_safe,
            decode_graphs=decode_graphs_enabled(),
        )
        if problem:
            raise ConfigError(problem)
        if self.is_cuda and not self.manager.graph_safe:
            logger.warning(
                "sglang-echo: the host pool has no UVA alias on the GPU; recalls copy "
                "through the host (decode CUDA graphs are off, so this is correct, slower)."
            )

        max_reqs = self.req_to_token_pool.req_to_token.shape[0]
        if self.page_size != RING:
            raise ConfigError(f"sglang-echo needs {RING}-token pages (got {self.page_size})")
        # Each running request's ring (kernels/topk_rows.py): the rows of its one device
        # page, where the token at position p is written (p % RING) and stays for RING
        # steps, so its newest decoded tokens are read in place, never recalled; all 0 =
        # no ECHO state (e.g. the padding request 0 of CUDA-graph capture and replays).
        # ring_start: the first position written there (the tokens before are on the host).
        self.ring_rows = torch.zeros(max_reqs, RING, dtype=torch.int64, device=device)
        self.ring_start = torch.zeros(max_reqs, dtype=torch.int64, device=device)
        self._newest_page: dict[int, torch.Tensor] = {}
        self._backup_issued = False  # a decode backup recorded and not yet waited on
        self.resolver = TopkToRows(
            self.manager,
            self.row_base,
            self.req_to_host_pool,
            self.ring_rows,
            self.ring_start,
            top_k,
            self.top_k_device_locs_buffer,
        )
        # What one admitted request holds on the device: its newest page. PD decode's
        # admission budget divides the free device rows by this.
        self.padded_buffer_size = self.page_size
        # Finished requests' host-id rows (-1 padded) not yet released: one release per
        # step (one_release_per_step), or at once outside a step's result processing.
        self._finished_host_rows: list[torch.Tensor] = []
        self._step_depth = 0
        # Retraction (sglang_echo/sglang/retraction.py): for each request admitted
        # directly (PD: its KV is all in the host pool), how many of its tokens the host
        # pool holds; host-id rows a retraction kept that no backup has claimed yet.
        self._host_len: dict[int, int] = {}
        self._unclaimed: dict[int, KeptHostIds] = {}
        # Kept rows a backup claimed, until resume or release, oldest first (keyed by
        # id(kept)): each holds logical ids for its host ids, and is dropped, newest
        # first, when a decode step needs the room (check_decode_capacity).
        self._kept: dict[int, KeptHostIds] = {}
        install_step_release()
        install_retraction()
        # SGLANG_NSA_FUSE_LOGITS_RECALL_DECODE=1: stage predicted misses from sglang's own
        # indexer logits while its top-k runs (sglang/decode_prefetch.py).
        self.decode_prefetch = None
        if decode_prefetch_mode(settings().fuse_decode) == "1":
            self.decode_prefetch = install_decode_prefetch(self)
        else:  # a coordinator built earlier in this process may have turned it on
            uninstall_decode_prefetch()
        if self.decode_prefetch is not None:
            logger.info(
                "sglang-echo: decode prefetch on (staged from sglang's indexer logits); its "
                "staging buffer holds %.1f MB on the device",
                self.decode_prefetch.nbytes / 1e6,
            )
        self._patch_decode_capacity()
        self._patch_prefill_budget()
        # Counter values last sent to sglang's exporter (observe.publish_metrics).
        self._metrics_sent: dict[str, float] = {}
        install_metrics_hook()
        logger.info(startup_line(self, "on" if self.decode_prefetch is not None else "off"))

    # ---------------------------------------------------------------- set-up
    def _use_torch_transfers(self) -> None:
        """sglang's host<->device copy ops and stream sync exist on CUDA/ROCm/XPU only.
        On the CPU (where sglang does not serve; our tests run there) the coordinator
        gives its host pool the same copies in torch, synchronously."""
        host = self.mem_pool_host

        def backup_from_device_all_layer(device_pool, host_indices, device_indices, io_backend):
            rows = host_layer_rows(host.kv_buffer)
            ids = host_indices.to(torch.int64)
            for layer, buf in enumerate(device_pool.kv_buffer):
                src = buf.view(buf.shape[0], -1).index_select(0, device_indices.to(torch.int64))
                rows[layer].index_copy_(0, ids, src.to(rows.dtype))

        def load_to_device_per_layer(
            device_pool, host_indices, device_indices, layer_id, io_backend, *, is_draft=False
        ):
            rows = host_layer_rows(host.kv_buffer)[layer_id]
            buf = device_pool.kv_buffer[layer_id]
            flat = buf.view(buf.shape[0], -1)
            src = rows.index_select(0, host_indices.to(torch.int64))
            flat.index_copy_(0, device_indices.to(torch.int64), src.to(flat.dtype))

        host.backup_from_device_all_layer = backup_from_device_all_layer
        host.load_to_device_per_layer = load_to_device_per_layer
        self.write_staging_stream = _CpuStream()
        self.decode_backup_stream = _CpuStream()

    def _drop_per_request_buffers(self) -> None:
        """HiSparse's per-request, per-layer buffer tables (about 1 MB per request slot
        for 61 layers) are unused by ECHO: replace them by empty tensors, so a HiSparse
        path that ECHO does not override fails loudly instead of reading stale tables."""
        for name in (
            "req_to_device_buffer",
            "req_device_buffer_tokens",
            "req_device_buffer_token_locs",
            "lru_slots",
            "_lru_init",
            "raw_indices_buffer",
        ):
            old = getattr(self, name)
            setattr(self, name, torch.empty(0, dtype=old.dtype, device=old.device))

    def _reserve_host_pages(self) -> torch.Tensor:
        """Keep the first host page (id 0: ECHO's sink) and the last (id size-1: ECHO's
        scratch row) out of SGLang's host allocator for good."""
        host = self.mem_pool_host
        page = host.page_size
        total = host.available_size()
        if total != host.size or total % page or total < 3 * page:
            raise ConfigError(
                f"sglang-echo needs a fresh host pool of >= 3 pages, got {total} free of "
                f"{host.size} slots (page {page}); raise --max-total-tokens."
            )
        every = host.alloc(total)
        keep = (every < page) | (every >= host.size - page)
        host.free(every[~keep])
        reserved = every[keep]
        if reserved.numel() != 2 * page:
            raise ConfigError("sglang-echo: could not reserve the host pool's first and last page")
        return reserved

    def _match_logical_to_host(self) -> torch.Tensor:
        """Every logical token id must be able to get a host slot (PD pre-allocation and
        each decode backup take one per token). sglang sizes the host pool one page above
        the logical pool, and ECHO keeps two host pages, so the logical pool would be one
        page larger than the host pool can serve: once it filled, the host allocation
        would raise. Hold the excess logical pages for good instead, so that admission
        and retraction see the capacity the host pool really has.

        The invariant, logical free <= host free, then holds at every moment (a running
        request holds at least as many logical ids as host ids: the host lags one token),
        and checks on the logical pool alone also cover the host pool. A retraction that
        keeps host ids holds as many logical ids until resume, to keep it (retraction.py)."""
        logical = self.token_to_kv_pool_allocator.logical_attn_allocator
        page = self.page_size
        excess = logical.available_size() - self.mem_pool_host.available_size()
        if excess <= 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        excess = -(-excess // page) * page
        ids = logical.alloc(excess)
        if ids is None:
            raise ConfigError(
                f"sglang-echo: could not hold {excess} logical token ids to match the host "
                "pool; the pool was used before the coordinator."
            )
        return ids

    def _reserve_device_rows(self) -> tuple[torch.Tensor, int]:
        """Reserve N_G + 1 contiguous device rows right after the padding page; ECHO's
        sink slot 0 then sits on the padding page's last row (never written by ECHO)."""
        allocator = self.token_to_kv_pool_allocator.hisparse_attn_allocator
        page = self.page_size
        need = -(-(self.num_slots + 1) // page) * page
        available = allocator.available_size()
        if available < need + page:
            raise ConfigError(
                f"{ENV_DEV_CACHE}={self.num_slots} needs {need} device rows plus one "
                f"{page}-row page per running request, but the device pool has {available} "
                f"free rows; lower {ENV_DEV_CACHE} or give the KV pool more GPU memory "
                "(--mem-fraction-static)."
            )
        rows = allocator.alloc(need)
        if rows is None:
            raise ConfigError(f"sglang-echo: the device allocator refused {need} rows")
        rows_cpu = rows.cpu()
        first = int(rows_cpu[0])
        if first != page or not torch.equal(rows_cpu, torch.arange(first, first + need)):
            allocator.free(rows)
            raise ConfigError(
                "sglang-echo: the device rows for the ECHO cache must be contiguous and "
                "start after the padding page; the pool was used before the coordinator."
            )
        return rows, first - 1

    def _patch_decode_capacity(self) -> None:
        """A decode step allocates logical token ids only (its KV goes to the request's
        newest row), so only the logical pool can run short. HiSparse's allocator compares
        min(logical, device) free and would retract requests for lack of device rows,
        which ECHO reserved at start-up. Kept rows of retracted requests give way first
        (``_drop_kept_for``): sglang's retract loop calls this check too, so they are
        dropped before any running request is retracted or aborted."""
        allocator = self.token_to_kv_pool_allocator
        logical = allocator.logical_attn_allocator

        def check_decode_capacity(*, num_tokens, tree_cache, requests=None, spec_algorithm=None):
            allocator.evict_to_free_tokens(tree_cache, num_tokens)
            self._drop_kept_for(num_tokens)
            return logical.available_size() >= num_tokens

        allocator.check_decode_capacity = check_decode_capacity

    def _patch_prefill_budget(self) -> None:
        """A non-PD server's prefill admission: logical ids and device rows are separate
        ledgers (EchoPrefillBudget), or running requests' future decode tokens, which
        never take a device row, would starve every new prompt."""
        allocator = self.token_to_kv_pool_allocator

        def create_prefill_budget(tree_cache, *, num_mixed_decode_tokens=0):
            return EchoPrefillBudget(
                allocator, tree_cache, num_mixed_decode_tokens=num_mixed_decode_tokens
            )

        allocator.create_prefill_budget = create_prefill_budget

    # ------------------------------------------------------------- admission
    def alloc_device_buffer(self, req) -> None:
        """Admission to decode (PD direct or after staging): the request's prompt rows,
        if any, are freed, and it gets one page, its ring, where the tokens it decodes
        from its current length on are written.
        A staged request's (local prefill) newest prompt rows go into ECHO's cache first,
        copied on the device (``_warm_from_prompt``)."""
        idx = req.kv.req_pool_idx
        logical = self.req_to_token_pool.req_to_token[idx, : req.kv.kv_allocated_len]
        if getattr(req, "hisparse_staging", False):
            self._warm_from_prompt(idx, logical[: req.extend_end])
        page = self.token_to_kv_pool_allocator.alloc_device_buffer(
            logical.to(torch.int64), self.page_size
        )
        if page is None:
            free = self.token_to_kv_pool_allocator.hisparse_attn_allocator.available_size()
            raise RuntimeError(
                f"sglang-echo: no device page for request {req.rid!r} (request slot {idx}): "
                f"each running request holds one {self.page_size}-row page for its newest "
                f"token and the device pool has {free} free rows; more requests were "
                "admitted than the plan sized the pool for (--max-running-requests)."
            )
        self._newest_page[idx] = page
        self.ring_rows[idx] = page
        self.ring_start[idx] = req.kv.kv_allocated_len
        if self.decode_prefetch is not None:
            self.decode_prefetch.reset_row(idx)

    def _warm_from_prompt(self, idx: int, logical: torch.Tensor) -> None:
        """``logical``: the ids staging copied to the host (the prompt, ``extend_end``).
        A locally prefilled prompt is on the device (its rows are freed right after
        this) and, staged, on the host: its newest ``warm_tokens`` rows enter ECHO's cache
        in every layer by a device-to-device copy, as the runtime's prefill appends its
        prompt, so the first decode step does not recall a top-k's worth of rows per
        layer that were on the GPU a moment ago. The window is the request's fair share
        of the cache (N_G over the request slots), so one admission does not evict the
        running requests' working sets. Stream order keeps the copy before any reuse of
        the freed rows (their next writer runs after this on the forward stream)."""
        n = logical.numel()
        take = min(n, self.warm_tokens)
        if take == 0:
            return
        device_rows = self.mem_pool_device.translate_loc_from_full_to_hisparse_device(
            logical[n - take :].to(torch.int64)
        ).to(torch.int64)
        host_ids = self.req_to_host_pool[idx, n - take : n].to(self.cache.device, torch.int64)
        for layer, buf in enumerate(self.mem_pool_device.kv_buffer):
            rows = buf.view(buf.shape[0], -1).index_select(0, device_rows)
            self.manager.insert(layer, host_ids, rows)

    @property
    def warm_tokens(self) -> int:
        """Prompt rows a staged request brings into ECHO's cache per layer (its share)."""
        slots = max(1, self.req_to_token_pool.req_to_token.shape[0] - 1)
        return min(self.num_slots, self.num_slots // slots)

    def admit_request_direct(self, req) -> None:
        """PD decode: the prompt's KV is already in the host pool (RDMA); no preload,
        ECHO recalls what the indexer selects."""
        self.alloc_device_buffer(req)
        req.hisparse_staging = False
        idx = req.kv.req_pool_idx
        self._skip_first_backup[idx] = True
        self._host_len[idx] = self.host_token_len(req.kv.kv_allocated_len)

    # ------------------------------------------------------------ decode step
    def map_last_loc_to_buffer(
        self,
        seq_lens: torch.Tensor,
        out_cache_loc: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        req_pool_indices_cpu: torch.Tensor,
    ) -> None:
        """Back up each request's previous token, then point the token being decoded at
        its ring row (the model's KV write lands there). The batch's real request count
        is known here, on the host: one past N_G // top-k fails now."""
        self.resolver.check_batch(len(req_pool_indices_cpu))
        self._eager_backup_previous_token(
            seq_lens, req_pool_indices, seq_lens_cpu, req_pool_indices_cpu
        )
        mapping = self.mem_pool_device.full_to_hisparse_device_index_mapping
        mapping[out_cache_loc] = self.ring_row_of(req_pool_indices, seq_lens - 1)

    def _eager_backup_previous_token(
        self,
        seq_lens: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        req_pool_indices_cpu: torch.Tensor,
    ) -> None:
        """The token decoded last step is in its ring row: copy it (all layers) to a fresh
        host slot at its position, long before its row is written again (RING steps
        on); the resolve reads it from the ring meanwhile."""
        batch_rows: list[int] = []
        host_ids: list[torch.Tensor] = []
        for i, (req_idx, seq_len) in enumerate(
            zip(req_pool_indices_cpu.tolist(), seq_lens_cpu.tolist(), strict=True)
        ):
            if self._skip_first_backup[req_idx]:  # prompt already on the host
                self._skip_first_backup[req_idx] = False
                continue
            batch_rows.append(i)
            host_ids.append(self._host_slot(req_idx, seq_len - 2))
        if not batch_rows:
            return
        rows = torch.tensor(batch_rows, dtype=torch.int64, pin_memory=self.is_cuda)
        rows = rows.to(self.device, non_blocking=True)
        previous = self.ring_row_of(req_pool_indices[rows], seq_lens[rows] - 2)
        self._backup_newest_rows(previous, torch.cat(host_ids))

    def ring_row_of(self, req_pool_indices: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The device row of each request's token at ``positions`` in its ring."""
        return self.ring_rows[req_pool_indices, positions.remainder(RING)]

    def _host_slot(self, req_idx: int, position: int) -> torch.Tensor:
        """The host slot of the request's token at ``position`` (allocated by page)."""
        slot = self.mem_pool_host.alloc_paged_token_slots(
            self.req_to_host_pool, self.req_to_host_pool_allocated_len, req_idx, position, 1
        )
        if req_idx in self._host_len:
            self._host_len[req_idx] = max(self._host_len[req_idx], position + 1)
        return slot

    def _backup_newest_rows(self, device_rows: torch.Tensor, host_locs: torch.Tensor) -> None:
        """Copy newest rows (all layers) to their host slots on the backup stream, after
        the forward that wrote them."""
        device_module = hisparse.device_module
        self.wait_for_pending_backup()
        schedule_stream = device_module.current_stream()
        with device_module.stream(self.decode_backup_stream):
            self.decode_backup_stream.wait_stream(schedule_stream)
            if self.decode_producer_stream is not None:
                self.decode_backup_stream.wait_stream(self.decode_producer_stream)
            self.mem_pool_host.backup_from_device_all_layer(
                self.mem_pool_device, host_locs, device_rows, io_backend="kernel"
            )
            self._backup_done_event.record()
            self._backup_issued = True
            if self.is_cuda:
                host_locs.record_stream(self.decode_backup_stream)
                device_rows.record_stream(self.decode_backup_stream)
        self._has_pending_backup = True

    def swap_in_selected_pages(
        self,
        req_pool_indices: torch.Tensor,
        compressed_seq_lens: torch.Tensor,
        top_k_result: torch.Tensor,
        layer_id: int,
    ) -> torch.Tensor:
        """Top-k positions -> device rows of this layer (ECHO resolve); -1 = none."""
        if top_k_result.ndim != 2:
            raise ValueError("sglang-echo resolves [batch, top_k] selections only")
        return self.resolver(
            layer_id, req_pool_indices, compressed_seq_lens, top_k_result, self.num_real_reqs
        )

    # --------------------------------------------------------------- release
    def _release_host_ids(self, req_pool_idx: int) -> torch.Tensor:
        """The request's host ids, unmapped from ECHO's cache in every layer: a host id
        freed while still mapped would give its next owner another token's rows."""
        host_ids = self.mem_pool_host.allocated_host_indices(
            self.req_to_host_pool,
            req_pool_idx,
            self.req_to_host_pool_allocated_len[req_pool_idx],
        )
        if host_ids.numel() > 0:
            self.manager.release(host_ids.to(self.cache.device, torch.int64))
        return host_ids

    def _host_id_row(self, req_pool_idx: int) -> torch.Tensor | None:
        """A copy of the request's host-id row over its allocated pages (-1 = none), as
        ``allocated_host_indices`` reads it, without its device-to-host filter."""
        allocated = int(self.req_to_host_pool_allocated_len[req_pool_idx])
        if allocated <= 0:
            return None
        page = self.mem_pool_host.page_size
        length = min(-(-allocated // page) * page, self.req_to_host_pool.shape[1])
        return self.req_to_host_pool[req_pool_idx, :length].clone()

    @contextmanager
    def one_release_per_step(self) -> Iterator[None]:
        """Requests finished inside release their host ids together when the outermost
        scope closes (sglang's processing of one step's results: release_finished_together).
        Until then their host ids stay allocated in sglang's host pool, so none can be
        reused while ECHO's maps still name it."""
        self._step_depth += 1
        try:
            yield
        finally:
            self._step_depth -= 1
            if self._step_depth == 0:
                self.release_finished()

    def release_finished(self) -> None:
        """Every finished request's host ids not yet released: unmapped from ECHO's cache
        in every layer in ONE EchoManager.release, then (the host having waited for the
        last decode backup) given back to sglang's host pool, in that order."""
        rows, self._finished_host_rows = self._finished_host_rows, []
        if not rows:
            return
        ids = torch.cat(rows) if len(rows) > 1 else rows[0]
        ids = ids[ids >= 0]
        if ids.numel() == 0:
            return
        if self.decode_producer_stream is not None:
            hisparse.device_module.current_stream().wait_stream(self.decode_producer_stream)
        self.manager.release(ids.to(self.cache.device, torch.int64))
        self._finish_backup_on_host()
        self.mem_pool_host.free(ids)

    def request_finished(self, req) -> None:
        """Finish, abort or retract: free the newest page and unmap the request's token
        ids now; its host ids are released from ECHO's cache, then given back to the
        host pool, with the other requests finished in this step (or at once outside a
        step's result processing)."""
        self._end_decode_state(req)
        idx = req.kv.req_pool_idx
        row = self._host_id_row(idx)
        if row is not None:
            self._finished_host_rows.append(row)
        self._clear_host_row(idx)
        if self._step_depth == 0:
            self.release_finished()

    def _end_decode_state(self, req) -> None:
        """After the in-flight forward and the last backup: the newest page freed and the
        request's token ids unmapped from it."""
        device_module = hisparse.device_module
        if self.decode_producer_stream is not None:
            device_module.current_stream().wait_stream(self.decode_producer_stream)
        self.wait_for_pending_backup()
        idx = req.kv.req_pool_idx
        page = self._newest_page.pop(idx, None)
        if page is not None:
            self.token_to_kv_pool_allocator.free_hisparse_indices(page)
            logical = self.req_to_token_pool.req_to_token[idx, : req.kv.kv_allocated_len]
            self.mem_pool_device.full_to_hisparse_device_index_mapping[logical.to(torch.int64)] = 0
            self.ring_rows[idx] = 0
            self.ring_start[idx] = 0
        # Without a page the request ended during prefill: release_kv_cache frees its
        # prompt rows through the mapping, as in HiSparse.

    def _clear_host_row(self, idx: int) -> None:
        self.req_to_host_pool[idx, :] = -1
        self.req_to_host_pool_allocated_len[idx] = 0
        self._skip_first_backup[idx] = False
        self._host_len.pop(idx, None)

    # ------------------------------------------------------------- retraction
    @contextmanager
    def retraction_scope(self) -> Iterator[None]:
        """sglang's release_req (retraction.py): inside it, a PD request's retraction
        keeps its host ids for sglang's backup to claim; the ones not claimed are released
        when the outermost scope closes."""
        retraction.SCOPES.append(self)
        try:
            yield
        finally:
            retraction.SCOPES.remove(self)
            if self not in retraction.SCOPES:
                unclaimed, self._unclaimed = list(self._unclaimed.values()), {}
                for kept in unclaimed:
                    self.discard_kept(kept)
                self._hold_logical_ids()

    def _hold_logical_ids(self) -> None:
        """sglang's release_kv_cache (inside the scope) has freed the retracted requests'
        logical ids, while their host ids stay kept: hold as many logical ids as each kept
        row has host ids, so logical free <= host free holds again. The release freed at
        least that many (a request holds no fewer logical ids than host ids), so this does
        not fail; if it ever did, the row is dropped (503) rather than break the check."""
        logical = self.token_to_kv_pool_allocator.logical_attn_allocator
        for kept in [k for k in self._kept.values() if k.logical is None and not k.installed]:
            n = kept.host_ids
            ids = logical.alloc(n) if n else torch.empty(0, dtype=torch.int64, device=self.device)
            if ids is None:
                logger.warning(
                    "sglang-echo: no %d logical ids to hold for retracted request %s; its "
                    "kept KV is released",
                    n,
                    kept.rid,
                )
                self._drop_kept(kept)
                continue
            kept.logical = ids

    def retract_req(self, req) -> None:
        """A retraction inside sglang's release_req of a request admitted directly (PD
        decode: its KV is in the host pool) keeps its host ids; any other retraction
        releases like a finish (HiSparse's behaviour)."""
        direct = req.kv.req_pool_idx in self._host_len
        keeps = retraction.ENABLED and self in retraction.SCOPES and direct
        if not keeps or getattr(req, "hisparse_staging", False):
            super().retract_req(req)
            return
        self._unclaimed[id(req)] = self._keep_host_ids(req)

    def _keep_host_ids(self, req) -> KeptHostIds:
        """The request's host-id row, holding every token sglang restores at resume (its
        prompt and outputs but the last, whose KV the resumed step computes): the newest
        row's token is backed up first if the host pool lacks it (the host waits: the
        page is freed right after). The ids stay allocated and mapped in ECHO's cache."""
        from sglang.srt.disaggregation.decode import DecodePreallocQueue

        idx = req.kv.req_pool_idx
        tokens = DecodePreallocQueue._pre_alloc_fill_len(req)
        self._back_up_missing_token(req, tokens)
        self._end_decode_state(req)
        row = self._host_id_row(idx)
        kept = KeptHostIds(
            self,
            row if row is not None else torch.empty(0, dtype=torch.int64),
            int(self.req_to_host_pool_allocated_len[idx]),
            tokens,
        )
        self._clear_host_row(idx)
        return kept

    def _back_up_missing_token(self, req, tokens: int) -> None:
        """The host pool holds the first ``tokens - 1`` of the request's tokens when its
        last step's results were processed (its newest row holds the last one), or all of
        them when the retraction comes while that step is in flight (its backup was
        issued when the step was prepared): in the first case copy the newest row now."""
        idx = req.kv.req_pool_idx
        held = self._host_len.get(idx, 0)
        if held < tokens:
            page = self._newest_page.get(idx)
            if held != tokens - 1 or page is None or self._skip_first_backup[idx]:
                raise RuntimeError(
                    f"sglang-echo: retracting request {req.rid!r}: the host pool holds "
                    f"{held} of its {tokens} tokens and its newest row cannot supply the "
                    "rest; the coordinator's bookkeeping is wrong"
                )
            newest = self.ring_rows[idx : idx + 1, (tokens - 1) % RING].clone()
            # On the backup stream, after the in-flight forward.
            self._backup_newest_rows(newest, self._host_slot(idx, tokens - 1))
            self._finish_backup_on_host()

    def claim_kept(self, req) -> KeptHostIds | None:
        """The host ids this coordinator's retraction of ``req`` kept (sglang's backup),
        registered as live until resume or release."""
        kept = self._unclaimed.pop(id(req), None)
        if kept is not None:
            kept.rid = req.rid
            self._kept[id(kept)] = kept
        return kept

    @contextmanager
    def installing_kept_row(self, kept: KeptHostIds) -> Iterator[None]:
        """sglang's resume (_pre_alloc) allocates the request slot, then host slots for the
        tokens it restores from position 0: that allocation is given the kept row first,
        so it allocates nothing. The logical ids the row held are freed first: sglang
        allocates the request's fill anew right after (credited in its resume budget)."""
        self._free_held_logical(kept)
        host = self.mem_pool_host
        own = "alloc_paged_token_slots" in vars(host)
        original = host.alloc_paged_token_slots

        def alloc(req_to_host_pool, allocated_len, req_pool_idx, start_pos, num_tokens):
            if not kept.installed and start_pos == 0 and int(allocated_len[req_pool_idx]) == 0:
                n = kept.row.numel()
                req_to_host_pool[req_pool_idx, :n] = kept.row.to(req_to_host_pool.device)
                allocated_len[req_pool_idx] = kept.allocated
                kept.installed = True
            return original(req_to_host_pool, allocated_len, req_pool_idx, start_pos, num_tokens)

        host.alloc_paged_token_slots = alloc
        try:
            yield
        finally:
            if own:
                host.alloc_paged_token_slots = original
            else:
                del host.alloc_paged_token_slots

    def resume_kept(self, req, kept: KeptHostIds) -> None:
        """sglang's restore of a resumed request: its row holds the kept host ids (its KV
        in the host pool, the tokens still cached in ECHO's cache where they were); admit
        it directly, as a PD arrival."""
        self._kept.pop(id(kept), None)
        idx = req.kv.req_pool_idx
        n = kept.row.numel()
        row = self.req_to_host_pool[idx, :n].to(kept.row.device)
        if not kept.installed or not torch.equal(row, kept.row):
            raise RuntimeError(
                f"sglang-echo: request {req.rid!r} resumed without its kept host ids "
                "(sglang's resume path changed?); its KV would be read from the wrong host "
                "rows"
            )
        if req.kv.kv_allocated_len != kept.tokens:
            raise RuntimeError(
                f"sglang-echo: request {req.rid!r} resumed with {req.kv.kv_allocated_len} "
                f"tokens, its kept host ids hold {kept.tokens}"
            )
        self.admit_request_direct(req)

    def discard_kept(self, kept: KeptHostIds) -> None:
        """Kept host ids of a request that will not resume: released like a finish's,
        with the logical ids held for them. Once only: a row already released (dropped
        under pressure, then aborted or discarded by sglang) frees nothing twice."""
        if kept.released:
            return
        kept.released = True
        self._kept.pop(id(kept), None)
        self._free_held_logical(kept)
        if kept.row.numel():
            self._finished_host_rows.append(kept.row)
        if self._step_depth == 0:
            self.release_finished()

    def _free_held_logical(self, kept: KeptHostIds) -> None:
        if kept.logical is not None and kept.logical.numel():
            self.token_to_kv_pool_allocator.logical_attn_allocator.free(kept.logical)
        kept.logical = None

    def _drop_kept_for(self, num_tokens: int) -> None:
        """A decode step needs ``num_tokens`` logical ids: drop kept rows, newest first,
        until they fit or none is left. A kept row frees nothing by retracting more
        requests (it holds its ids), so without this sglang would retract every running
        request and abort the last with a 500. The newest go first: the head of the
        retracted queue resumes first."""
        logical = self.token_to_kv_pool_allocator.logical_attn_allocator
        while self._kept and logical.available_size() < num_tokens:
            self._drop_kept(self._kept[next(reversed(self._kept))])

    def _drop_kept(self, kept: KeptHostIds) -> None:
        """Release a kept row under memory pressure: its request ends with a 503 when the
        prealloc queue next looks at its retracted requests (retraction.abort_dropped)."""
        logger.warning(
            "sglang-echo: decode memory pressure: releasing the kept KV of retracted "
            "request %s (%d host tokens); it ends with 503",
            kept.rid,
            kept.host_ids,
        )
        kept.dropped = True
        self.discard_kept(kept)
        self.release_finished()  # its host ids free now, with its logical ids

    def _finish_backup_on_host(self) -> None:
        """Block the host until the last decode backup has landed, before host ids go
        back to the allocator. wait_for_pending_backup only orders the device streams;
        a freed host id can be handed at once to a PD transfer, whose RDMA write into
        pinned memory follows no stream, and an in-flight backup of this request's
        previous token would then land on the new owner's row. (A device sync on a
        boolean mask happens to wait for it today; this does not rely on that.)"""
        if self._backup_issued:
            self._backup_done_event.synchronize()
            self._backup_issued = False

    def abort_staging_request(self, req) -> None:
        self._release_host_ids(req.kv.req_pool_idx)
        super().abort_staging_request(req)

    def prepare_spec_verify(self, batch) -> None:
        raise RuntimeError("sglang-echo does not support speculative decoding")

    def commit_spec_accept_tokens(self, batch, accept_indices) -> None:
        raise RuntimeError("sglang-echo does not support speculative decoding")

    # ------------------------------------------------------------ statistics
    def get_token_stats(self) -> hisparse.HiSparseTokenStats:
        """Token usage without ECHO's fixed reservations: device rows held by requests
        (newest pages, prompts being prefilled) out of the rows left after ECHO's cache,
        and host tokens out of the host pool less its two reserved pages. Host-side
        counters only: no device synchronisation."""
        allocator = self.token_to_kv_pool_allocator.hisparse_attn_allocator
        device_capacity = allocator.size - self.reserved_device_rows.numel()
        device_tokens = device_capacity - allocator.available_size()
        host = self.mem_pool_host
        host_capacity = host.size - self.reserved_host_ids.numel()
        host_tokens = host_capacity - host.available_size()
        return hisparse.HiSparseTokenStats(
            device_tokens=device_tokens,
            device_token_usage=device_tokens / device_capacity if device_capacity > 0 else 0.0,
            host_tokens=host_tokens,
            host_token_usage=host_tokens / host_capacity if host_capacity > 0 else 0.0,
        )

    def echo_telemetry(self) -> dict[str, list[int] | list[float]]:
        """ECHO's per-layer counters since start (reads the device: call between steps)."""
        c = self.cache
        hits, misses = c.hits.tolist(), c.misses.tolist()
        return {
            "hits": hits,
            "misses": misses,
            "hit_rate": [h / (h + m) if h + m else 1.0 for h, m in zip(hits, misses, strict=True)],
            "evictions": c.evictions.tolist(),
            "resident": [c.num_slots - int(f) for f in c.free_count.tolist()],
        }
