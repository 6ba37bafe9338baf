"""The package's size for issue 51's target: raw lines and code lines.

Raw lines are every line of every module (``wc -l``): what the issue's "17.8K lines" at its
filing counted (its tree gives that number), so the target is read in them. A code line is
a line that holds a token of a statement: blank lines, comments and docstrings (a string
that opens a module, class or function body) do not count, and a statement spread over
several lines counts each line it spans. Why both: code lines say how much code a reader
must hold, apart from the docstrings that say why, which the project wants more of.

    python -m benchmark.code_size                 # total, per unit, the largest modules
    python -m benchmark.code_size --json          # the same as one JSON object
    git archive REV python | tar -x -C /tmp/rev   # an earlier tree, then:
    python -m benchmark.code_size --root /tmp/rev/python/sglang_echo
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import tokenize
from collections import Counter
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "sglang_echo"
_NOT_CODE = {
    tokenize.COMMENT,
    tokenize.NL,
    tokenize.NEWLINE,
    tokenize.INDENT,
    tokenize.DEDENT,
    tokenize.ENDMARKER,
}


def _docstring_lines(tree: ast.Module) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                lines.update(range(first.lineno, first.end_lineno + 1))
    return lines


def code_lines(source: str) -> int:
    """Lines of ``source`` that hold a token of code (see the module's docstring)."""
    code: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in _NOT_CODE:
            code.update(range(tok.start[0], tok.end[0] + 1))
    return len(code - _docstring_lines(ast.parse(source)))


def package_sizes(root: Path = PACKAGE) -> dict[str, int]:
    """Code lines of every module under ``root``, by path relative to it."""
    return {
        path.relative_to(root).as_posix(): code_lines(path.read_text())
        for path in sorted(root.rglob("*.py"))
    }


def raw_lines(root: Path = PACKAGE) -> int:
    """Every line of every module under ``root``, blanks and docstrings included."""
    return sum(len(path.read_text().splitlines()) for path in root.rglob("*.py"))


def summary(sizes: dict[str, int], largest: int = 15) -> dict:
    """The total, each unit's sum (a subpackage, or ``root`` for top-level modules) and
    the largest modules."""
    units: Counter[str] = Counter()
    for path, n in sizes.items():
        units[path.split("/")[0] if "/" in path else "root"] += n
    top = sorted(sizes.items(), key=lambda item: (-item[1], item[0]))[:largest]
    return {"total": sum(sizes.values()), "units": dict(units.most_common()), "largest": dict(top)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmark.code_size",
        description="Raw and code lines (no blanks, comments or docstrings) of python/sglang_echo.",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--largest", type=int, default=15, help="how many modules to list")
    p.add_argument(
        "--root", type=Path, default=PACKAGE, help="the package folder (default: this tree's)"
    )
    args = p.parse_args(argv)
    if not args.root.is_dir():
        p.error(f"--root {args.root} is not a folder")
    result = summary(package_sizes(args.root), args.largest)
    result["raw_lines"] = raw_lines(args.root)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"{args.root}: {result['total']:,} code lines ({result['raw_lines']:,} raw lines)")
    for name, n in result["units"].items():
        print(f"  {name:<10} {n:>6,}")
    print("largest modules:")
    for name, n in result["largest"].items():
        print(f"  {n:>5,}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
