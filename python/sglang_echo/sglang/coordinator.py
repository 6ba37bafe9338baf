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
- one 64-row page per running request, its ring: the token at position p (decoded since
  the request entered decode) in row p % 64, backed up to the host at the next step and
  read in place by the resolve until token p + 64 overwrites it;
- in a non-disaggregated server, the prompt rows of requests being prefilled (freed when
  the request is admitted to decode).

Finished requests release their host ids from ECHO's cache together: sglang processes a
step's results (``SchedulerBatchResultProcessor.process_batch_result_*``) inside a scope
the coordinator opens (step_release.py: an AROUND hook registered when the first
coordinator is built), and the host ids of every request finished in it are unmapped from
every layer in one ``EchoManager.release`` when it closes, then given back to the host
pool. Finishes outside a step's processing (aborts, retraction, transfer failures)
release at once.

Imports sglang: loaded only by ``sglang_echo.sglang.install`` when ``NSA_KV_OFFLOAD=1``.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager

import sglang.srt.managers.hisparse_coordinator as hisparse
import torch

from sglang_echo.config import ConfigError, decode_prefetch_mode, settings
from sglang_echo.kernels.topk_rows import RING
from sglang_echo.offload.manager import EchoManager
from sglang_echo.sglang import retraction
from sglang_echo.sglang.admission import (
    patch_decode_capacity,
    patch_prefill_budget,
    warm_from_prompt,
    warm_share,
)
from sglang_echo.sglang.args import ECHO_EXTRA_KEY
from sglang_echo.sglang.decode_prefetch import install_decode_prefetch, uninstall_decode_prefetch
from sglang_echo.sglang.guards import capacity_problems, decode_graphs_enabled, graph_problem
from sglang_echo.sglang.host_release import HostRelease
from sglang_echo.sglang.kept_rows import SCOPES, KeptRows
from sglang_echo.sglang.newest_backup import NewestRowBackup
from sglang_echo.sglang.observe import install_metrics_hook, startup_line
from sglang_echo.sglang.pool_layout import (
    drop_per_request_buffers,
    match_logical_to_host,
    reserve_device_rows,
    reserve_host_pages,
    use_torch_transfers,
)
from sglang_echo.sglang.retraction import install_retraction
from sglang_echo.sglang.step_release import install_step_release
from sglang_echo.sglang.storage import (
    ExternalHostRows,
    ExternalRowsCache,
    device_layer_rows,
    host_layer_rows,
)
from sglang_echo.sglang.topk_resolve import TopkToRows

logger = logging.getLogger(__name__)


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


class EchoCoordinator(hisparse.HiSparseCoordinator):
    """sglang's hooks over ECHO's cache; the jobs behind them are collaborators':
    ``backup`` (newest_backup.py: the rings' host backups), ``releases``
    (host_release.py: finished requests' host ids, once per step), ``kept_rows``
    (kept_rows.py: retracted PD requests' host ids), admission.py (sglang's capacity
    checks, a staged prompt's warm start) and pool_layout.py (the start-up reservations)."""

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
            use_torch_transfers(self)
        drop_per_request_buffers(self)
        plan = echo_settings()
        self.num_slots = int(plan[ECHO_EXTRA_KEY])
        self.reserved_host_ids = reserve_host_pages(self.mem_pool_host)
        self.reserved_logical_ids = match_logical_to_host(
            self.token_to_kv_pool_allocator.logical_attn_allocator,
            self.mem_pool_host,
            self.page_size,
            self.device,
        )
        problems = capacity_problems(
            plan,
            device_rows=self.mem_pool_device.size,
            host_tokens=self.mem_pool_host.available_size(),
        )
        if problems:
            raise ConfigError("\n".join(problems))
        self.reserved_device_rows, self.row_base = reserve_device_rows(
            self.token_to_kv_pool_allocator.hisparse_attn_allocator, self.num_slots, self.page_size
        )

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
        self.manager = EchoManager(self.host_rows, self.cache, pdl=settings().pdl)
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
        self.newest_page: dict[int, torch.Tensor] = {}  # each running request's ring page
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
        # Prompt rows a staged request brings into ECHO's cache per layer (its share).
        self.warm_tokens = warm_share(self.num_slots, max_reqs)
        # Collaborators, one job each: the rings' host backups, the release of finished
        # requests' host ids, and retracted PD requests' kept host ids.
        self.backup = NewestRowBackup(self)
        self.releases = HostRelease(self)
        self.kept_rows = KeptRows(self)
        install_step_release(EchoCoordinator)
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
        patch_decode_capacity(self)
        patch_prefill_budget(self.token_to_kv_pool_allocator)
        # Counter values last sent to sglang's exporter (observe.publish_metrics).
        self._metrics_sent: dict[str, float] = {}
        install_metrics_hook(EchoCoordinator)
        logger.info(startup_line(self, "on" if self.decode_prefetch is not None else "off"))

    # ------------------------------------------------------------- admission
    def alloc_device_buffer(self, req) -> None:
        """Admission to decode (PD direct or after staging): the request's prompt rows,
        if any, are freed, and it gets one page, its ring, where the tokens it decodes
        from its current length on are written.
        A staged request's (local prefill) newest prompt rows go into ECHO's cache first,
        copied on the device (``admission.warm_from_prompt``)."""
        idx = req.kv.req_pool_idx
        logical = self.req_to_token_pool.req_to_token[idx, : req.kv.kv_allocated_len]
        if getattr(req, "hisparse_staging", False):
            warm_from_prompt(self, idx, logical[: req.extend_end])
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
        self.newest_page[idx] = page
        self.ring_rows[idx] = page
        self.ring_start[idx] = req.kv.kv_allocated_len
        if self.decode_prefetch is not None:
            self.decode_prefetch.reset_row(idx)

    def admit_request_direct(self, req) -> None:
        """PD decode: the prompt's KV is already in the host pool (RDMA); no preload,
        ECHO recalls what the indexer selects."""
        self.alloc_device_buffer(req)
        req.hisparse_staging = False
        idx = req.kv.req_pool_idx
        self._skip_first_backup[idx] = True
        self.backup.host_len[idx] = self.host_token_len(req.kv.kv_allocated_len)

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
        self.backup.previous_tokens(seq_lens, req_pool_indices, seq_lens_cpu, req_pool_indices_cpu)
        mapping = self.mem_pool_device.full_to_hisparse_device_index_mapping
        mapping[out_cache_loc] = self.ring_row_of(req_pool_indices, seq_lens - 1)

    def ring_row_of(self, req_pool_indices: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The device row of each request's token at ``positions`` in its ring."""
        return self.ring_rows[req_pool_indices, positions.remainder(RING)]

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
    def one_release_per_step(self) -> AbstractContextManager[None]:
        """sglang's processing of one step's results (step_release.py): the requests it
        finishes release their host ids together when it closes (HostRelease.per_step)."""
        return self.releases.per_step()

    def request_finished(self, req) -> None:
        """Finish, abort or retract: HostRelease.finish (newest page freed now, host ids
        released with the step's other finishes)."""
        self.releases.finish(req)

    # ------------------------------------------------------------- retraction
    def retract_req(self, req) -> None:
        """A retraction inside sglang's release_req of a request admitted directly (PD
        decode: its KV is in the host pool) keeps its host ids; any other retraction
        releases like a finish (HiSparse's behaviour)."""
        direct = req.kv.req_pool_idx in self.backup.host_len
        keeps = retraction.ENABLED and self.kept_rows in SCOPES and direct
        if not keeps or getattr(req, "hisparse_staging", False):
            super().retract_req(req)
            return
        self.kept_rows.unclaimed[id(req)] = self.kept_rows.keep(req)

    def abort_staging_request(self, req) -> None:
        self.releases.release_now(req.kv.req_pool_idx)
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
