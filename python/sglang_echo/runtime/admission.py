"""How many token locations a request may still take: the one admission rule of the
scheduling core (runtime/scheduler.py), also used by the e2e study's decode node.

A request holds at most ``prompt + max_new_tokens - 1`` token locations (its last token is
never cached). Beyond the tokens it has cached and the prefill still pending, that leaves
``max_new_tokens - outputs`` once it has an output to extend, one fewer before. Admission
sets this aside for every running request (capped by the scheduler's ``reserve_steps``; a
PD decode node and the offline engine reserve it whole, so they never preempt).
"""

from __future__ import annotations

from sglang_echo.runtime.request import SeqState


def token_budget(prompt_len: int, max_new_tokens: int) -> int:
    """Token locations a request can ever occupy."""
    return prompt_len + max_new_tokens - 1


def future_tokens(req: SeqState, max_new_tokens: int) -> int:
    """Token locations ``req`` may still take beyond its cached tokens and pending prefill."""
    held = max(req.cached_len, len(req.prefill_ids))
    return max(0, token_budget(len(req.prompt), max_new_tokens) - held)


def fits(free: int, held_back: int, need: int) -> bool:
    """Whether ``need`` more locations fit after ``held_back`` are set aside for others."""
    return free - held_back >= need
