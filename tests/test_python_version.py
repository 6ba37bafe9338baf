"""The package's Python floor: 3.11, sglang 0.5.23's. The code relies on it (the server
catches the builtin ``TimeoutError`` around ``asyncio.wait_for``, which on 3.10 raises the
distinct ``asyncio.TimeoutError``), so pyproject must not promise 3.10."""

from __future__ import annotations

import platform
import tomllib
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import Version

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
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
