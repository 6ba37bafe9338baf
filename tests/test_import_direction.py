"""Imports point one way (docs/ARCHITECTURE.md section 1): kernels <- offload <- runtime
and sglang; the model uses kernels and reaches ECHO only through its KV-cache interface.

Every module under ``kernels/`` and ``offload/`` is parsed, not imported, so a lazy import
inside a function or a ``TYPE_CHECKING`` block counts as much as one at the top: each is a
dependency, and a cycle that only bites at call time is still a cycle. ``kernels/`` may use
only itself, the standard library, torch and triton (numpy for the interpreter shim in
``kernels/sparse_mla.py``); ``offload/`` may use kernels, config, itself, the standard
library and torch. Neither may import ``model``, ``runtime``, ``sglang`` or upstream
SGLang.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = "sglang_echo"
PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "python" / PACKAGE


@dataclass(frozen=True)
class Rule:
    """What the modules of one subpackage may import."""

    first_party: tuple[str, ...]  # sglang_echo modules (and everything below them)
    third_party: frozenset[str]  # top-level names besides the standard library


RULES = {
    # flashinfer: the optional peer top-k (kernels/topk_flashinfer.py), imported lazily
    "kernels": Rule((f"{PACKAGE}.kernels",), frozenset({"torch", "triton", "numpy", "flashinfer"})),
    "offload": Rule(
        (f"{PACKAGE}.kernels", f"{PACKAGE}.config", f"{PACKAGE}.offload"), frozenset({"torch"})
    ),
}


@dataclass(frozen=True)
class Violation:
    where: str  # file:line
    statement: str  # the import as written
    target: str  # the module it names

    def __str__(self) -> str:
        return f"{self.where}: `{self.statement}` imports {self.target}"


def module_name(path: Path) -> str:
    """Dotted name of a module file under PACKAGE_ROOT (``__init__`` names its package)."""
    parts = [PACKAGE, *path.relative_to(PACKAGE_ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


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
    for node in ast.walk(tree):
        statement = ast.get_source_segment(source, node) or ""
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


def allowed(target: str, rule: Rule) -> bool:
    top = target.split(".")[0]
    if top == PACKAGE:
        return any(target == p or target.startswith(p + ".") for p in rule.first_party)
    return top in sys.stdlib_module_names or top in rule.third_party


def violations(path: Path, rule: Rule, source: str | None = None) -> list[Violation]:
    text = path.read_text() if source is None else source
    module = module_name(path)
    rel = path.relative_to(PACKAGE_ROOT.parent).as_posix()
    return [
        Violation(f"{rel}:{line}", statement, target)
        for line, statement, target in imported_modules(text, module, path.name == "__init__.py")
        if not allowed(target, rule)
    ]


def _files() -> list[tuple[str, Path]]:
    return [(sub, p) for sub in RULES for p in sorted((PACKAGE_ROOT / sub).rglob("*.py"))]


def test_every_checked_package_has_modules():
    counts = {sub: sum(1 for s, _ in _files() if s == sub) for sub in RULES}
    assert all(n > 1 for n in counts.values()), f"no modules found under {PACKAGE_ROOT}: {counts}"


@pytest.mark.parametrize(
    ("sub", "path"), _files(), ids=[p.relative_to(PACKAGE_ROOT).as_posix() for _, p in _files()]
)
def test_imports_point_one_way(sub: str, path: Path):
    rule = RULES[sub]
    bad = violations(path, rule)
    allowed_list = ", ".join(rule.first_party) + ", the standard library, "
    allowed_list += ", ".join(sorted(rule.third_party))
    assert not bad, (
        f"{sub}/ may import only {allowed_list}; move the code (a torch reference goes into "
        "its kernel file) instead of importing upward:\n" + "\n".join(map(str, bad))
    )


# The checker itself: each of these, written in a kernels module, must be caught.
_UPWARD = {
    "top level (kernels/topk.py before the move)": (
        "from sglang_echo.model.indexer import select_topk\n"
    ),
    "lazy, inside a function (kernels/sparse_mla.py before the move)": (
        "def ref():\n    from sglang_echo.model.attention import sparse_mla\n    return sparse_mla\n"
    ),
    "type checking only": (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from sglang_echo.offload.device_cache import DeviceCache\n"
    ),
    "relative": "from ..runtime import engine\n",
    "package attribute": "from sglang_echo import sglang\n",
    "upstream SGLang": "import sglang.srt.managers\n",
    "dynamic": "import importlib\nm = importlib.import_module('sglang_echo.model.indexer')\n",
    "another library": "import transformers\n",
}


@pytest.mark.parametrize("source", list(_UPWARD.values()), ids=list(_UPWARD))
def test_checker_catches_upward_imports(source: str):
    fake = PACKAGE_ROOT / "kernels" / "example.py"
    bad = violations(fake, RULES["kernels"], source)
    assert bad, f"not caught: {source!r}"
    assert all(v.where.startswith("sglang_echo/kernels/example.py:") for v in bad)


def test_checker_accepts_what_the_rule_allows():
    source = (
        "from __future__ import annotations\nimport os\nimport torch\nimport triton.language as tl\n"
        "from sglang_echo.kernels.cache_layout import ABSENT\nfrom . import alloc\n"
        "from .indexer import fp8_index_logits\n"
    )
    assert violations(PACKAGE_ROOT / "kernels" / "example.py", RULES["kernels"], source) == []
    offload = "from sglang_echo.config import EchoConfig\nfrom sglang_echo.kernels import alloc\n"
    assert violations(PACKAGE_ROOT / "offload" / "example.py", RULES["offload"], offload) == []
