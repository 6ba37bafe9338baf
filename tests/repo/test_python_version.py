"""The package's Python floor: 3.11, sglang 0.5.23's. The code relies on it (the server
catches the builtin ``TimeoutError`` around ``asyncio.wait_for``, which on 3.10 raises the
distinct ``asyncio.TimeoutError``), so pyproject must not promise 3.10."""

from __future__ import annotations

import platform
import re
import tomllib
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
FLOOR = Version("3.11")


def _pyproject() -> dict:
    return tomllib.loads(PYPROJECT.read_text())


def test_requires_python_floor_is_3_11_and_this_interpreter_meets_it():
    spec = SpecifierSet(_pyproject()["project"]["requires-python"])
    floors = [Version(s.version) for s in spec if s.operator in (">=", ">", "~=", "==")]
    assert floors, f"requires-python {spec} names no lower bound"
    assert max(floors) >= FLOOR, f"requires-python {spec} admits Python below {FLOOR}"
    assert "3.10.99" not in spec
    assert spec.contains(platform.python_version()), (
        f"this interpreter ({platform.python_version()}) is outside requires-python {spec}"
    )


def test_ruff_targets_the_floor():
    target = _pyproject()["tool"]["ruff"]["target-version"]
    assert target == f"py{FLOOR.major}{FLOOR.minor}"


ROOT = PYPROJECT.parent
# Ways a text names Python 3.10 as one it runs on: "Python 3.10", "CPython 3.10-3.13",
# "python3.10", "py310"/"cp310" tags, "--python-version 3.10", requires-python ">=3.10",
# and a shell loop over versions ("for py in 3.10 3.11"). Not "3.10x" or "3.10 GiB".
PY310 = re.compile(
    r"""(?ix)
    \b(?:c?python|py)[\s-]?3\.10\b(?!\.?\d)
    | \b(?:cp|py)310\b
    | \b3\.10\s*(?:-|\u2013|to|\.\.)\s*3\.\d+
    | (?:python[-_]version|requires[-_]python)\W+3\.10\b
    | \bfor\s+\w+\s+in\s[^;\n]*\b3\.10\b
    """
)


def _docs_and_scripts() -> list[Path]:
    """What a user reads or runs to set up: docs, README, the benchmark and helper
    scripts, pyproject."""
    files = [ROOT / "README.md", PYPROJECT, *sorted((ROOT / "docs").rglob("*.md"))]
    files += sorted((ROOT / "benchmark").glob("*.sh"))
    files += sorted(p for p in (ROOT / "scripts").rglob("*") if p.suffix in (".sh", ".py", ".md"))
    return files


@pytest.mark.parametrize(
    ("text", "names_310"),
    [
        ("fastapi, pydantic-core for CPython 3.10-3.13, uvicorn", True),
        ("for py in 3.10 3.11 3.12 3.13; do", True),
        ("pip download --python-version 3.10 --platform manylinux2014_x86_64", True),
        ('requires-python = ">=3.10"', True),
        ("Python 3.10 or later", True),
        ("/usr/lib/python3.10/site-packages", True),
        ("pydantic_core-2.50.5-cp310-cp310-manylinux2014_x86_64.whl", True),
        ('target-version = "py310"', True),
        ("ECHO's published 2.15x / 3.10x / 4.12x", False),
        ("the weights take 3.10 GiB; context 131072", False),
        ("CPython 3.11-3.13 (the GPU machine runs Python 3.12)", False),
        ("python3.100", False),
    ],
)
def test_the_python_310_pattern(text: str, names_310: bool) -> None:
    assert bool(PY310.search(text)) is names_310


def test_no_doc_or_script_names_python_3_10() -> None:
    """The floor is 3.11 (pyproject); a doc or script offering 3.10 (a wheel fetcher
    downloading cp310 wheels, a setup note) sends users to an interpreter that fails."""
    files = _docs_and_scripts()
    assert any(p.name == "fetch_server_wheels.sh" for p in files)
    hits = [
        f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
        for p in files
        for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if PY310.search(line)
    ]
    assert not hits, "Python 3.10 is named as supported (the floor is 3.11):\n" + "\n".join(hits)
