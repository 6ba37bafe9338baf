"""Tests say what they test (issue 51, item 6): three places, each checked here.

- ``tests/``: the product's tests (``python/sglang_echo``'s behaviour) and their helpers
  (conftest.py, ``*_utils.py``, sm90_compile.py);
- ``tests/repo/``: the repository tooling's tests: README/docs generation and scanners,
  benchmark scripts and harnesses, records and their evidence, CI and Makefile wiring,
  the wheel build, device-session scripts, ``research/``'s tools;
- ``tests/sglang/``: the SGLang plugin's tests, run in the sglang environment
  (``make test-sglang``).

``make test`` runs ``tests/`` and ``tests/repo/`` (pyproject's ``testpaths``), then
``tests/sglang/`` on its own.

The rules, read from each file's syntax tree (imports, and the string literals that are
not docstrings; ``ROOT / "benchmark" / "results"`` counts as ``benchmark/results``):

1. No product test or helper (``tests/*.py``, ``tests/sglang/*.py``) imports ``research``:
   the tiny-checkpoint maker they need is ``scripts.make_tiny_checkpoint``.
2. A cheap heuristic for "this tests repository tooling", which no file of ``tests/*.py``
   may trip: it imports ``benchmark`` (besides the modules in ``BORROWED``, which product
   tests use as a reference or a plug-in), names a file inside ``benchmark/`` or
   ``research/`` (a script to run, a record under ``benchmark/results/``, a harness folder
   put on ``sys.path``) or a ``benchmark.``/``research.`` module to run, runs a shell script
   (``*.sh``) or ``make``, or reads the repository's own files (Makefile, pyproject.toml,
   README.md, ``.ci/``).
3. Conversely every test file in ``tests/repo/`` trips the heuristic, so it is a tooling
   test; a product test placed there fails, and a new tooling test that the heuristic
   misses fails until its marker is added here.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
REPO_TESTS = TESTS / "repo"
PLUGIN_TESTS = TESTS / "sglang"
PACKAGE_ROOT = ROOT / "python" / "sglang_echo"

# benchmark/ modules a product test may import: what the product is checked against.
BORROWED = {
    # tests/test_kernel_release.py: the per-layer release that kernels/release.py replaced,
    # the kernel's reference.
    "benchmark.kernels.release_bench",
    # tests/test_decode_node_server.py: a plug-in for the server's --model-loader extension
    # point (the product's side of it; the loader's own tests are in tests/repo/).
    "benchmark.study.loader",
}

# A string literal (or a path built with ``/``) that names repository tooling.
TOOLING_STRINGS = [
    (re.compile(r"(?:^|[\s/*=])(?:benchmark|research)/[\w.*-]"), "names a file in benchmark/ or research/"),
    (re.compile(r"(?:^|[\s/*=])scripts/[\w/.-]+\.(?:py|sh)\b"), "names a script in scripts/"),
    (re.compile(r"\.sh$"), "runs a shell script"),
    (re.compile(r"^make$"), "runs make"),
    (re.compile(r"(?:^|/)(?:Makefile|pyproject\.toml|README\.md|\.ci)(?:/|$)"), "reads the repository's own files"),
]  # fmt: skip
MODULE_STRING = re.compile(r"((?:benchmark|research)(?:\.\w+)+)(?::\w+)?")


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def _path_of(node: ast.AST) -> str:
    """``a / "b" / "c"`` as ``*/b/c`` (a part that is not a literal is ``*``)."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        return f"{_path_of(node.left)}/{_path_of(node.right)}"
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return "*"


def _imports(tree: ast.AST) -> set[str]:
    """Every module a file imports, anywhere in it, with ``from X import Y`` as ``X.Y`` (Y
    may be a module), and ``importlib.import_module("X")`` with a literal name."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            found.add(str(node.args[0].value))
    return found


def _strings(tree: ast.AST) -> list[str]:
    """The string literals that are not docstrings, and the paths built with ``/``."""
    skip = _docstrings(tree)
    found = []
    inner = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and id(node) not in inner:
            found.append(_path_of(node))
            for child in ast.walk(node):
                inner.add(id(child))
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            found.append(node.value)
    return found


def _borrowed(module: str) -> bool:
    return any(module == b or module.startswith(b + ".") for b in BORROWED)


def research_imports(source: str) -> list[str]:
    tree = ast.parse(source)
    return sorted(m for m in _imports(tree) if m == "research" or m.startswith("research."))


def tooling_markers(source: str) -> list[str]:
    """Why a file looks like a test of repository tooling (empty: it does not)."""
    tree = ast.parse(source)
    found = [f"imports {m}" for m in research_imports(source)]
    found += [
        f"imports {m}"
        for m in sorted(_imports(tree))
        if (m == "benchmark" or m.startswith("benchmark."))
        and not _borrowed(m)
        # a package above a borrowed module (`from benchmark.study import loader`)
        and not any(b.startswith(m + ".") for b in BORROWED)
    ]
    for text in _strings(tree):
        for pattern, why in TOOLING_STRINGS:
            if pattern.search(text):
                found.append(f"{why}: {text!r}")
        m = MODULE_STRING.fullmatch(text.strip())
        if m and not _borrowed(m.group(1)):
            found.append(f"names the module {m.group(1)}: {text!r}")
    return found


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


TOP_LEVEL = sorted(TESTS.glob("*.py"))
PLUGIN = sorted(PLUGIN_TESTS.glob("*.py"))
REPO = sorted(p for p in REPO_TESTS.glob("test_*.py") if p != Path(__file__).resolve())


def test_tests_live_in_the_three_places():
    places = {TESTS, REPO_TESTS, PLUGIN_TESTS}
    stray = [_rel(p) for p in TESTS.rglob("test_*.py") if p.parent not in places]
    assert not stray, f"tests outside tests/, tests/repo/ and tests/sglang/: {stray}"
    assert len(TOP_LEVEL) > 40 and len(REPO) > 15 and len(PLUGIN) > 20


def test_product_tests_import_no_research():
    found = {_rel(p): research_imports(p.read_text()) for p in TOP_LEVEL + PLUGIN}
    found = {path: mods for path, mods in found.items() if mods}
    assert not found, (
        f"product tests importing research/: {found}. A product test depends on the product "
        "and scripts/ only (the tiny-checkpoint maker is scripts.make_tiny_checkpoint); a test "
        "of research/ belongs in tests/repo/"
    )


def test_top_level_tests_test_the_product():
    found = {_rel(p): tooling_markers(p.read_text()) for p in TOP_LEVEL}
    found = {path: why for path, why in found.items() if why}
    assert not found, (
        "these look like tests of repository tooling (tests/repo/test_layout.py's heuristic): "
        "move them, or their tooling part, to tests/repo/:\n"
        + "\n".join(f"{path}: {'; '.join(why)}" for path, why in found.items())
    )


def test_repo_tests_test_the_tooling():
    unmarked = [_rel(p) for p in REPO if not tooling_markers(p.read_text())]
    assert not unmarked, (
        f"{unmarked} show no sign of testing repository tooling: a test of the product belongs "
        "in tests/; for a test of tooling, add its marker to tests/repo/test_layout.py's "
        "heuristic"
    )


# ------------------------------------------------------------------ the heuristic itself
# Each of these, in a top-level test, must be caught.
_TOOLING = {
    "research, imported": "from research.topk.driver import run_requests\n",
    "research, lazily": "def f():\n    import research.train.loop\n",
    "research, dynamically": "import importlib\nm = importlib.import_module('research.topk')\n",
    "the record tooling": "from benchmark import evidence\n",
    "a benchmark harness": "from benchmark.harness import standins\n",
    "a benchmark module, lazily": "def f():\n    from benchmark.study.worker_spec import main\n",
    "the records": "import json\nRECORD = json.loads(open('benchmark/results/x.json').read())\n",
    "the records, as a path": "from pathlib import Path\nR = Path(__file__).parent / 'benchmark' / 'results'\n",
    "a benchmark script run": "import subprocess\nsubprocess.run(['python', 'benchmark/decode_node_probe.py'])\n",
    "a benchmark module run": "import subprocess, sys\nsubprocess.run([sys.executable, '-m', 'benchmark.e2e_study'])\n",
    "a harness folder on sys.path": "import sys\nfrom pathlib import Path\nsys.path.insert(0, str(ROOT / 'benchmark' / 'kernels'))\n",
    "a script of scripts/": "import subprocess\nsubprocess.run(['bash', 'scripts/sglang_env.sh'])\n",
    "a shell script": "import subprocess\nsubprocess.run(['bash', 'e2e_test_pd_infini.sh'])\n",
    "make": "import subprocess\nsubprocess.run(['make', '-C', ROOT, 'test-sglang'])\n",
    "the Makefile": "TEXT = (ROOT / 'Makefile').read_text()\n",
    "pyproject": "PYPROJECT = ROOT / 'pyproject.toml'\n",
    "README": "TEXT = (ROOT / 'README.md').read_text()\n",
    "CI": "RUN = ROOT / '.ci' / 'run'\n",
}  # fmt: skip
# And none of these.
_PRODUCT = {
    "the package": "from sglang_echo.runtime.engine import Engine\nimport torch\n",
    "the tiny-checkpoint maker": "from scripts.make_tiny_checkpoint import TinySpec\n",
    "a borrowed reference": "from benchmark.kernels.release_bench import per_layer_release\n",
    "a borrowed plug-in, as a flag": "from benchmark.study import loader\n"
    "FLAGS = ['--model-loader', 'benchmark.study.loader:load']\n",
    "a doc the product writes": "DOC = ROOT / 'docs' / 'ERRORS.md'\n",
    "the sources the registry scans": "ROOTS = (ROOT / 'benchmark', ROOT / 'research')\n",
    "a docstring": '"""Runs benchmark/e2e_sweep.sh and reads benchmark/results/."""\nimport os\n',
    "a comment": "import os  # like benchmark/device_session.sh\n",
}  # fmt: skip


@pytest.mark.parametrize("source", list(_TOOLING.values()), ids=list(_TOOLING))
def test_the_heuristic_catches_tooling(source):
    assert tooling_markers(source)


@pytest.mark.parametrize("source", list(_PRODUCT.values()), ids=list(_PRODUCT))
def test_the_heuristic_spares_product_tests(source):
    assert tooling_markers(source) == []


def test_moved_code_is_gone_from_the_package():
    """Issue 30: the study harness, record tooling, task maker, top-k research and training
    live in benchmark/ and research/; issue 51: the tiny checkpoint generator in scripts/
    (the product tests and make demo use it, research/ imports it)."""
    for gone in ("study", "topk", "train", "tools", "bench/evidence.py", "bench/make_tasks.py"):
        assert not (PACKAGE_ROOT / gone).exists(), gone
    for moved in ("benchmark/study/worker.py", "benchmark/evidence/__init__.py", "research/topk/tracer.py",
                  "research/train/cli.py", "scripts/make_tiny_checkpoint.py"):  # fmt: skip
        assert (ROOT / moved).is_file(), moved
    assert not (ROOT / "research" / "tiny_checkpoint.py").exists()
