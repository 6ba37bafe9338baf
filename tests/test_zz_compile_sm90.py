"""Every kernel launch the interpreter ran in this session also compiles for sm_90.

Named to run last: it compiles what the kernel tests before it launched (recorded by
tests/conftest.py), in a subprocess without TRITON_INTERPRET (tests/sm90_compile.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import RECORDED_LAUNCHES


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernels compile natively")
def test_recorded_launches_compile_for_sm90(tmp_path: Path) -> None:
    if not RECORDED_LAUNCHES:
        pytest.skip("no kernel test ran in this session, so no launch was recorded")
    ours = [v for v in RECORDED_LAUNCHES.values() if v["module"].startswith("sglang_echo.")]
    path = tmp_path / "launches.json"
    path.write_text(json.dumps(ours, default=str))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("sm90_compile.py")
    done = subprocess.run(
        [sys.executable, str(script), str(path)], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-4000:] + done.stdout[-2000:]
    assert f"compiled {len(ours)} of {len(ours)}" in done.stdout
