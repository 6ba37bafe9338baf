"""The one registry of environment variables (sglang_echo/env_settings.py, re-exported by
sglang_echo/config.py; issue 30 item 4).

docs/CONFIGURATION.md is the registry's generated table; no module but env_settings.py reads a
registered variable from the environment; every variable parses once per process into
the frozen settings, with one error style; the kernels' switches come from those
settings; ``--help`` lists the public variables with the values in force.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sglang_echo import config, env_settings
from sglang_echo.config import (
    APPLIES_TO,
    ENV_DEV_CACHE,
    ENV_OFFLOAD,
    ENV_PDL,
    ENV_SPARSE_MLA,
    REGISTRY,
    VARIABLES,
    ConfigError,
    EchoConfig,
    EchoSettings,
    load_settings,
    reset_settings,
    settings,
)

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "python" / "sglang_echo"
DOC = ROOT / "docs" / "CONFIGURATION.md"
PUBLIC = {
    "NSA_KV_OFFLOAD",
    "NSA_DEV_CACHE_SIZE",
    "SGLANG_NSA_FUSE_LOGITS_RECALL_DECODE",
    "SGLANG_NSA_FUSE_LOGITS_RECALL_EXTEND",
}


# ---------------------------------------------------------------------- the registry
def test_the_committed_doc_is_the_generators_output():
    assert DOC.read_text() == config.markdown(), (
        "docs/CONFIGURATION.md differs from the registry; regenerate it: "
        "python -m sglang_echo.config --markdown > docs/CONFIGURATION.md"
    )


def test_one_variable_per_setting_and_every_column_filled():
    names = [v.name for v in VARIABLES]
    assert len(names) == len(set(names)) == len(REGISTRY)
    setting_fields = {f.name for f in dataclasses.fields(EchoSettings) if f.compare}
    assert sorted(v.setting for v in VARIABLES) == sorted(setting_fields)
    for v in VARIABLES:
        assert v.applies_to in APPLIES_TO, v.name
        assert v.default and v.description and "\n" not in v.description, v.name
    assert {v.name for v in VARIABLES if v.public} == PUBLIC


def test_unset_variables_give_the_defaults():
    assert EchoSettings.from_env({}) == EchoSettings()
    for v in VARIABLES:
        default = next(f.default for f in dataclasses.fields(EchoSettings) if f.name == v.setting)
        assert v.parse(v.name, None) == default, v.name
    assert EchoConfig.from_settings(EchoSettings()) == EchoConfig() == EchoConfig.from_env({})


def test_the_kernels_defaults_are_the_registrys():
    """A kernel called directly (a test, a benchmark) behaves as an unset variable."""
    from sglang_echo.kernels.alloc import AllocWorkspace
    from sglang_echo.kernels.pdl import use_pdl
    from sglang_echo.kernels.recall import recall_rows

    unset = EchoSettings()
    for fn in (AllocWorkspace.__init__, recall_rows, use_pdl):
        name = "asked" if fn is use_pdl else "pdl"
        assert inspect.signature(fn).parameters[name].default is unset.pdl, fn


BAD = {
    "NSA_KV_OFFLOAD": "yes",
    "NSA_DEV_CACHE_SIZE": "lots",
    "SGLANG_NSA_FUSE_LOGITS_RECALL_DECODE": "2",
    "SGLANG_NSA_FUSE_LOGITS_RECALL_EXTEND": "on",
    "SGLANG_ECHO_EVICTION_RESERVE": "-1",
    "SGLANG_ECHO_PDL": "true",
    "SGLANG_ECHO_DECODE_PLACE": "yes",
    "SGLANG_ECHO_RESOLVE_OVERLAP": "on",
    "SGLANG_ECHO_SPARSE_MLA": "triton",
    "SGLANG_ECHO_BATCH_INVARIANT": "on",
}


@pytest.mark.parametrize(("name", "raw"), BAD.items(), ids=list(BAD))
def test_a_bad_value_names_the_variable_the_value_and_what_to_set(name, raw):
    with pytest.raises(ConfigError) as info:
        EchoSettings.from_env({name: raw})
    message = str(info.value)
    assert message.startswith(f"{name}={raw!r} is not ")
    assert "set it to" in message or f"use e.g. {name}=" in message


@pytest.mark.parametrize("reader", ["runtime", "plugin"])
def test_a_retired_variable_fails_its_readers_unless_it_names_what_runs(reader):
    for retired in env_settings.RETIRED_VARIABLES:
        name, kept, applies_to = retired.name, retired.runs_as, retired.applies_to
        assert name not in REGISTRY and applies_to in APPLIES_TO
        for raw in (kept, f" {kept.upper()} ", ""):
            EchoSettings.from_env({name: raw}, reader=reader)  # harmless: what runs anyway
        if applies_to not in (reader, "both"):  # never read there: fails nothing, as before
            EchoSettings.from_env({name: "other"}, reader=reader)
            continue
        with pytest.raises(ConfigError, match=f"{name}='other' is retired: .*; unset {name}"):
            EchoSettings.from_env({name: "other"}, reader=reader)
    (topk,) = [v for v in env_settings.RETIRED_VARIABLES if v.name == "SGLANG_ECHO_TOPK"]
    assert (topk.runs_as, topk.applies_to) == ("radix", "runtime")
    assert "| `SGLANG_ECHO_TOPK` | radix | runtime |" in config.markdown()


def test_every_variable_with_a_parser_that_can_fail_is_exercised():
    can_fail = {v.name for v in VARIABLES if v.parse is not config.parse_path}
    assert can_fail == set(BAD)


# ---------------------------------------------------------------- parsed once, then read
def test_settings_are_parsed_once_and_frozen(monkeypatch):
    monkeypatch.setenv(ENV_PDL, "0")
    first = settings()
    assert not first.pdl and ENV_PDL in first.from_environment
    monkeypatch.setenv(ENV_PDL, "1")  # too late: the process parsed its settings already
    assert settings() is first and not settings().pdl
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.pdl = True
    assert load_settings() is settings() and settings().pdl  # a start-up parses again
    reset_settings()
    monkeypatch.setenv(ENV_PDL, "0")
    assert not settings().pdl  # forgotten: the next reader parses the environment


def test_the_start_ups_load_the_settings(small_checkpoint, monkeypatch):
    """build_serving (the server's start-up) parses the environment, whatever a reader
    parsed before; what it built reads those settings."""
    from server_utils import make_serving

    monkeypatch.setenv(ENV_SPARSE_MLA, "torch")
    assert settings().pdl
    monkeypatch.setenv(ENV_PDL, "0")
    make_serving(small_checkpoint, EchoConfig(), max_total_tokens=400)
    assert not settings().pdl
    assert ENV_PDL in settings().from_environment
    assert ENV_SPARSE_MLA in settings().from_environment


def test_the_kernel_switches_come_from_the_settings(monkeypatch):
    """Handed down: the manager's pdl, and the model's sparse MLA as an entry point builds
    it (tests/test_settings_handed_down.py has the rest)."""
    from sglang_echo.model.attention import ModelKernels
    from sglang_echo.offload.device_cache import DeviceCache
    from sglang_echo.offload.host_pool import HostKVPool
    from sglang_echo.offload.manager import EchoManager

    monkeypatch.setenv(ENV_PDL, "0")
    monkeypatch.setenv(ENV_SPARSE_MLA, " Kernel ")

    def manager(**kw) -> EchoManager:
        host = HostKVPool(1, 64, 8, torch.float32, pin=False)
        return EchoManager(host, DeviceCache(1, 16, 64, 8, torch.float32, "cpu"), **kw)

    assert manager(pdl=settings().pdl).pdl is False and manager().pdl is True
    assert EchoConfig.from_settings(settings()).pdl is False
    assert ModelKernels.from_settings(settings()).sparse_mla == "kernel"


def test_the_plugin_parses_only_what_it_reads():
    """A runtime-only variable (the model's top-k, sparse MLA, engine profile, the decode
    writes' placement, the resolve's overlap) can neither
    change nor fail an sglang launch; what both read fails there as here."""
    runtime_only = {v.name for v in VARIABLES if v.applies_to == "runtime"}
    assert runtime_only == {
        "SGLANG_ECHO_SPARSE_MLA",
        "ECHO_ENGINE_PROFILE",
        "SGLANG_ECHO_DECODE_PLACE",
        "SGLANG_ECHO_RESOLVE_OVERLAP",
        "SGLANG_ECHO_BATCH_INVARIANT",
    }
    bad_runtime_only = {name: BAD.get(name, "x") for name in runtime_only}
    plugin = EchoSettings.from_env({ENV_OFFLOAD: "1", **bad_runtime_only}, reader="plugin")
    assert plugin.offload and plugin.sparse_mla == "auto" and plugin.engine_profile is None
    assert all(f" {name}=" not in plugin.summary() for name in runtime_only)
    assert plugin.from_environment == {ENV_OFFLOAD}
    with pytest.raises(ConfigError, match=ENV_PDL):
        EchoSettings.from_env({ENV_PDL: "yes"}, reader="plugin")
    with pytest.raises(ConfigError, match="|".join(runtime_only)):  # the first bad one
        EchoSettings.from_env(bad_runtime_only)


def test_a_plain_sglang_launch_parses_nothing_but_the_switch(monkeypatch):
    """NSA_KV_OFFLOAD unset: the plugin's register() does nothing at all, not even fail
    on ECHO's other variables (nor import sglang)."""
    from sglang_echo import plugin

    monkeypatch.delenv(ENV_OFFLOAD, raising=False)
    monkeypatch.setenv(ENV_SPARSE_MLA, "not-a-backend")
    monkeypatch.setenv(ENV_DEV_CACHE, "lots")
    plugin.register()
    assert env_settings._process_settings is None
    monkeypatch.setenv(ENV_OFFLOAD, "0")
    plugin.register()
    assert env_settings._process_settings is None


# ------------------------------------------------------ nobody else reads the environment
def _is_environ(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ"
    )


def _environ_keys(tree: ast.AST) -> list[tuple[int, ast.AST | None]]:
    """(line, key expression) of every read of one variable: ``os.environ.get(k)``,
    ``.pop``/``.setdefault``, ``os.environ[k]`` (load), ``k in os.environ``,
    ``os.getenv(k)``."""
    found: list[tuple[int, ast.AST | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            key = node.args[0] if node.args else None
            if isinstance(f, ast.Attribute) and f.attr in ("get", "pop", "setdefault"):
                if _is_environ(f.value):
                    found.append((node.lineno, key))
            elif (isinstance(f, ast.Attribute) and f.attr == "getenv") or (
                isinstance(f, ast.Name) and f.id == "getenv"
            ):
                found.append((node.lineno, key))
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            if _is_environ(node.value):
                found.append((node.lineno, node.slice))
        elif isinstance(node, ast.Compare) and any(
            isinstance(op, ast.In | ast.NotIn) for op in node.ops
        ):
            if any(_is_environ(c) for c in node.comparators):
                found.append((node.lineno, node.left))
    return found


def _module_strings(tree: ast.Module) -> dict[str, str | None]:
    """Module-level names bound to a string: literals, names imported from
    sglang_echo.config (or sglang_echo.env_settings, which it re-exports), and aliases of
    either."""
    names: dict[str, str | None] = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module in (
            "sglang_echo.config",
            "sglang_echo.env_settings",
        ):
            for alias in node.names:
                value = getattr(config, alias.name, None)
                names[alias.asname or alias.name] = value if isinstance(value, str) else None
        elif isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name):
                names[target.id] = _resolve(node.value, names)
    return names


def _resolve(key: ast.AST | None, names: dict[str, str | None]) -> str | None:
    if isinstance(key, ast.Constant) and isinstance(key.value, str):
        return key.value
    if isinstance(key, ast.Name):
        return names.get(key.id)
    attribute = isinstance(key, ast.Attribute) and isinstance(key.value, ast.Name)
    if attribute and key.value.id in ("config", "env_settings"):  # ``config.ENV_X``
        value = getattr(config, key.attr, None)
        return value if isinstance(value, str) else None
    return None


def _reads(path: Path) -> list[tuple[int, str | None]]:
    tree = ast.parse(path.read_text(), str(path))
    names = _module_strings(tree)
    return [(line, _resolve(key, names)) for line, key in _environ_keys(tree)]


def _sources(*roots: Path) -> list[Path]:
    return sorted(p for root in roots if root.is_dir() for p in root.rglob("*.py"))


def test_no_module_but_env_settings_reads_a_registered_variable():
    """In the package every environment read names a variable that is not ECHO's (Triton's,
    listed in config.EXTERNAL_VARIABLES); the benchmarks and research code read no
    registered variable either (they take ``config.settings()``)."""
    registry_py = PACKAGE / "env_settings.py"
    problems = []
    for path in _sources(PACKAGE):
        if path == registry_py:
            continue
        for line, name in _reads(path):
            if name is None or name in REGISTRY or name not in config.EXTERNAL_VARIABLES:
                problems.append(f"{path.relative_to(ROOT)}:{line}: reads {name or 'a variable'}")
    for path in _sources(ROOT / "benchmark", ROOT / "research"):
        for line, name in _reads(path):
            if name in REGISTRY:
                problems.append(f"{path.relative_to(ROOT)}:{line}: reads {name}")
    assert not problems, (
        "read the registered variables through sglang_echo.config.settings() (parsed once "
        "at start-up), not os.environ:\n" + "\n".join(problems)
    )


@pytest.mark.parametrize(
    "source",
    [
        "import os\nx = os.environ.get('SGLANG_ECHO_SPARSE_MLA')\n",
        "import os\nN = 'SGLANG_ECHO_PDL'\nx = os.environ[N]\n",
        "from sglang_echo.config import ENV_PDL\nimport os\nx = os.getenv(ENV_PDL)\n",
        "from sglang_echo.config import ENV_PDL as P\nimport os\nQ = P\nx = Q in os.environ\n",
        "from os import environ\nx = environ.get('NSA_KV_OFFLOAD', '0')\n",
    ],
)
def test_the_check_catches_a_read(source, tmp_path):
    path = tmp_path / "reader.py"
    path.write_text(source)
    assert [name for _, name in _reads(path)] and all(n in REGISTRY for _, n in _reads(path))


# ----------------------------------------------------------------- what users see of them
@pytest.mark.parametrize("module", ["sglang_echo.launch_server", "sglang_echo.generate"])
def test_help_lists_the_public_variables_with_the_values_in_force(module):
    env = {k: v for k, v in os.environ.items() if k not in REGISTRY}
    env |= {ENV_OFFLOAD: "1", ENV_DEV_CACHE: "1_024", ENV_SPARSE_MLA: "torch"}
    env["PYTHONPATH"] = str(PACKAGE.parent)
    done = subprocess.run(
        [sys.executable, "-m", module, "--help"], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr
    out = " ".join(done.stdout.split())  # argparse wraps to the terminal's width
    assert "NSA_KV_OFFLOAD=1 (set)" in out and "NSA_DEV_CACHE_SIZE=1_024 (set)" in out
    assert "SGLANG_NSA_FUSE_LOGITS_RECALL_DECODE=auto (default)" in out
    assert "SGLANG_NSA_FUSE_LOGITS_RECALL_EXTEND=0 (default)" in out
    assert "docs/CONFIGURATION.md" in out
    for v in VARIABLES:
        assert (v.name in out) is v.public, v.name  # internal ones only in the docs


def test_help_shows_a_bad_value_without_failing():
    text = config.help_epilog({ENV_OFFLOAD: "2"})
    assert "NSA_KV_OFFLOAD='2' is not understood; set it to 1 (on) or 0 (off)" in text


def test_the_start_up_line_has_every_value_in_force():
    line = EchoSettings.from_env({ENV_OFFLOAD: "1", ENV_DEV_CACHE: "1_024"}).summary()
    assert "\n" not in line
    assert "NSA_KV_OFFLOAD=1* NSA_DEV_CACHE_SIZE=1_024*" in line
    assert "SGLANG_ECHO_EVICTION_RESERVE=32 " in line  # the default for N_G 1024
    assert all(f" {v.name}=" in line for v in VARIABLES)


def test_the_config_module_prints_the_values_and_the_doc(capsys, monkeypatch):
    monkeypatch.setenv(ENV_OFFLOAD, "1")
    assert config.main([]) == 0
    out = capsys.readouterr().out
    assert "NSA_KV_OFFLOAD=1\n" in out and "SGLANG_ECHO_PDL=1  (default)" in out
    assert config.main(["--markdown"]) == 0
    assert capsys.readouterr().out == config.markdown()
    monkeypatch.setenv(ENV_OFFLOAD, "yes")
    assert config.main([]) == 2


def test_resolve_overlap_is_a_batch_from_which_the_resolve_runs_beside():
    """SGLANG_ECHO_RESOLVE_OVERLAP: unset the measured default batch, a number that batch,
    ``0`` never and ``1`` every step (what the old on/off switch's values meant); the decode
    step's size then picks the stream (model/attention.py resolves_beside)."""
    from sglang_echo.model.attention import resolves_beside
    from sglang_echo.model.forward_batch import ForwardBatch

    name = "SGLANG_ECHO_RESOLVE_OVERLAP"
    default = EchoSettings.from_env({}).resolve_overlap
    assert default == config.DEFAULT_RESOLVE_OVERLAP_FROM > 1
    assert EchoSettings.from_env({name: ""}).resolve_overlap == default
    assert [EchoSettings.from_env({name: v}).resolve_overlap for v in ("0", "1", "8")] == [0, 1, 8]
    with pytest.raises(ConfigError, match=name):
        EchoSettings.from_env({name: "-4"})

    def step(tokens: int, decode: bool = True) -> ForwardBatch:
        ids = torch.zeros(tokens, dtype=torch.int64)
        rows = torch.zeros(1, tokens, dtype=torch.int64)
        return ForwardBatch(ids, ids, ids, rows, [1] * tokens, [1] * tokens, decode)

    assert not resolves_beside(default, step(default - 1))
    assert resolves_beside(default, step(default)) and resolves_beside(default, step(64))
    assert resolves_beside(1, step(1)) and not resolves_beside(0, step(64))
    assert not resolves_beside(1, step(64, decode=False))  # a prefill chunk: always in line
