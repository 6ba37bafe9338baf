"""Settings are handed down: no ``settings()`` read below the entry points (issue 51).

The process's settings (``sglang_echo.env_settings``, re-exported by ``config``) are read
by the entry points only: the server's start-up and engine (``runtime/``), ``generate``,
the SGLang plugin (``sglang/``) and the benchmarks. The model, the offload layer and the
kernels take each switch as a parameter (``ModelKernels`` for SGLANG_ECHO_SPARSE_MLA and
SGLANG_ECHO_BATCH_INVARIANT, ``pdl=`` for SGLANG_ECHO_PDL) whose default is the registry's, so
what they run is what the caller asked for, never a process-wide value read behind it.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

from sglang_echo.config import (
    ENV_BATCH_INVARIANT,
    ENV_PDL,
    ENV_SPARSE_MLA,
    EchoConfig,
    EchoSettings,
    load_settings,
    settings,
)
from sglang_echo.model.attention import ModelKernels
from sglang_echo.model.config import ModelConfigError

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "python" / "sglang_echo"
BELOW_THE_ENTRY_POINTS = ("model", "offload", "kernels")
# The functions that read (or load) the process's settings.
READERS = frozenset({"settings", "load_settings", "reset_settings"})


def _settings_reads(source: str) -> list[tuple[int, str]]:
    """(line, what) for every call of a settings reader (``settings()``,
    ``config.settings()``, ``load_settings(...)``) and every import of one."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            f = node.func
            name = (
                f.id
                if isinstance(f, ast.Name)
                else f.attr
                if isinstance(f, ast.Attribute)
                else None
            )
            if name in READERS:
                found.append((node.lineno, f"calls {name}()"))
        elif isinstance(node, ast.ImportFrom) and node.module in (
            "sglang_echo.config",
            "sglang_echo.env_settings",
        ):
            for alias in node.names:
                if alias.name in READERS:
                    found.append((node.lineno, f"imports {alias.name}"))
        elif isinstance(node, ast.ImportFrom) and node.module == "sglang_echo":
            if any(alias.name == "env_settings" for alias in node.names):
                found.append((node.lineno, "imports env_settings"))
    return found


def test_the_model_the_offload_and_the_kernels_read_no_settings():
    problems = []
    for unit in BELOW_THE_ENTRY_POINTS:
        for path in sorted((PACKAGE / unit).rglob("*.py")):
            rel = path.relative_to(PACKAGE).as_posix()
            for line, what in _settings_reads(path.read_text()):
                problems.append(f"python/sglang_echo/{rel}:{line}: {what}")
    assert not problems, (
        "model/, offload/ and kernels/ take their switches as parameters that the entry "
        "points (runtime/, sglang/, generate, benchmarks) pass from settings():\n"
        + "\n".join(problems)
    )


@pytest.mark.parametrize(
    "source",
    [
        "from sglang_echo.config import settings\nx = settings().pdl\n",
        "from sglang_echo import config\nx = config.settings().topk\n",
        "from sglang_echo.env_settings import load_settings\n",
        "from sglang_echo import env_settings\n",
    ],
)
def test_the_check_catches_a_read(source):
    assert _settings_reads(source)


# ------------------------------------------------------------- the defaults are the registry's
def test_the_handed_down_defaults_are_the_registrys():
    from sglang_echo.model.deepseek_v32 import DeepseekV32ForCausalLM
    from sglang_echo.model.loader import load_model
    from sglang_echo.offload.hisparse_cache import HiSparseKVCache
    from sglang_echo.runtime.kv_factory import build_hisparse_cache

    unset = EchoSettings()
    assert ModelKernels() == ModelKernels.from_settings(unset)
    assert (ModelKernels().sparse_mla, ModelKernels().batch_invariant) == (
        unset.sparse_mla,
        unset.batch_invariant,
    )
    for fn in (DeepseekV32ForCausalLM, load_model):
        assert inspect.signature(fn).parameters["kernels"].default is None  # ModelKernels()
    for fn in (HiSparseKVCache, build_hisparse_cache):
        assert inspect.signature(fn).parameters["pdl"].default is unset.pdl
    assert EchoConfig.from_settings(unset) == EchoConfig()


def test_the_model_follows_what_it_is_given_not_the_environment(small_checkpoint, monkeypatch):
    from sglang_echo.model.loader import load_model

    monkeypatch.setenv(ENV_BATCH_INVARIANT, "1")
    monkeypatch.setenv(ENV_SPARSE_MLA, "torch")
    load_settings()

    def choices(model) -> set[tuple[bool, str]]:
        return {
            (m.batch_invariant, m.sparse_mla_backend)
            for m in model.modules()
            if hasattr(m, "sparse_mla_backend")
        }

    assert choices(load_model(small_checkpoint)) == {(False, "auto")}  # unset: defaults
    given = ModelKernels.from_settings(settings())  # what an entry point passes
    assert given == ModelKernels(sparse_mla="torch", batch_invariant=True)
    model = load_model(small_checkpoint, kernels=given)
    assert choices(model) == {(True, "torch")}
    ModelKernels(sparse_mla="kernel").apply(model)
    assert choices(model) == {(False, "kernel")}


def test_a_bad_choice_fails_when_the_model_is_built():
    assert ModelKernels(sparse_mla=" Kernel ") == ModelKernels("kernel")
    with pytest.raises(ModelConfigError, match=r"SGLANG_ECHO_SPARSE_MLA='triton'.*auto, torch"):
        ModelKernels(sparse_mla="triton")


def test_the_server_hands_its_settings_down(small_checkpoint, monkeypatch):
    """build_serving (the server's start-up) parses the environment and builds the model
    and the HiSparse-like cache with what it names."""
    from server_utils import make_serving

    monkeypatch.setenv(ENV_SPARSE_MLA, "torch")
    monkeypatch.setenv(ENV_PDL, "0")
    serving = make_serving(
        small_checkpoint, EchoConfig(), max_total_tokens=400, enable_hisparse=True
    )
    model = serving.model
    backends = {m.sparse_mla_backend for m in model.modules() if hasattr(m, "sparse_mla_backend")}
    assert backends == {"torch"}
    assert serving.kv_cache.pdl is False


def test_a_hisparse_cache_takes_pdl_as_given(monkeypatch):
    from sglang_echo.offload.hisparse_cache import HiSparseKVCache

    monkeypatch.setenv(ENV_PDL, "0")
    load_settings()

    def cache(**kw) -> HiSparseKVCache:
        return HiSparseKVCache(1, 16, 2, 4, 8, 4, torch.float32, "cpu", pin=False, **kw)

    assert cache().pdl is True and cache(pdl=False).pdl is False
