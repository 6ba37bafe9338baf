"""No god objects (issue 51): no class of ``python/sglang_echo`` defines more than
``MAX_METHODS`` methods.

A class that grows past that holds several jobs; it is split along its seams into
collaborators with one job each (the coordinator's ring backups and host-id release, the
scheduler's admission, step in flight and events, the manager's pending prefetches), not
into mixins. Counted from each file's syntax tree, like tests/test_import_circles.py: the
functions defined in the class body, properties, static and class methods included
(a property is a method too: prefer a plain attribute or a collaborator).

This is a test of the product's code, so it lives in ``tests/`` beside the import rules
(tests/repo/test_layout.py keeps ``tests/repo/`` for the repository's tooling).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "python" / "sglang_echo"
MAX_METHODS = 20


def class_sizes(source: str) -> list[tuple[str, int]]:
    """(class name, methods defined in its body) for every class in ``source``, nested
    classes included."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            methods = [
                n for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
            ]
            found.append((node.name, len(methods)))
    return found


def test_the_counter_counts_properties_and_nested_classes():
    source = (
        "class A:\n"
        "    x = 1\n"
        "    def f(self): ...\n"
        "    @property\n"
        "    def g(self): ...\n"
        "    async def h(self): ...\n"
        "    class B:\n"
        "        def i(self): ...\n"
    )
    assert sorted(class_sizes(source)) == [("A", 3), ("B", 1)]


def test_no_class_has_more_than_twenty_methods():
    files = sorted(PACKAGE_ROOT.rglob("*.py"))
    assert len(files) > 100
    big = [
        f"{path.relative_to(PACKAGE_ROOT.parent).as_posix()}: {name} ({count} methods)"
        for path in files
        for name, count in class_sizes(path.read_text())
        if count > MAX_METHODS
    ]
    assert not big, (
        f"classes with more than {MAX_METHODS} methods: {big}. Split each along its seams "
        "into collaborators with one job each (properties count: prefer plain attributes)."
    )


MAX_MODULE_LINES = 600


def test_no_module_has_more_than_six_hundred_lines():
    """A module past that holds several jobs (issue 51's bound): split it along its seams."""
    files = sorted(PACKAGE_ROOT.rglob("*.py"))
    lines = {path: len(path.read_text().splitlines()) for path in files}
    big = [
        f"{path.relative_to(PACKAGE_ROOT.parent).as_posix()} ({n} lines)"
        for path, n in lines.items()
        if n > MAX_MODULE_LINES
    ]
    assert not big, f"modules past {MAX_MODULE_LINES} lines: {big}"
