"""What a CUDA-graph runner needs of a KV backend's state around start-up capture: keep it
as it was (``preserved``) and pin the decode-prefetch mode of the steps it captures
(``forced_decode_prefetch``). Backends without such state (the plain pool) need nothing."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from sglang_echo.model.kv_cache import KVCache


@contextmanager
def preserved(kv_cache: KVCache) -> Iterator[None]:
    """The backend's small state (``checkpoint()``) is put back when the block ends."""
    saved = kv_cache.checkpoint()
    try:
        yield
    finally:
        if saved is not None:
            saved.restore()


def forced_decode_prefetch(kv_cache: KVCache, on: bool):
    """Steps inside the block run with the decode prefetch ``on`` where the backend
    chooses per step; elsewhere a no-op."""
    return kv_cache.forced_decode_prefetch(on)
