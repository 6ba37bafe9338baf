"""``--check``'s comparison of a document's blocks with the generator's: every number
that disagrees, every row added, missing or reworded, so a stale document fails loudly and
says where."""

from __future__ import annotations

import re
from pathlib import Path

from .blocks import BLOCKS, begin, blocks_in, end, extract, render

NUMBER = re.compile(r"-?\d+(?:[.,]\d+)*(?:e[-+]?\d+)?")


def _rows(block: str) -> dict[str, str]:
    out = {}
    lines = [ln for ln in block.splitlines() if ln.startswith("| ")]
    for ln in lines[2:]:  # after the header and its rule
        out[ln.split(" | ", 1)[0][2:]] = ln
    return out


def block_differences(text: str, root: Path, name: str = "evidence") -> list[str]:
    """Every way block ``name`` of ``text`` disagrees with the generator (empty: agrees)."""
    block = extract(text, name)
    if block is None:
        return [f"no {name} block (markers {begin(name)!r} ... {end(name)!r})"]
    want = render(root, name)
    if block == want:
        return []
    got_rows, want_rows = _rows(block), _rows(want)
    problems = []
    for key, line in want_rows.items():
        if key not in got_rows:
            problems.append(f"{name} row {key!r}: missing")
            continue
        have, need = NUMBER.findall(got_rows[key]), NUMBER.findall(line)
        bad = [f"{a} (generated: {b})" for a, b in zip(have, need, strict=False) if a != b]
        if len(have) != len(need):
            bad.append(f"{len(have)} numbers in the file, {len(need)} generated")
        if bad:
            problems.append(f"{name} row {key!r}: " + "; ".join(bad))
        elif got_rows[key] != line:
            problems.append(f"{name} row {key!r}: same numbers, different text")
    problems += [f"{name} row {k!r}: not generated" for k in got_rows if k not in want_rows]
    if not problems:
        problems.append(f"the {name} block differs from the generator's outside the rows")
    return problems


def differences(text: str, root: Path, names: list[str] | None = None) -> list[str]:
    """Every disagreement of the blocks ``names`` (default: those ``text`` holds; none at
    all is one)."""
    names = blocks_in(text) if names is None else names
    if not names:
        return [f"no generated block (markers {', '.join(map(begin, BLOCKS))})"]
    return [p for name in names for p in block_differences(text, root, name)]
