"""A retracted PD request's host ids, kept for its resume: the coordinator's side of
retraction (sglang's side, the hooks, is retraction.py).

Why the coordinator keeps them: on a HiSparse decode node the request's whole KV is
already in the pinned host pool, so a retraction loses nothing but its newest page if
the host ids stay allocated (and mapped in ECHO's cache, whose rows stay right) until
sglang resumes the request. Holding them takes host room the plugin's logical-pool
capacity check would not see, so each kept row holds as many logical ids from the
retraction until resume, and under decode memory pressure kept rows are dropped, newest
first, before sglang retracts or aborts a running request (their request ends with one
503). A row is released once: dropped, discarded or resumed, never twice.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from sglang_echo.kernels.topk_rows import RING

logger = logging.getLogger(__name__)

# The KeptRows inside a retraction scope (sglang's release_req), innermost last.
SCOPES: list[KeptRows] = []


@dataclass
class KeptHostIds:
    """A retracted request's host-id row, kept allocated for its resume."""

    owner: KeptRows  # the coordinator's KeptRows that kept it
    row: torch.Tensor  # host ids over the allocated pages, -1 where none
    allocated: int  # req_to_host_pool_allocated_len of the row
    tokens: int  # tokens whose KV the row holds (sglang's fill length at resume)
    installed: bool = field(default=False)  # put back into a request slot's row
    rid: str = ""  # the retracted request's id (log lines)
    # Logical ids held for the kept host ids from the retraction until resume (None:
    # none held), so that logical free <= host free still holds.
    logical: torch.Tensor | None = None
    released: bool = False  # host and logical ids given back (discarded or dropped)
    dropped: bool = False  # released under decode memory pressure: the request gets a 503

    @property
    def host_ids(self) -> int:
        """How many host ids the row holds (allocated by page: a page multiple)."""
        return int((self.row >= 0).sum())


class KeptRows:
    """One coordinator's kept rows: ``unclaimed`` (kept by a retraction, not yet claimed
    by sglang's backup: released when the scope closes) and ``live`` (claimed, until
    resume or release, oldest first, keyed by id(kept))."""

    def __init__(self, coordinator: Any) -> None:
        self.c = coordinator
        self.unclaimed: dict[int, KeptHostIds] = {}
        self.live: dict[int, KeptHostIds] = {}

    @property
    def empty(self) -> bool:
        return not self.unclaimed and not self.live

    @contextmanager
    def scope(self) -> Iterator[None]:
        """sglang's release_req (retraction.py): inside it, a PD request's retraction
        keeps its host ids for sglang's backup to claim; the ones not claimed are released
        when the outermost scope closes."""
        SCOPES.append(self)
        try:
            yield
        finally:
            SCOPES.remove(self)
            if self not in SCOPES:
                unclaimed, self.unclaimed = list(self.unclaimed.values()), {}
                for kept in unclaimed:
                    self.discard(kept)
                self.hold_logical_ids()

    def hold_logical_ids(self) -> None:
        """sglang's release_kv_cache (inside the scope) has freed the retracted requests'
        logical ids, while their host ids stay kept: hold as many logical ids as each kept
        row has host ids, so logical free <= host free holds again. The release freed at
        least that many (a request holds no fewer logical ids than host ids), so this does
        not fail; if it ever did, the row is dropped (503) rather than break the check."""
        logical = self.c.token_to_kv_pool_allocator.logical_attn_allocator
        for kept in [k for k in self.live.values() if k.logical is None and not k.installed]:
            n = kept.host_ids
            ids = logical.alloc(n) if n else torch.empty(0, dtype=torch.int64, device=self.c.device)
            if ids is None:
                logger.warning(
                    "sglang-echo: no %d logical ids to hold for retracted request %s; its "
                    "kept KV is released",
                    n,
                    kept.rid,
                )
                self.drop(kept)
                continue
            kept.logical = ids

    def keep(self, req) -> KeptHostIds:
        """The request's host-id row, holding every token sglang restores at resume (its
        prompt and outputs but the last, whose KV the resumed step computes): the newest
        row's token is backed up first if the host pool lacks it (the host waits: the
        page is freed right after). The ids stay allocated and mapped in ECHO's cache."""
        from sglang.srt.disaggregation.decode import DecodePreallocQueue

        idx = req.kv.req_pool_idx
        tokens = DecodePreallocQueue._pre_alloc_fill_len(req)
        self._back_up_missing_token(req, tokens)
        self.c.releases.end_decode_state(req)
        row = self.c.releases.host_id_row(idx)
        kept = KeptHostIds(
            self,
            row if row is not None else torch.empty(0, dtype=torch.int64),
            int(self.c.req_to_host_pool_allocated_len[idx]),
            tokens,
        )
        self.c.releases.clear_host_row(idx)
        return kept

    def _back_up_missing_token(self, req, tokens: int) -> None:
        """The host pool holds the first ``tokens - 1`` of the request's tokens when its
        last step's results were processed (its newest row holds the last one), or all of
        them when the retraction comes while that step is in flight (its backup was
        issued when the step was prepared): in the first case copy the newest row now."""
        idx = req.kv.req_pool_idx
        held = self.c.backup.host_len.get(idx, 0)
        if held < tokens:
            page = self.c.newest_page.get(idx)
            if held != tokens - 1 or page is None or self.c._skip_first_backup[idx]:
                raise RuntimeError(
                    f"sglang-echo: retracting request {req.rid!r}: the host pool holds "
                    f"{held} of its {tokens} tokens and its newest row cannot supply the "
                    "rest; the coordinator's bookkeeping is wrong"
                )
            newest = self.c.ring_rows[idx : idx + 1, (tokens - 1) % RING].clone()
            # On the backup stream, after the in-flight forward.
            self.c.backup.copy(newest, self.c.backup.host_slot(idx, tokens - 1))
            self.c.backup.finish_on_host()

    def claim(self, req) -> KeptHostIds | None:
        """The host ids this coordinator's retraction of ``req`` kept (sglang's backup),
        registered as live until resume or release."""
        kept = self.unclaimed.pop(id(req), None)
        if kept is not None:
            kept.rid = req.rid
            self.live[id(kept)] = kept
        return kept

    @contextmanager
    def installing(self, kept: KeptHostIds) -> Iterator[None]:
        """sglang's resume (_pre_alloc) allocates the request slot, then host slots for the
        tokens it restores from position 0: that allocation is given the kept row first,
        so it allocates nothing. The logical ids the row held are freed first: sglang
        allocates the request's fill anew right after (credited in its resume budget)."""
        self.free_held_logical(kept)
        host = self.c.mem_pool_host
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

    def resume(self, req, kept: KeptHostIds) -> None:
        """sglang's restore of a resumed request: its row holds the kept host ids (its KV
        in the host pool, the tokens still cached in ECHO's cache where they were); admit
        it directly, as a PD arrival."""
        self.live.pop(id(kept), None)
        idx = req.kv.req_pool_idx
        n = kept.row.numel()
        row = self.c.req_to_host_pool[idx, :n].to(kept.row.device)
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
        self.c.admit_request_direct(req)

    def discard(self, kept: KeptHostIds) -> None:
        """Kept host ids of a request that will not resume: released like a finish's,
        with the logical ids held for them. Once only: a row already released (dropped
        under pressure, then aborted or discarded by sglang) frees nothing twice."""
        if kept.released:
            return
        kept.released = True
        self.live.pop(id(kept), None)
        self.free_held_logical(kept)
        if kept.row.numel():
            self.c.releases.finished_rows.append(kept.row)
        if self.c.releases.depth == 0:
            self.c.releases.release_finished()

    def free_held_logical(self, kept: KeptHostIds) -> None:
        if kept.logical is not None and kept.logical.numel():
            self.c.token_to_kv_pool_allocator.logical_attn_allocator.free(kept.logical)
        kept.logical = None

    def drop_for(self, num_tokens: int) -> None:
        """A decode step needs ``num_tokens`` logical ids: drop kept rows, newest first,
        until they fit or none is left. A kept row frees nothing by retracting more
        requests (it holds its ids), so without this sglang would retract every running
        request and abort the last with a 500. The newest go first: the head of the
        retracted queue resumes first."""
        logical = self.c.token_to_kv_pool_allocator.logical_attn_allocator
        while self.live and logical.available_size() < num_tokens:
            self.drop(self.live[next(reversed(self.live))])

    def drop(self, kept: KeptHostIds) -> None:
        """Release a kept row under memory pressure: its request ends with a 503 when the
        prealloc queue next looks at its retracted requests (retraction.abort_dropped)."""
        logger.warning(
            "sglang-echo: decode memory pressure: releasing the kept KV of retracted "
            "request %s (%d host tokens); it ends with 503",
            kept.rid,
            kept.host_ids,
        )
        kept.dropped = True
        self.discard(kept)
        self.c.releases.release_finished()  # its host ids free now, with its logical ids
