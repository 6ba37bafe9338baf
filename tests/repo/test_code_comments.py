"""Code comments say why, records say how much (issue 51, item 5): the comments and
docstrings of ``python/sglang_echo`` name no commit and hold no measured figure.

A comment that needs a number points at the record that holds it: an evidence row of
docs/EVIDENCE.md by its name, a ``benchmark/results/<file>.json`` and its field, or the
docs/ARCHITECTURE.md section that tells the history (which commit's run decided what,
section 15 "Measured choices"; the docs may name commits). Numbers written by hand into
code drifted from the records as the code changed, as README's did.

What is scanned, per file of the package:

- comments (``tokenize``; consecutive comment lines are read as one text, so a figure or
  an allowed phrase may wrap) and docstrings (``ast``: every string that is a statement of
  its own: module, class and function docstrings and bare strings), for
  (a) a commit id: a word of 7 to 40 lowercase hex digits with at least one digit and
  one letter a-f (``8c90ac6``, ``history/2026-12-02-topk-peer-3e33bfb/``); hex constants
  (``0x7f``), dates, dtype names and plain numbers are not, and
  (b) a measured figure, as README's and docs' prose is scanned for one
  (``benchmark.evidence.prose_figures``: times, sizes, bandwidths, speedups,
  percentages, decimals, approximate and counted quantities, less inline code, versions
  and ``evidence.ALLOWED_FIGURES``), less ``CODE_CONSTANTS`` below: the format constants
  a kernel's comment names;
- every other string literal (messages to users, help texts: not comments; their numbers
  are settings and thresholds) for (a) only.
"""

from __future__ import annotations

import ast
import io
import re
import textwrap
import tokenize
from pathlib import Path

import pytest

from benchmark import evidence

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "python" / "sglang_echo"

# A word of 7-40 lowercase hex digits, at least one a digit and one a letter.
COMMIT_ID = re.compile(
    r"(?<![0-9A-Za-z])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![0-9A-Za-z])"
)
# Design constants of the code that read like figures to the prose rule, on top of
# evidence.ALLOWED_FIGURES (which already spares "656 B", "alpha 0.5", ...).
CODE_CONSTANTS = (
    # Row and field sizes that define formats: the bf16 and fp8 MLA rows, the padded and
    # SGLang's packed fp8 index keys, a 16-byte vector, an int32 map entry, an fp8 value.
    re.compile(r"(?<![\w.])(?:1152|656|144|132|16|4|1) B\b"),
    # Zero, and IEEE's signed zeros (-0.0 folded into +0.0): never a measurement.
    re.compile(r"(?<![\w.])[-+]?0\.0(?![\d.])"),
)
_LINE = re.compile(r"line (\d+): (.*)", re.DOTALL)


def _comments(source: str) -> list[tuple[int, str]]:
    """(first line, text) of each run of comments on consecutive lines."""
    runs: list[tuple[int, list[str]]] = []
    last = -1
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        line = tok.start[0]
        if runs and line == last + 1:
            runs[-1][1].append(tok.string[1:])
        else:
            runs.append((line, [tok.string[1:]]))
        last = line
    return [(line, "\n".join(texts)) for line, texts in runs]


def _strings(tree: ast.AST) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(line, text) of the docstrings (every string statement) and of the other strings."""
    docs, others, doc_ids = [], [], set()
    for node in ast.walk(tree):
        value = node.value if isinstance(node, ast.Expr) else None
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            doc_ids.add(id(value))
            docs.append((value.lineno, value.value))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in doc_ids
        ):
            others.append((node.lineno, node.value))
    return docs, others


def _commit_ids(line: int, text: str) -> list[tuple[int, str]]:
    found = []
    for m in COMMIT_ID.finditer(text):
        context = " ".join(text[max(0, m.start() - 40) : m.end() + 20].split())
        found.append(
            (line + text.count("\n", 0, m.start()), f"commit id {m.group()!r}: ...{context}...")
        )
    return found


def _figures(line: int, text: str) -> list[tuple[int, str]]:
    for rx in CODE_CONSTANTS:  # blanked as the prose rule blanks code: positions kept
        text = evidence._blank(text, rx)
    found = []
    for f in evidence.prose_figures(text):
        m = _LINE.fullmatch(f)
        assert m, f"benchmark.evidence.prose_figures changed its format: {f!r}"
        found.append((line + int(m.group(1)) - 1, f"measured figure {m.group(2)}"))
    return found


def scan(source: str, name: str = "<source>") -> list[str]:
    """Every commit id and measured figure in ``source``'s comments and docstrings, and
    every commit id in its other strings, as ``name:line: what``."""
    docs, others = _strings(ast.parse(source))
    found = []
    for line, text in _comments(source) + docs:
        found += _commit_ids(line, text) + _figures(line, text)
    for line, text in others:
        found += _commit_ids(line, text)
    return [f"{name}:{line}: {what}" for line, what in sorted(found)]


FILES = sorted(PACKAGE.rglob("*.py"))


def test_package_found():
    assert len(FILES) > 50 and (PACKAGE / "config.py") in FILES


def test_comments_name_no_commit_and_hold_no_measured_figure():
    found = [f for path in FILES for f in scan(path.read_text(), path.relative_to(ROOT).as_posix())]
    assert found == [], (
        "comments and docstrings say why; the records say how much. Rephrase without the "
        "figure or the commit, and point at the record: an evidence row of docs/EVIDENCE.md "
        "by name, a benchmark/results/<file>.json, or docs/ARCHITECTURE.md (its section 15, "
        '"Measured choices", names the commits and records; a format constant goes in '
        "CODE_CONSTANTS here):\n" + "\n".join(found)
    )


# ------------------------------------------------------------------ the scanner itself
@pytest.mark.parametrize(
    "source",
    [
        "X = 1  # with the candidate split, 122.8 us at 48 x 100K\n",
        "X = 1  # 512 lanes x 16 warps was the fastest, 1.2 / 1.2 / 2.6 us below\n",
        "# the one program took 4.7 / 7.9 us\n# at batch 1 / 2\nX = 1\n",
        "# moved 98,304 random rows at\n# 44.0 GB/s\nX = 1\n",
        "X = 1  # on an H200 it saved 2% at 48 rows\n",
        "X = 1  # tails: 1.12x / 1.02x / 0.93x at hit 0.5 / 0.9 / 0.97\n",
        "X = 1  # the decode phase waited ~5 ms a step\n",
        "X = 1  # a release used to cost ~730 launches\n",
        "X = 1  # 2 stages (221 KB of shared memory), rows of 1153 B\n",
        "X = 1  # 0.5 ms bounds that wait; hit 0.0 to 0.25\n",
        'def f():\n    """The finish took 55 us at 48 x 2048."""\n',
        '"""Module.\n\nFaster from hit rate 0.9 down."""\n',
        'class C:\n    X = 1\n    """It took 52 us at one row."""\n',
        "X = 1  # (code of 94b997e)\n",
        "X = 1  # see history/2026-12-02-topk-peer-3e33bfb/\n",
        "X = 1  # gpu_checks_logs/8c90ac6/cache_bench.log\n",
        "X = 1  # commit 3e33bfb0c1d2e3f4a5b6c7d8e9f0a1b2c3d4e5f6\n",
        '"""Why: see c8968ca."""\n',
        'raise ValueError("fixed in 8c90ac6")\n',
        'X = f"{1} as of 736295d"\n',
    ],
)
def test_scan_flags(source):
    assert scan(source), source


@pytest.mark.parametrize(
    "source",
    [
        "K = 2048  # top-k 2048 over 64-token pages, 128 x 128 blocks, batch 16 x 128K\n",
        "R = 656  # the fp8 row is 656 B, bf16 1152 B; index keys 132 B padded to 144 B\n",
        "V = 16  # loads and stores are 16 B wide; + 4 B of map per layer\n",
        "X = 1  # -0.0 -> +0.0: equal scores, equal keys; s - 0.0 is s\n",
        "M = 0x7FFFFFFF  # 0x7f masks, 0xFFFFFFFF, 0xdeadbeef12\n",
        "D = 1  # float8_e4m3fn, bfloat16, fp8_e4m3, int64, sm_90a, e4m3\n",
        "X = 1  # torch 2.11, Python >= 3.11, Triton 3.6, sglang 0.5.23; issue 51\n",
        "X = 1  # an EMA, alpha 0.5; 2026-12-02; N_G / 32, at most 8192\n",
        'X = 1  # the evidence row "decode prefetch"; benchmark/results/recall.json\n',
        "X = 1  # `took 125 us` in inline code is code\n",
        'raise ValueError("took 125 us, 1.2x slower, 7% of its selections")\n',
        'HELP = "missed >= 7% of its selections (0.9 hit rate)"\n',
        "ALPHA = 0.5\nSPEEDUP = 1.2\n",
        '"""Ten decode steps of 2048 keys, four warps, sixteen splits."""\n',
    ],
)
def test_scan_passes(source):
    assert scan(source) == [], source


def test_scan_names_file_line_and_text():
    source = textwrap.dedent(
        '''\
        """Module docstring.

        Second paragraph: took 3.5 us."""
        X = 1
        # fine
        # also fine, then a commit
        # 8c90ac6 on the next line
        '''
    )
    found = scan(source, "pkg/mod.py")
    assert len(found) == 3, found
    assert found[0].startswith("pkg/mod.py:3: measured figure '3.5 us' (time or size)")
    assert found[1].startswith("pkg/mod.py:3: measured figure '3.5' (decimal)")
    assert found[2].startswith("pkg/mod.py:7: commit id '8c90ac6'")
