"""The number formats of the facts: one rule per kind of number (microseconds, ratios,
token counts, ...), by the name a placeholder gives after its colon (``{metrics.x:us}``).
One rule per kind keeps every figure of a kind written the same way in every document."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def us(x: float) -> str:
    """Microseconds: whole above 100, one decimal below."""
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}"


def ms(x: float) -> str:
    return f"{x:.2f}"


def ratio(x: float) -> str:
    return f"{x:.2f}x"


def f2(x: float) -> str:
    return f"{x:.2f}"


def f3(x: float) -> str:
    return f"{x:.3f}"


def count(x: float | str) -> str:
    return f"{float(x):,.0f}"


def yes(flag: bool) -> str:
    return "yes" if flag else "NO"


def tokens(x: float) -> str:
    """A token count as the documents write pool sizes: 200K, 1.8M; else exact."""
    if x >= 1_000_000 and x % 100_000 == 0:
        return f"{x / 1e6:g}M"
    if x >= 1000 and x % 1000 == 0:
        return f"{x / 1e3:g}K"
    return count(x)


def span(values, fmt: Callable[[Any], str]) -> str:
    """min-max of ``values`` (one value if they agree at this precision)."""
    values = list(values)
    lo, hi = fmt(min(values)), fmt(max(values))
    return lo if lo == hi else f"{lo}-{hi}"


def slashed(values, fmt: Callable[[Any], str]) -> str:
    return "/".join(fmt(v) for v in values)


# By name, for facts; a name followed by "-" writes a list (or a dict's values) as its
# range, followed by "/" as a/b/c (a dict's values in key order).
FORMATS: dict[str, Callable[[Any], str]] = {
    "": str,
    "us": us,
    "ms": ms,
    "x": ratio,
    "f0": lambda v: f"{v:.0f}",
    "f1": lambda v: f"{v:.1f}",
    "f2": f2,
    "f3": f3,
    "g": lambda v: f"{v:g}",
    "sci": lambda v: f"{v:.1e}",
    "n": count,
    "tok": tokens,
    "yes": yes,
    "M": lambda v: f"{v / 1e6:.1f}M",  # millions, one decimal
    "MB": lambda v: f"{v / 1e6:.0f} MB",
    "keys": lambda v: "/".join(sorted(v)),  # a dict's keys, a/b/c
}


def formatter(name: str) -> Callable[[Any], str]:
    if name[-1:] == "-":
        one = FORMATS[name[:-1]]
        return lambda v: span(v.values() if isinstance(v, dict) else v, one)
    if name[-1:] == "/":
        one = FORMATS[name[:-1]]
        return lambda v: slashed([v[k] for k in sorted(v)] if isinstance(v, dict) else v, one)
    return FORMATS[name]
