"""Process set-up for tests/sglang; every module here imports it first.

(Not a conftest.py: the suite's other modules import the top-level ``conftest`` by name,
and a second conftest module would shadow it.)

`make test` runs this directory with the second environment's Python (sglang 0.5.23 and
its torch 2.14.1, under ~/.cache/sglang-echo; scripts/sglang_env.sh) and
ECHO_REQUIRE_SGLANG=1, so that a missing sglang is an error there. In the main
environment the modules that need sglang are skipped, with the reason in the summary.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# The repository root, for ``benchmark.harness`` (the sglang pack, the CPU shims), also
# when a test file runs as a script (test_sizing.py's launcher subprocess).
ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmark.harness.sglang_pack import has_sglang, use_pack  # noqa: E402

# Before sglang or our kernels load: without a GPU, Triton kernels (sglang's own write
# path included) run under the interpreter. One intra-op thread for tiny tensors.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(1)

SKIP_REASON = "sglang 0.5.23 is not installed here; `make test` runs it in the second env"


# ECHO_SGLANG_PACK=archive (the GPU machine, where sglang cannot be installed): sglang's
# pure-Python modules from the archive, with import stand-ins for what the machine lacks.
if os.environ.get("ECHO_SGLANG_PACK") and not has_sglang():
    use_pack(os.environ["ECHO_SGLANG_PACK"])


def require_sglang() -> None:
    """Skip the calling module without sglang (error with ECHO_REQUIRE_SGLANG=1).

    Looks for ``sglang.srt``: this directory is itself a namespace package named
    ``sglang`` whenever tests/ is on sys.path.
    """
    if has_sglang():
        return
    if os.environ.get("ECHO_REQUIRE_SGLANG") == "1":
        raise RuntimeError(f"ECHO_REQUIRE_SGLANG=1 but sglang is missing: {SKIP_REASON}")
    pytest.skip(SKIP_REASON, allow_module_level=True)
