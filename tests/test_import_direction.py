"""Imports point one way (docs/ARCHITECTURE.md section 1), over every module of the package.

Every module under ``python/sglang_echo`` is parsed, not imported, so a lazy import inside
a function, a ``TYPE_CHECKING`` block or an ``importlib.import_module("...")`` call with a
literal name counts as much as one at the top: each is a dependency, and a cycle that only
bites at call time is still a cycle. The rules, per unit (a subpackage, or a module at the
package root such as ``config`` or ``launch_server``):

- ``kernels/`` uses only itself, the standard library, torch and triton (numpy for the
  interpreter shim in ``kernels/sparse_mla.py``):
  nothing above it (offload, model, runtime, sglang, bench, config...).
- ``offload/`` uses kernels, config, itself, the standard library and torch, and of the
  model only the contract it implements (``model/kv_cache.py``: the ``KVCache`` base;
  ``model/selection_hooks.py``; ``model/periodic_rows.py``, the arriving rows' window type):
  no model code, no runtime, no sglang, no upstream SGLang.
- ``model/`` imports no offload (not even for type checking: it owns the contract that
  offload implements), no runtime, no plugin (``sglang/``, ``plugin``), no
  serving-benchmark client (``bench/``) and no CLI.
- ``runtime/`` and ``sglang/`` import neither each other nor the benchmark client or CLIs.
- ``bench/`` (the serving-benchmark client, a user tool) imports none of the engine.
- Nothing in the package imports the repository's ``benchmark/``, ``research/`` or
  ``tests/`` code: they depend on the package, never the reverse (the wheel holds only the
  package: tests/repo/test_wheel.py).
- Every ``sglang_echo`` import names a module that exists (a moved module leaves no caller).
- No import cycle between units.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = "sglang_echo"
PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "python" / PACKAGE

# The repository's code outside the wheel, and the tests' helpers: never imported by it.
OUTSIDE = frozenset(
    {"benchmark", "research", "scripts", "tests", "conftest", "server_utils", "oracle_utils"}
)
CLIS = ("generate", "launch_server", "bench_serving")


@dataclass(frozen=True)
class Rule:
    """What the modules of one unit may import.

    ``first_party``: None = any sglang_echo module outside ``forbidden``; else only these
    (and everything below them). ``third_party``: None = any library; else only these
    top-level names besides the standard library."""

    first_party: tuple[str, ...] | None = None
    third_party: frozenset[str] | None = None
    forbidden: tuple[str, ...] = ()  # units never imported


def _p(*units: str) -> tuple[str, ...]:
    return tuple(f"{PACKAGE}.{u}" for u in units)


RULES = {
    "kernels": Rule(_p("kernels"), frozenset({"torch", "triton", "numpy"})),
    # offload/ implements the model's declared contract (model/kv_cache.py, the KVCache
    # base; model/selection_hooks.py; model/periodic_rows.py, a type fill_prompt takes) and
    # nothing else of the model.
    "offload": Rule(
        _p(
            "kernels",
            "config",
            "offload",
            "model.kv_cache",
            "model.selection_hooks",
            "model.periodic_rows",
        ),
        frozenset({"torch"}),
    ),
    "model": Rule(forbidden=("offload", "runtime", "sglang", "plugin", "bench", *CLIS)),
    "runtime": Rule(forbidden=("sglang", "plugin", "bench", *CLIS)),
    "sglang": Rule(forbidden=("runtime", "bench", *CLIS)),
    "bench": Rule(forbidden=("kernels", "offload", "model", "runtime", "sglang", "plugin")),
}
DEFAULT_RULE = Rule()  # the root modules (config, tokenizer, CLIs, plugin): the global rules


@dataclass(frozen=True)
class Violation:
    where: str  # file:line
    statement: str  # the import as written
    target: str  # the module it names
    why: str = ""

    def __str__(self) -> str:
        return f"{self.where}: `{self.statement}` imports {self.target}" + (
            f" ({self.why})" if self.why else ""
        )


def module_name(path: Path, root: Path = PACKAGE_ROOT) -> str:
    """Dotted name of a module file under ``root`` (``__init__`` names its package)."""
    parts = [PACKAGE, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit_of(module: str) -> str | None:
    """``sglang_echo.runtime.serving`` -> ``runtime``; ``sglang_echo.config`` -> ``config``;
    the package itself -> None."""
    parts = module.split(".")
    return parts[1] if parts[0] == PACKAGE and len(parts) > 1 else None


def module_exists(module: str, root: Path = PACKAGE_ROOT) -> bool:
    rel = Path(*module.split(".")[1:]) if "." in module else Path()
    return (root / rel).with_suffix(".py").is_file() or (root / rel / "__init__.py").is_file()


def _resolve_relative(module: str, is_package: bool, level: int, name: str | None) -> str:
    """``from ..x import y`` inside ``module`` -> the absolute name of ``..x``."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[: len(package) - (level - 1)] if level > 1 else package
    return ".".join([*base, *([name] if name else [])])


def imported_modules(source: str, module: str, is_package: bool) -> list[tuple[int, str, str]]:
    """(line, statement, target module) for every import anywhere in ``source``: top level,
    inside functions and ``if TYPE_CHECKING`` blocks, and ``importlib.import_module`` /
    ``__import__`` calls with a literal name."""
    tree = ast.parse(source)
    found: list[tuple[int, str, str]] = []
    lines = source.splitlines()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Import | ast.ImportFrom | ast.Call):
            continue
        statement = lines[node.lineno - 1].strip()  # its first line, as written
        if isinstance(node, ast.Import):
            found += [(node.lineno, statement, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = (
                _resolve_relative(module, is_package, node.level, node.module)
                if node.level
                else node.module or ""
            )
            # ``from sglang_echo import model`` names the subpackage, not the package.
            if base == PACKAGE or node.module is None:
                found += [(node.lineno, statement, f"{base}.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, statement, base))
        elif isinstance(node, ast.Call):
            func = node.func
            dynamic = (isinstance(func, ast.Name) and func.id == "__import__") or (
                isinstance(func, ast.Attribute) and func.attr == "import_module"
            )
            first = node.args[0] if node.args else None
            if dynamic and isinstance(first, ast.Constant) and isinstance(first.value, str):
                found.append((node.lineno, statement, first.value))
    return found


def why_not(target: str, unit: str | None, rule: Rule, root: Path = PACKAGE_ROOT) -> str | None:
    """Why ``target`` may not be imported from ``unit`` under ``rule``; None when it may."""
    top = target.split(".")[0]
    if top in OUTSIDE:
        return "the repository's code outside the wheel: it depends on the package, not back"
    if top == PACKAGE:
        if not module_exists(target, root):
            return "no such module in the package (moved or removed?)"
        to = unit_of(target)
        if to is None or to == unit:
            return None
        if rule.first_party is not None and not any(
            target == p or target.startswith(p + ".") for p in rule.first_party
        ):
            return f"{unit}/ may import only {', '.join(rule.first_party)}"
        if to in rule.forbidden:
            return f"{unit} may not import {to}"
        return None
    if rule.third_party is None or top in sys.stdlib_module_names or top in rule.third_party:
        return None
    return f"{unit}/ may import only the standard library and {', '.join(sorted(rule.third_party))}"


def violations(path: Path, source: str | None = None, root: Path = PACKAGE_ROOT) -> list[Violation]:
    text = path.read_text() if source is None else source
    module = module_name(path, root)
    unit = unit_of(module)
    rule = RULES.get(unit, DEFAULT_RULE)
    rel = path.relative_to(root.parent).as_posix()
    out = []
    for line, statement, target in imported_modules(text, module, path.name == "__init__.py"):
        why = why_not(target, unit, rule, root)
        if why:
            out.append(Violation(f"{rel}:{line}", statement, target, why))
    return out


def unit_graph(files: list[Path], root: Path = PACKAGE_ROOT) -> dict[str, set[str]]:
    """unit -> the other units its modules import (every import, lazy ones included)."""
    graph: dict[str, set[str]] = {}
    for path in files:
        module = module_name(path, root)
        unit = unit_of(module)
        if unit is None:
            continue
        deps = graph.setdefault(unit, set())
        for _, _, target in imported_modules(path.read_text(), module, path.name == "__init__.py"):
            to = unit_of(target) if target.split(".")[0] == PACKAGE else None
            if to is not None and to != unit:
                deps.add(to)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one unit (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def _files() -> list[Path]:
    return sorted(PACKAGE_ROOT.rglob("*.py"))


def test_every_unit_with_a_rule_has_modules():
    units = {unit_of(module_name(p)) for p in _files()}
    assert set(RULES) <= units, f"rules for units that are gone: {set(RULES) - units}"
    assert len(_files()) > 50, f"too few modules found under {PACKAGE_ROOT}"


@pytest.mark.parametrize(
    "path", _files(), ids=[p.relative_to(PACKAGE_ROOT).as_posix() for p in _files()]
)
def test_imports_point_one_way(path: Path):
    bad = violations(path)
    assert not bad, (
        "imports against the layering (move the code down, or out of the package, instead "
        "of importing upward or outward):\n" + "\n".join(map(str, bad))
    )


def test_no_import_cycles_between_units():
    graph = unit_graph(_files())
    found = cycles(graph)
    assert not found, f"import cycles between sglang_echo units: {found}\ngraph: {graph}"


# ------------------------------------------------------------------ the checker itself
# Each of these, written in the named unit, must be caught.
_UPWARD = {
    "kernels: top level (kernels/topk.py before the move)": (
        "kernels",
        "from sglang_echo.model.indexer import select_topk\n",
    ),
    "kernels: lazy, inside a function (kernels/sparse_mla.py before the move)": (
        "kernels",
        "def ref():\n    from sglang_echo.model.attention import sparse_mla\n    return sparse_mla\n",
    ),
    "kernels: type checking only": (
        "kernels",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from sglang_echo.offload.device_cache import DeviceCache\n",
    ),
    "kernels: relative": ("kernels", "from ..runtime import engine\n"),
    "kernels: package attribute": ("kernels", "from sglang_echo import sglang\n"),
    "kernels: config": ("kernels", "from sglang_echo.config import EchoConfig\n"),
    "kernels: upstream SGLang": ("kernels", "import sglang.srt.managers\n"),
    "kernels: dynamic": (
        "kernels",
        "import importlib\nm = importlib.import_module('sglang_echo.model.indexer')\n",
    ),
    "kernels: another library": ("kernels", "import transformers\n"),
    "offload: the model's code": (
        "offload",
        "from sglang_echo.model.attention import MLAttention\n",
    ),
    "model: offload, type checking only (model/indexer.py before issue 51)": (
        "model",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from sglang_echo.offload.decode_prefetcher import DecodePrefetcher\n",
    ),
    "offload: runtime, lazily": (
        "offload",
        "def f():\n    from sglang_echo.runtime.step_runner import StepRunner\n",
    ),
    "model: runtime": ("model", "from sglang_echo.runtime.request import SeqState\n"),
    "model: the plugin": ("model", "from sglang_echo.sglang.args import resolve\n"),
    "runtime: the plugin": ("runtime", "from sglang_echo.sglang import install\n"),
    "runtime: the benchmark study (runtime/serving.py before issue 30)": (
        "runtime",
        "def _load():\n    from benchmark.study.worker_spec import is_study_worker\n",
    ),
    "runtime: a module that moved out (runtime/fake_transfer.py before issue 30)": (
        "runtime",
        "from sglang_echo.study.locality import Locality\n",
    ),
    "sglang: research": ("sglang", "import research.topk.tracer\n"),
    "sglang: the runtime": ("sglang", "from sglang_echo.runtime.serving import build_serving\n"),
    "bench: the engine": ("bench", "from sglang_echo.runtime.protocol import parse\n"),
    "root module: benchmark": ("config", "from benchmark import evidence\n"),
    "root module: the tests' helpers": ("generate", "import server_utils\n"),
}


@pytest.mark.parametrize(("unit", "source"), list(_UPWARD.values()), ids=list(_UPWARD))
def test_checker_catches_upward_imports(unit: str, source: str):
    fake = PACKAGE_ROOT / unit / "example.py"
    if not (PACKAGE_ROOT / unit).is_dir():  # a root module
        fake = PACKAGE_ROOT / f"{unit}.py"
    bad = violations(fake, source)
    assert bad, f"not caught: {source!r}"
    assert all(v.where.startswith(f"sglang_echo/{fake.relative_to(PACKAGE_ROOT)}:") for v in bad)


def test_checker_accepts_what_the_rules_allow():
    kernels = (
        "from __future__ import annotations\nimport os\nimport torch\nimport triton.language as tl\n"
        "from sglang_echo.kernels.cache_layout import ABSENT\nfrom . import alloc\n"
        "from .indexer import fp8_index_logits\n"
    )
    assert violations(PACKAGE_ROOT / "kernels" / "example.py", kernels) == []
    offload = (
        "from sglang_echo.config import EchoConfig\nfrom sglang_echo.kernels import alloc\n"
        "from sglang_echo.model.kv_cache import KVCache\n"
        "from sglang_echo.model.selection_hooks import DecodeSelectionHooks\n"
    )
    assert violations(PACKAGE_ROOT / "offload" / "example.py", offload) == []
    model = "from sglang_echo.kernels import topk\nfrom sglang_echo.model.kv_cache import KVCache\n"
    assert violations(PACKAGE_ROOT / "model" / "example.py", model) == []
    runtime = (
        "import importlib\nfrom sglang_echo.model.loader import load_model\n"
        "from sglang_echo.offload.echo_cache import EchoKVCache\n"
        "m = importlib.import_module(spec)\n"  # the --model-loader extension point: not literal
    )
    assert violations(PACKAGE_ROOT / "runtime" / "example.py", runtime) == []


def test_cycle_finder(tmp_path):
    """Two units importing each other (one of them lazily) are a cycle; a chain is not."""
    root = tmp_path / PACKAGE
    for unit, source in {
        "a": "from sglang_echo.b import x\n",
        "b": "def f():\n    from sglang_echo.a import y\n",
        "c": "from sglang_echo.a import z\n",
    }.items():
        (root / unit).mkdir(parents=True)
        (root / unit / "__init__.py").write_text("")
        (root / unit / "m.py").write_text(source)
    graph = unit_graph(sorted(root.rglob("*.py")), root)
    assert graph == {"a": {"b"}, "b": {"a"}, "c": {"a"}}
    assert cycles(graph) == [["a", "b"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
