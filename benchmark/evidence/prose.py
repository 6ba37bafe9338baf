"""No measured figure outside the generated blocks: ``prose_figures`` finds the
measured-looking figures of a markdown document's prose (times, sizes, speedups,
percentages, decimals, approximate and counted quantities), sparing code, versions and
``ALLOWED_FIGURES``; numbers written by hand drift from the records."""

from __future__ import annotations

import re

_UNITS = (
    r"us|µs|μs|ms|s|sec|seconds?|minutes?|min|hours?|"
    r"GB/s|GiB/s|MB/s|tok/s|tokens/s|TB|GB|GiB|MB|MiB|KB|KiB|B"
)
_NUM = r"~?\d[\d,_]*(?:\.\d+)?"
FIGURE_RULES = {
    "time or size": re.compile(
        rf"(?<![\w.]){_NUM}(?:\s*(?:-|to)\s*{_NUM})?[ -]?(?:{_UNITS})(?![\w/])"
    ),
    "speedup": re.compile(r"(?<![\w.])\d+(?:\.\d+)?[x×](?!\w)"),
    "percentage": re.compile(r"\d+(?:\.\d+)?\s*%"),
    "decimal": re.compile(r"(?<![\w.])\d+\.\d+(?![\w.])"),
    "approximate": re.compile(r"~\s?\d"),
    "count": re.compile(
        r"(?<![\w.])\d[\d,]*(?:\.\d+)?\s+(?:evictions|kernels|registers|instructions|cycles|"
        r"decode steps)\b"
    ),
}
# Version numbers are not figures: a decimal right after these words (or a range's start).
_VERSION = re.compile(
    r"(?:python|cpython|torch|transformers|triton|sglang|flashinfer\S*|>=)\s*(?:\d+\.\d+-)?$",
    re.IGNORECASE,
)
# Design constants and configuration (facts of the code, not measurements), and others'
# published figures, named as such in the text. Matched with any whitespace between words.
ALLOWED_FIGURES = (
    "the e2e scripts use 0.9",  # a knob's value
    "p = 0.9",
    "default 32 MiB",
    "the global batch 8x the local one",  # the paper's deployment: 8 DP ranks
    "656 B",  # the fp8 KV row
    "10-minute device calls",  # the device machine's limit
    "656 B: ~80 GB at T = 2M",  # arithmetic on the row size, not a measurement
    "~16 GB at T = 2M",
    "about 4 B per host token and 16 B per slot",
    "alpha 0.5",
    ">= 7% of",  # the decode-prefetch rule's threshold (offload/prefetch_rule.py), a knob
    "or above 7% the",
    "0.88 on CUDA, 0.25 on the CPU",
    "interval to 0.5 ms",
    "ECHO's published 2.15x / 3.10x / 4.12x",  # published by others
    "0.88-0.99 per layer that ECHO publishes",
    "0.88-0.99 hit rates published",
    "the 1.6x speedup and 1.03 slowdown ECHO publishes",
)
_GENERATED = re.compile(r"<!-- ([\w-]+):begin.*?<!-- \1:end -->", re.DOTALL)
_FENCE = re.compile(r"^[ \t]*```.*?^[ \t]*```[^\n]*$", re.DOTALL | re.MULTILINE)
_CODE = re.compile(r"`[^`\n]*`")


def _blank(text: str, rx: re.Pattern) -> str:
    """``text`` with ``rx``'s matches overwritten by spaces (newlines kept, so positions
    and line numbers stay)."""
    return rx.sub(lambda m: re.sub(r"[^\n]", " ", m.group()), text)


def prose_figures(text: str) -> list[str]:
    """Measured-looking figures in a markdown document's prose: outside its generated
    blocks (``<!-- NAME:begin ... <!-- NAME:end -->``), fenced and inline code, version
    numbers and ``ALLOWED_FIGURES``. Each as ``line N: 'figure' (rule): context``."""
    prose = text
    for rx in (_GENERATED, _FENCE, _CODE):
        prose = _blank(prose, rx)
    allowed = [
        m.span()
        for phrase in ALLOWED_FIGURES
        for m in re.finditer(r"\s+".join(map(re.escape, phrase.split())), prose)
    ]
    found = []
    for rule, rx in FIGURE_RULES.items():
        for m in rx.finditer(prose):
            if any(a <= m.start() and m.end() <= b for a, b in allowed):
                continue
            if rule == "decimal" and _VERSION.search(prose[max(0, m.start() - 40) : m.start()]):
                continue
            line = text.count("\n", 0, m.start()) + 1
            context = " ".join(text[max(0, m.start() - 40) : m.end() + 20].split())
            found.append((line, m.start(), f"line {line}: {m.group()!r} ({rule}): ...{context}..."))
    return [f for _, _, f in sorted(found)]
