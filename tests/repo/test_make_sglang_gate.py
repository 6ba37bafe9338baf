"""`make test` must fail when the SGLang plugin tests (tests/sglang) do not run, unless
ECHO_SKIP_SGLANG_TESTS=1 says to skip them. The Makefile's test-sglang target runs here
with stand-ins (SGLANG_ENV_SCRIPT, SGLANG_ENV, SGLANG_TESTS): nothing is built and no
sglang is needed; the stand-in environment's python is this one."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def make_test_sglang(tmp_path: Path, env_script: str, *args: str, **env: str):
    """``make test-sglang`` in the checkout with SGLANG_ENV_SCRIPT=``env_script`` (a shell
    body) and SGLANG_ENV=tmp_path/sglang-env (absent unless the test makes it); a clean
    environment (no MAKEFLAGS from an outer make, no opt-out unless given)."""
    script = tmp_path / "sglang_env_standin.sh"
    script.write_text(f'echo "$@" >> "{tmp_path}/standin.calls"\n{env_script}\n')
    clean = {
        k: v
        for k, v in os.environ.items()
        if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")
        and k != "ECHO_SKIP_SGLANG_TESTS"
    }
    proc = subprocess.run(
        [
            "make", "-C", str(ROOT), "--no-print-directory", "test-sglang",
            f"SGLANG_ENV_SCRIPT={script}", f"SGLANG_ENV={tmp_path / 'sglang-env'}", *args,
        ],
        env={**clean, **env}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    calls = tmp_path / "standin.calls"
    return proc, proc.stdout + proc.stderr, calls.read_text() if calls.exists() else ""


FAILING_BUILD = 'echo "sglang_env: stand-in: cannot build" >&2; exit 1'


def test_unbuildable_environment_fails_make(tmp_path):
    assert not (tmp_path / "sglang-env").exists()
    proc, out, calls = make_test_sglang(tmp_path, FAILING_BUILD)
    assert proc.returncode != 0, out
    assert "stand-in: cannot build" in out
    assert "did NOT run" in out and "ECHO_SKIP_SGLANG_TESTS=1" in out
    assert proc.stdout.strip().splitlines()[-1].startswith("test-sglang: FAILED"), out
    assert calls.split() == [str(tmp_path / "sglang-env"), "0.5.23", str(ROOT)]


@pytest.mark.parametrize("how", ["make-variable", "environment"])
def test_opt_out_skips_and_says_so(tmp_path, how):
    if how == "make-variable":
        proc, out, calls = make_test_sglang(tmp_path, FAILING_BUILD, "ECHO_SKIP_SGLANG_TESTS=1")
    else:
        proc, out, calls = make_test_sglang(tmp_path, FAILING_BUILD, ECHO_SKIP_SGLANG_TESTS="1")
    assert proc.returncode == 0, out
    last = proc.stdout.strip().splitlines()[-1]
    assert "SKIPPED by ECHO_SKIP_SGLANG_TESTS=1" in last, out
    assert "did not run" in last
    assert calls == "", "the opt-out must not try to build the environment"


def test_other_opt_out_values_do_not_skip(tmp_path):
    proc, out, _ = make_test_sglang(tmp_path, FAILING_BUILD, ECHO_SKIP_SGLANG_TESTS="0")
    assert proc.returncode != 0, out


@pytest.mark.parametrize(
    ("tests", "ok"),
    [
        ({}, False),  # nothing collected (pytest exit 5)
        ({"test_a.py": "import pytest\npytestmark = pytest.mark.skip('no')\n"
                       "def test_a():\n    pass\n"}, False),  # everything skipped
        ({"test_a.py": "import pytest\n"
                       "pytest.skip('no sglang', allow_module_level=True)\n"}, False),
        ({"test_a.py": "def test_a():\n    pass\n"}, True),
        ({"test_a.py": "import pytest\ndef test_a():\n    pass\n"
                       "@pytest.mark.skip('gpu')\ndef test_b():\n    pass\n"}, True),
        ({"test_a.py": "def test_a():\n    assert False\n"}, False),
    ],
    ids=["none-collected", "all-skipped", "module-skipped", "passes", "some-skipped", "fails"],
)  # fmt: skip
def test_a_run_that_passes_nothing_fails_make(tmp_path, tests, ok):
    """The environment is there (stand-in: exit 0) but pytest passes no test: that did not
    test the plugin either."""
    env_dir = tmp_path / "sglang-env" / "bin"
    env_dir.mkdir(parents=True)
    python = env_dir / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    suite = tmp_path / "suite"
    suite.mkdir()
    for name, body in tests.items():
        (suite / name).write_text(body)
    proc, out, _ = make_test_sglang(tmp_path, "exit 0", f"SGLANG_TESTS={suite}")
    assert (proc.returncode == 0) == ok, out
    if not ok:
        assert proc.stdout.strip().splitlines()[-1].startswith("test-sglang: FAILED"), out
