"""No import circle between the package's modules.

``tests/test_import_direction.py`` forbids cycles between units (subpackages and root
modules); this test looks inside them: no two modules of ``python/sglang_echo`` may import
each other, directly or through others. Every module is parsed, not imported, so an import
inside a function or a ``TYPE_CHECKING`` block counts as much as one at the top: a lazy
import that breaks a circle at import time still ties the two modules together (code both
need belongs in a module both import, such as ``kernels/alloc_common.py``). Each edge names
the module the import actually loads: ``import a.b``, ``from a import b`` (``b`` a module),
``from a.b import name``, relative forms and literal ``importlib.import_module`` calls.
"""

from __future__ import annotations

import ast
from itertools import pairwise
from pathlib import Path

import pytest

from test_import_direction import PACKAGE_ROOT, _resolve_relative, cycles, module_name

# module -> imported module -> where each import is (file:line `statement`)
Graph = dict[str, dict[str, list[str]]]


def _existing(name: str, modules: set[str]) -> str | None:
    """The module ``name`` loads: itself, or the nearest enclosing module that exists
    (``from sglang_echo.kernels.alloc import X`` -> ``sglang_echo.kernels.alloc``)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _targets(node: ast.AST, module: str, is_package: bool, modules: set[str]) -> list[str]:
    """The package's modules that one import node loads (none for anything outside it)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = (
            _resolve_relative(module, is_package, node.level, node.module)
            if node.level
            else node.module or ""
        )
        # ``from a import b``: the submodule a.b when there is one, else a name in a.
        names = [
            f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
            for alias in node.names
        ]
    elif isinstance(node, ast.Call):
        func = node.func
        dynamic = (isinstance(func, ast.Name) and func.id == "__import__") or (
            isinstance(func, ast.Attribute) and func.attr == "import_module"
        )
        first = node.args[0] if node.args else None
        literal = isinstance(first, ast.Constant) and isinstance(first.value, str)
        names = [first.value] if dynamic and literal else []
    else:
        return []
    found = (_existing(name, modules) for name in names)
    return [t for t in found if t is not None and t != module]


def module_graph(files: list[Path], root: Path = PACKAGE_ROOT) -> Graph:
    """Every module's imports of the package's other modules, wherever they are written."""
    modules = {module_name(path, root): path for path in files}
    names = set(modules)
    graph: Graph = {}
    for module, path in sorted(modules.items()):
        source = path.read_text()
        lines = source.splitlines()
        rel = path.relative_to(root.parent).as_posix()
        edges = graph.setdefault(module, {})
        for node in ast.walk(ast.parse(source)):
            # One record per statement and module (``from a import (x, y)``: one).
            targets = _targets(node, module, path.name == "__init__.py", names)
            for target in dict.fromkeys(targets):
                statement = lines[node.lineno - 1].strip()
                edges.setdefault(target, []).append(f"{rel}:{node.lineno} `{statement}`")
    return graph


def circle_path(graph: Graph, members: list[str]) -> list[str]:
    """One closed path through a circle's first module, inside the circle (breadth first:
    the shortest), as ``a -> b -> a``."""
    inside = set(members)
    start = members[0]
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        step = []
        for v in frontier:
            for w in sorted(graph.get(v, {})):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w in inside and w not in previous:
                    previous[w] = v
                    step.append(w)
        frontier = step
    raise AssertionError(f"no closed path through {start} in {members}")


def describe(graph: Graph) -> list[str]:
    """Each circle (its modules), one closed path through it and the imports that close it."""
    out = []
    for members in cycles({m: set(edges) for m, edges in graph.items()}):
        path = circle_path(graph, members)
        lines = [f"circle of {len(members)} modules: {' -> '.join(path)}"]
        for a, b in pairwise(path):
            lines += [f"  {a} -> {b}: {where}" for where in graph[a][b]]
        out.append("\n".join(lines))
    return out


def _files() -> list[Path]:
    return sorted(PACKAGE_ROOT.rglob("*.py"))


def test_no_import_circle_between_modules():
    graph = module_graph(_files())
    assert len(graph) > 50, f"too few modules found under {PACKAGE_ROOT}"
    assert sum(map(len, graph.values())) > 100, "too few imports found: is the parser blind?"
    found = describe(graph)
    assert not found, (
        "import circles in the package (move what both sides need into a module both "
        "import, or hand the one name over as an argument):\n" + "\n".join(found)
    )


# ------------------------------------------------------------------ the checker itself
def _package(tmp_path: Path, sources: dict[str, str]) -> Graph:
    """A tiny ``sglang_echo`` in tmp_path: {"k/a.py": source, ...} (packages get an
    ``__init__``), and its module graph."""
    root = tmp_path / "sglang_echo"
    root.mkdir(parents=True)
    (root / "__init__.py").write_text("")
    for rel, source in sources.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        (path.parent / "__init__.py").touch()
        path.write_text(source)
    return module_graph(sorted(root.rglob("*.py")), root)


# Each of these, written in k/b.py while k/a.py imports k/b.py at the top, closes a circle.
_BACK_TO_A = {
    "from, top level": "from sglang_echo.k.a import x\n",
    "from, lazy (alloc.py's look-back import)": (
        "def f():\n    from sglang_echo.k.a import x  # imports this module\n    return x\n"
    ),
    "type checking only": (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from sglang_echo.k.a import X\n"
    ),
    "import a.b": "import sglang_echo.k.a\n",
    "import a.b as c, lazily": "def f():\n    import sglang_echo.k.a as a\n    return a\n",
    "from package import module": "from sglang_echo.k import a\n",
    "relative module": "from . import a\n",
    "relative name": "from .a import x\n",
    "relative from the parent": "from ..k.a import x\n",
    "dynamic": "import importlib\nm = importlib.import_module('sglang_echo.k.a')\n",
}


@pytest.mark.parametrize("source", list(_BACK_TO_A.values()), ids=list(_BACK_TO_A))
def test_checker_finds_each_form_of_circle(tmp_path, source: str):
    a = "x = 1\nX = int\nfrom .b import y\n"  # a -> b at the top, line 3
    graph = _package(tmp_path, {"k/a.py": a, "k/b.py": f"y = 2\n{source}"})
    found = describe(graph)
    assert len(found) == 1, found
    assert found[0].startswith(
        "circle of 2 modules: sglang_echo.k.a -> sglang_echo.k.b -> sglang_echo.k.a\n"
    ), found[0]
    assert "sglang_echo/k/a.py:3 `from .b import y`" in found[0]
    assert "sglang_echo/k/b.py:" in found[0]


def test_checker_names_a_longer_circle_and_passes_a_chain(tmp_path):
    graph = _package(
        tmp_path / "circle",
        {
            "k/a.py": "from sglang_echo.k.b import x\n",
            "k/b.py": "from sglang_echo.m.c import x\n",
            "m/c.py": "def f():\n    from sglang_echo.k import a\n",
            "m/d.py": "from sglang_echo.k.a import x\n",  # into the circle, not part of it
        },
    )
    assert graph["sglang_echo.m.d"] == {
        "sglang_echo.k.a": ["sglang_echo/m/d.py:1 `from sglang_echo.k.a import x`"]
    }
    found = describe(graph)
    assert len(found) == 1
    assert found[0].splitlines()[0] == (
        "circle of 3 modules: sglang_echo.k.a -> sglang_echo.k.b -> sglang_echo.m.c -> "
        "sglang_echo.k.a"
    )
    assert "sglang_echo/m/c.py:2 `from sglang_echo.k import a`" in found[0]
    # The same modules as a chain (what a shared module makes of a circle): none.
    chain = _package(
        tmp_path / "chain",
        {
            "k/common.py": "x = 1\n",
            "k/a.py": "from sglang_echo.k.common import x\nfrom sglang_echo.k.b import y\n",
            "k/b.py": "from sglang_echo.k.common import x\ny = x\n",
            "k/__init__.py": "import os\n",  # a package's names: not its modules
            "m/c.py": "from sglang_echo.k import common, a\nimport sglang_echo.k\n",
        },
    )
    assert set(chain["sglang_echo.m.c"]) == {
        "sglang_echo.k.common",
        "sglang_echo.k.a",
        "sglang_echo.k",
    }
    assert describe(chain) == []
