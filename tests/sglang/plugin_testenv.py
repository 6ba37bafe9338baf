"""Process set-up for tests/sglang; every module here imports it first.

(Not a conftest.py: the suite's other modules import the top-level ``conftest`` by name,
and a second conftest module would shadow it.)

`make test` runs this directory with the second environment's Python (sglang 0.5.23 and
its torch 2.14.1, under ~/.cache/sglang-echo; scripts/sglang_env.sh) and
ECHO_REQUIRE_SGLANG=1, so that a missing sglang is an error there. In the main
environment the modules that need sglang are skipped, with the reason in the summary.
"""

from __future__ import annotations

import importlib
import importlib.util
import os

import pytest
import torch

# Before sglang or our kernels load: without a GPU, Triton kernels (sglang's own write
# path included) run under the interpreter. One intra-op thread for tiny tensors.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(1)

SKIP_REASON = "sglang 0.5.23 is not installed here; `make test` runs it in the second env"


def _has_sglang() -> bool:
    try:
        return importlib.util.find_spec("sglang.srt") is not None
    except ModuleNotFoundError:  # no package named sglang at all
        return False


def _load_sglang_pack() -> None:
    """ECHO_SGLANG_PACK=archive (the GPU machine, where sglang cannot be installed):
    sglang's pure-Python modules from the archive (benchmark/harness/sglang_pack.py), and
    import stand-ins for the third-party modules it imports that the machine lacks."""
    pack = os.environ.get("ECHO_SGLANG_PACK")
    if not pack or _has_sglang():
        return
    import sys
    import tarfile
    import tempfile

    target = tempfile.mkdtemp(prefix="sglang-pack-")
    with tarfile.open(pack) as tar:
        tar.extractall(target)
    sys.path.insert(0, target)
    from benchmark.harness import standins

    standins.install_standins(standins.STANDINS)


_load_sglang_pack()


def require_sglang() -> None:
    """Skip the calling module without sglang (error with ECHO_REQUIRE_SGLANG=1).

    Looks for ``sglang.srt``: this directory is itself a namespace package named
    ``sglang`` whenever tests/ is on sys.path.
    """
    if _has_sglang():
        return
    if os.environ.get("ECHO_REQUIRE_SGLANG") == "1":
        raise RuntimeError(f"ECHO_REQUIRE_SGLANG=1 but sglang is missing: {SKIP_REASON}")
    pytest.skip(SKIP_REASON, allow_module_level=True)
