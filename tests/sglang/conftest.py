"""Tests of the SGLang plugin against the real sglang 0.5.23 on the CPU.

`make test` runs this directory with the second environment's Python (sglang 0.5.23 and
its torch 2.14.1, under ~/.cache/sglang-echo; see scripts/sglang_env.sh). In the main
environment, where sglang is absent, the modules that need it are skipped with the
reason shown in the run's summary; with ECHO_REQUIRE_SGLANG=1 (set by the Makefile) a
missing sglang is an error instead.

Every module here may import sglang; set the process up first: without a GPU, Triton
kernels run under the interpreter (sglang's own write path included); one intra-op thread.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(1)

# "sglang.srt": this directory itself is a namespace package named sglang on sys.path.
HAVE_SGLANG = importlib.util.find_spec("sglang.srt") is not None


def pytest_configure(config: pytest.Config) -> None:
    if not HAVE_SGLANG and os.environ.get("ECHO_REQUIRE_SGLANG") == "1":
        raise pytest.UsageError(
            "ECHO_REQUIRE_SGLANG=1 but sglang is not importable in "
            f"{sys.executable}; rebuild the environment (make sglang-env)"
        )
