"""What ECHO changes in sglang's admission: its capacity checks and a staged prompt's warm
start in ECHO's cache.

Why apart from the coordinator: these are set up once (the allocator's two checks are
replaced when the coordinator is built) or run once per admitted request, and each is a
rule about what admission may take, not about a running request's rows.

Imports sglang (through the prefill budget): loaded only with the coordinator.
"""

from __future__ import annotations

from typing import Any

import torch

from sglang_echo.sglang.prefill_budget import EchoPrefillBudget


def patch_decode_capacity(coordinator: Any) -> None:
    """A decode step allocates logical token ids only (its KV goes to the request's
    newest row), so only the logical pool can run short. HiSparse's allocator compares
    min(logical, device) free and would retract requests for lack of device rows,
    which ECHO reserved at start-up. Kept rows of retracted requests give way first
    (``KeptRows.drop_for``): sglang's retract loop calls this check too, so they are
    dropped before any running request is retracted or aborted."""
    allocator = coordinator.token_to_kv_pool_allocator
    logical = allocator.logical_attn_allocator

    def check_decode_capacity(*, num_tokens, tree_cache, requests=None, spec_algorithm=None):
        allocator.evict_to_free_tokens(tree_cache, num_tokens)
        coordinator.kept_rows.drop_for(num_tokens)
        return logical.available_size() >= num_tokens

    allocator.check_decode_capacity = check_decode_capacity


def patch_prefill_budget(allocator: Any) -> None:
    """A non-PD server's prefill admission: logical ids and device rows are separate
    ledgers (EchoPrefillBudget), or running requests' future decode tokens, which
    never take a device row, would starve every new prompt."""

    def create_prefill_budget(tree_cache, *, num_mixed_decode_tokens=0):
        return EchoPrefillBudget(
            allocator, tree_cache, num_mixed_decode_tokens=num_mixed_decode_tokens
        )

    allocator.create_prefill_budget = create_prefill_budget


def warm_share(num_slots: int, request_slots: int) -> int:
    """Prompt rows a staged request brings into ECHO's cache per layer: its fair share of
    the N_G slots over the request slots (slot 0 is sglang's padding request)."""
    slots = max(1, request_slots - 1)
    return min(num_slots, num_slots // slots)


def warm_from_prompt(coordinator: Any, idx: int, logical: torch.Tensor) -> None:
    """``logical``: the ids staging copied to the host (the prompt, ``extend_end``).
    A locally prefilled prompt is on the device (its rows are freed right after
    this) and, staged, on the host: its newest ``warm_tokens`` rows enter ECHO's cache
    in every layer by a device-to-device copy, as the runtime's prefill appends its
    prompt, so the first decode step does not recall a top-k's worth of rows per
    layer that were on the GPU a moment ago. The window is the request's fair share
    of the cache (N_G over the request slots), so one admission does not evict the
    running requests' working sets. Stream order keeps the copy before any reuse of
    the freed rows (their next writer runs after this on the forward stream)."""
    c = coordinator
    n = logical.numel()
    take = min(n, c.warm_tokens)
    if take == 0:
        return
    device_rows = c.mem_pool_device.translate_loc_from_full_to_hisparse_device(
        logical[n - take :].to(torch.int64)
    ).to(torch.int64)
    host_ids = c.req_to_host_pool[idx, n - take : n].to(c.cache.device, torch.int64)
    for layer, buf in enumerate(c.mem_pool_device.kv_buffer):
        rows = buf.view(buf.shape[0], -1).index_select(0, device_rows)
        c.manager.insert(layer, host_ids, rows)
