"""The lossless checks: greedy outputs of engines that ran the same seeds at the same
batch must agree token for token (ECHO and the HiSparse-like backend are lossless). The
rules: every request both engines hold, in admission order, each over at least
``MIN_TOKENS_COMPARED`` tokens in common (the smoke run, which decodes 6, compares what it
decodes), equal over their common length."""

from __future__ import annotations

from benchmark.e2e.runs import find, find_all

# The lossless checks compare every request of a batch, each over at least this many greedy
# tokens (the GPU study decodes 1 + --warmup + --steps = 41 per request); the smoke run,
# which decodes 6, compares what it decodes.
MIN_TOKENS_COMPARED = 32


def min_tokens_compared(warmup: int, steps: int) -> int:
    """Tokens each compared request must have: 32, or all a run decodes (1 + warmup +
    steps) when that is fewer (parse_args holds the GPU study to 32)."""
    return min(MIN_TOKENS_COMPARED, 1 + warmup + steps)


def first_difference(a: list[list[int]], b: list[list[int]]) -> list[int] | None:
    """[request, token] of the first greedy token where two runs' outputs differ (None:
    none in their common length), to tell a near tie at one token from a broken cache."""
    for req, (x, y) in enumerate(zip(a, b, strict=False)):
        for tok, (u, v) in enumerate(zip(x, y, strict=False)):
            if u != v:
                return [req, tok]
    return None


def outputs_agree(
    a: list[list[int]], b: list[list[int]], min_tokens: int = MIN_TOKENS_COMPARED
) -> bool:
    """Same requests (every request both runs held, in admission order), each with at least
    ``min_tokens`` tokens in common, equal over their common length. A profiled run decodes
    its profiler's steps on top of the measured ones (the b1 low-load phase's first run: 44
    tokens against its repeats' 41), so a longer output whose common part matches is
    agreement; a request with fewer than ``min_tokens`` tokens to compare is not (one
    token proves little)."""
    return (
        len(a) == len(b) > 0
        and all(min(len(x), len(y)) >= min_tokens for x, y in zip(a, b, strict=True))
        and first_difference(a, b) is None
    )


def tokens_in_common(a: list[list[int]], b: list[list[int]]) -> int:
    """Tokens two runs' outputs share positions for (what ``outputs_agree`` compared)."""
    return sum(min(len(x), len(y)) for x, y in zip(a, b, strict=False))


def low_load_agreement(
    runs: list[dict], batches: list[int], min_compared: int
) -> tuple[dict, dict, dict]:
    """Without pressure, at each batch: whether every repeat of ECHO (echo_paper, and
    echo_inline where it ran) and of the plain pool (noff_low) agrees with the plain pool's
    first run, the first difference found, and the fewest tokens any of them compared."""
    lossless, low_diff, low_tokens = {}, {}, {}
    for b in batches:
        es, ns = find_all(runs, "echo_paper", f"b{b}"), find_all(runs, "noff_low", f"b{b}")
        es = es + find_all(runs, "echo_inline", f"b{b}")
        if es and ns:
            ref = ns[0]["outputs"]
            lossless[b] = all(outputs_agree(r["outputs"], ref, min_compared) for r in es + ns)
            diffs = (first_difference(r["outputs"], ref) for r in es + ns)
            low_diff[b] = next((d for d in diffs if d is not None), None)
            low_tokens[b] = min(tokens_in_common(r["outputs"], ref) for r in es + ns)
    return lossless, low_diff, low_tokens


def lossless_check(
    runs: list[dict], engine: str, pressure_batch: int, min_compared: int
) -> dict | None:
    """``engine``'s greedy outputs at the pressure batch against the plain pool's
    (noff_low, same batch and seeds), with its eviction count."""
    e = find(runs, engine, f"b{pressure_batch}")
    n = find(runs, "noff_low", f"b{pressure_batch}")
    if not (e and n):
        return None
    return {
        "batch": e["batch"],
        "dev_cache": e["dev_cache"],
        "evictions_per_step": e["evictions_per_step"],
        "hit_rate_per_layer": e["hit_rate_per_layer"],
        "requests_compared": len(n["outputs"]),
        "min_tokens_per_request": min_compared,
        "tokens_compared": tokens_in_common(e["outputs"], n["outputs"]),
        "greedy_outputs_equal": outputs_agree(e["outputs"], n["outputs"], min_compared),
        "first_difference": first_difference(e["outputs"], n["outputs"]),
    }
