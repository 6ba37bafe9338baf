"""Prefill admission on a non-disaggregated ECHO server: two ledgers, not one.

sglang's PrefillBudget charges everything against the allocator's ``available_size()``,
which for HiSparse is min(logical ids, device rows), and it adds every running request's
future decode tokens to that charge. Under ECHO the device rows are few by design (the
plan keeps one longest prompt's worth beside the ECHO cache and the newest pages), and a
decode token never takes a device row (it is written into its request's newest page, then
backed up to the host). So with ``cap`` requests running their future tokens alone exceed
the free rows, and no prompt is ever admitted again until they finish: starvation.

EchoPrefillBudget keeps sglang's ledger for what consumes logical ids and host slots
(prompts, their new tokens, the running requests' future tokens) against the logical
pool, and a second ledger for what holds device rows (the prompts being prefilled, until
their KV is on the host) against the free device rows.
"""

from __future__ import annotations

from typing import Any

from sglang.srt.mem_cache.prefill_budget import PrefillBudget


class EchoPrefillBudget(PrefillBudget):
    def __init__(self, allocator: Any, tree_cache: Any, *, num_mixed_decode_tokens: int = 0):
        super().__init__(allocator, tree_cache, num_mixed_decode_tokens=num_mixed_decode_tokens)
        self.logical = allocator.logical_attn_allocator
        self.device = allocator.hisparse_attn_allocator
        self.device_offset = 0  # device rows promised to prompts admitted in this pass

    # ------------------------------------------------------ logical ids / host
    def _available_and_evictable(self) -> int:
        return self.logical.available_size() + self.tree_cache.evictable_size()

    # ------------------------------------------------------------ device rows
    @property
    def remaining_device(self) -> int:
        return self.device.available_size() - self.device_offset

    def _prompt_rows(self, extend_input_len: int) -> int:
        return self.ceil_paged_tokens(extend_input_len) + self.page_size

    def has_capacity(self) -> bool:
        return super().has_capacity() and self.remaining_device > self.page_size

    def check_prefill(
        self,
        *,
        extend_input_len: int,
        total_tokens: int,
        max_new_tokens: int,
        input_tokens: int,
        swa_host_hit_length: int,
        chunk_limit: int | None,
        auxiliary_swa_host_hit_length: int = 0,
    ) -> tuple[bool, int | None]:
        """Logical ids for the prompt and its new tokens; device rows for the prompt (or
        for the chunk that fits, when chunked prefill is on)."""
        if total_tokens >= self.remaining_total:
            return False, None
        if self._prompt_rows(extend_input_len) <= self.remaining_device:
            return True, chunk_limit
        if chunk_limit is None:
            return False, None
        rows = (self.remaining_device - self.page_size) // self.page_size * self.page_size
        return (True, min(chunk_limit, rows)) if rows > 0 else (False, None)

    def can_allocate_prefill(
        self,
        *,
        paged_input: int,
        extend_input_len: int,
        max_new_tokens: int,
        chunk_limit: int | None,
    ) -> bool:
        return (
            paged_input <= min(self.remaining_current, self.remaining_total)
            and paged_input <= self.remaining_device
        )

    def available_chunk_tokens(self, chunk_limit: int) -> int | None:
        rows = (self.remaining_device - self.page_size) // self.page_size * self.page_size
        available = min(chunk_limit, int(self.remaining_total), rows)
        return available if available > 0 else chunk_limit

    def reserve(
        self,
        extend_input_len: int,
        max_new_tokens: int,
        *,
        extra_tokens: int = 0,
        chunk_limit: int | None = None,
        is_chunked_continuation: bool = False,
    ) -> None:
        super().reserve(
            extend_input_len,
            max_new_tokens,
            extra_tokens=extra_tokens,
            chunk_limit=chunk_limit,
            is_chunked_continuation=is_chunked_continuation,
        )
        self.device_offset += self._prompt_rows(extend_input_len)
