"""``python -m benchmark.evidence [--write FILE... | --check FILE...]``: the generated blocks
of README.md and docs/, from the records under ``benchmark/results/`` and the code's checks.

A block sits between ``<!-- NAME:begin ... -->`` and ``<!-- NAME:end -->``; three names:

- ``results`` (README.md): ``RESULTS``, one short table, a row per headline number, each
  read from one field of one record.
- ``evidence`` (docs/EVIDENCE.md): ``EVIDENCE``, every measured claim; a row is a list of
  facts, each a sentence with the values of named fields of a record.
- ``errors`` (docs/ERRORS.md): ``ERRORS``, the messages a user meets for a bad setting,
  each produced by calling the code path that checks it (nothing is copied by hand).

Every block is a table in this package, and every number in it is read from a record by
name: a fact is a sentence whose placeholders name a record's field and its format
(``{metrics.logits_us:us}``: the field ``metrics.logits_us``, in microseconds; FORMATS)
or a value derived from the record (``{@name.field:format}``: DERIVED, for ratios,
ranges, loops over a record's entries, another record's field beside it); a fact that
starts with "?" is left out where its record lacks the field; a row names the record (and
any other it reads, named in its record column). An error row names the check it calls
and that call's arguments (``CHECKS``). Labels: *measured* (timed or
counted on the device the record names), *simulated* (a CPU simulation over measured
traces), *estimate* (a roofline or bound derived from measured numbers, not itself
timed). Published numbers of others (ECHO's figures, DeepSeek-V3.2's hit rates) are not
records: the prose names them as such.

``--write FILE`` replaces every block FILE holds with the generator's; ``--check FILE``
exits 1 and lists every number of a block that disagrees with the generator (and any row
added, missing or reworded), and every measured-looking figure in FILE's prose outside the
blocks (``prose_figures``: times, speedups, bandwidths, percentages, fractions,
approximate or counted quantities, less code, versions and ``ALLOWED_FIGURES``), so the
documents and the records cannot drift apart. tests/repo/test_evidence.py runs both over
README.md and docs/*.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .block_check import differences
from .blocks import BLOCKS, blocks_in, render, write
from .prose import prose_figures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmark.evidence", description=__doc__)
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--write", type=Path, nargs="+", metavar="FILE", help="regenerate the blocks FILE holds"
    )
    g.add_argument(
        "--check",
        type=Path,
        nargs="+",
        metavar="FILE",
        help="exit 1 if a block of FILE differs, or its prose holds a measured figure",
    )
    p.add_argument(
        "--block", choices=sorted(BLOCKS), default="evidence", help="the block printed otherwise"
    )
    p.add_argument("--root", type=Path, default=Path("."), help="repository root (default: cwd)")
    args = p.parse_args(argv)
    if args.check is not None:
        failed = False
        for path in args.check:  # a file without blocks: its prose only
            text = path.read_text()
            problems = differences(text, args.root) if blocks_in(text) else []
            problems += [
                f"a measured figure outside the generated blocks (put it in a row or drop it): {f}"
                for f in prose_figures(text)
            ]
            for line in problems:
                print(f"{path}: {line}", file=sys.stderr)
            if not problems:
                names = ", ".join(blocks_in(text))
                what = f"the {names} block matches the generator" if names else "no block"
                print(f"{path}: {what}; no measured figure in the prose")
            failed |= bool(problems)
        return 1 if failed else 0
    if args.write is not None:
        for path in args.write:
            text = path.read_text()
            if not blocks_in(text):
                print(f"error: no generated block in {path}", file=sys.stderr)
                return 2
            path.write_text(write(text, args.root))
            print(f"wrote the {', '.join(blocks_in(text))} block(s) of {path}")
        return 0
    print(render(args.root, args.block))
    return 0
