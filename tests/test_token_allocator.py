"""``TokenSlotAllocator``: what admission and release rely on. A prompt's locations come as
ascending runs (the transfer copies long runs by copy engine: offload/host_extents.py), a
request's freed locations are the next handed out and in the same order, nothing is lost or
handed out twice, and location 0 (the padding sink) never is."""

from __future__ import annotations

from array import array

import pytest

from sglang_echo.offload.host_extents import split_extents
from sglang_echo.runtime.token_table import CapacityError, TokenSlotAllocator


def test_a_fresh_pools_prompt_is_one_ascending_run() -> None:
    alloc = TokenSlotAllocator(1000)
    locs = alloc.alloc(300)
    assert isinstance(locs, array) and locs.typecode == "q"
    assert list(locs) == list(range(locs[0], locs[0] + 300))
    assert len(split_extents(locs, min_tokens=64).runs) == 1


def test_freed_locations_come_back_first_in_their_order() -> None:
    alloc = TokenSlotAllocator(1000)
    first, second = alloc.alloc(200), alloc.alloc(100)
    alloc.free(first)
    again = alloc.alloc(200)
    assert again == first  # the most recently freed, as given: still one run
    alloc.free(list(second))  # a plain list is taken too
    assert alloc.alloc(100) == second


def test_nothing_lost_or_twice_and_never_the_sink() -> None:
    alloc = TokenSlotAllocator(500)
    held = [alloc.alloc(n) for n in (120, 1, 77, 1, 200)]
    alloc.free(held.pop(2))
    held.append(alloc.alloc(101))
    every = [x for locs in held for x in locs]
    assert len(every) == len(set(every)) and 0 not in every
    assert alloc.num_free == 500 - len(every)
    with pytest.raises(CapacityError, match="asked for"):
        alloc.alloc(alloc.num_free + 1)
    rest = alloc.alloc(alloc.num_free)
    assert sorted(every + list(rest)) == list(range(1, 501))
