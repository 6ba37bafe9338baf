"""Every kernel launch the interpreter ran in this session also compiles for sm_90.

It compiles what the tests before it launched (recorded by tests/conftest.py), in a
subprocess without TRITON_INTERPRET (tests/sm90_compile.py). So it depends on the other
tests of its process: tests/conftest.py moves it after all of them (the ``zz`` name is
only a hint), and where it cannot check what the session ran (no kernel test ran, or
pytest-xdist split the launches among workers) it skips with a reason saying so, and a
warning, never passing on nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from conftest import RECORDED_LAUNCHES, RECORDING_OFF


def _not_run(reason: str) -> None:
    """Skip, loudly: the reason in -ra's summary and in the warnings summary."""
    reason = f"sm_90 compile check NOT RUN: {reason}"
    warnings.warn(pytest.PytestWarning(reason), stacklevel=2)
    pytest.skip(reason)


def _grouped(config: pytest.Config) -> bool:
    """Whether pytest-xdist distributes by group (``--dist loadgroup``, as make test runs
    it), so this worker ran every kernel-launching file of the session's kernel group
    (tests/conftest.py). Workers see the controller's command line in ``workerinput``."""
    argv = getattr(config, "workerinput", {}).get("mainargv", [])
    text = " ".join(map(str, argv))
    return "--dist loadgroup" in text or "--dist=loadgroup" in text or "-dloadgroup" in text


def _launches(config: pytest.Config) -> list[dict]:
    """This session's recorded launches of our kernels, or a loud skip saying why none."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker and not _grouped(config):
        _not_run(
            f"under pytest-xdist (worker {worker}) each worker records only the kernel "
            "launches of the tests it ran, so this would compile an arbitrary part of the "
            "session's; run the suite with --dist loadgroup (as make test does: the kernel "
            "tests share this check's worker) or without -n"
        )
    if RECORDING_OFF is not None:
        pytest.fail(f"launches are not recorded on this CPU machine: {RECORDING_OFF}")
    ours = [v for v in RECORDED_LAUNCHES.values() if v["module"].startswith("sglang_echo.")]
    if not ours:
        _not_run(
            "no test of this session launched a kernel of ours under the interpreter (run "
            "alone, or the kernel tests deselected), and it compiles exactly those launches; "
            "run it with the kernel tests, e.g. `pytest tests/test_kernel_alloc.py "
            "tests/test_zz_compile_sm90.py`, or the whole suite"
        )
    return ours


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernels compile natively")
def test_recorded_launches_compile_for_sm90(tmp_path: Path, request) -> None:
    ours = _launches(request.config)
    path = tmp_path / "launches.json"
    path.write_text(json.dumps(ours, default=str))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("sm90_compile.py")
    done = subprocess.run(
        [sys.executable, str(script), str(path)], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-4000:] + done.stdout[-2000:]
    assert f"compiled {len(ours)} of {len(ours)}" in done.stdout
