"""The launch-chaining switch (kernels/pdl.py): on by default where supported, off by
SGLANG_ECHO_PDL=0 (parsed by config.py's registry), a clear error for anything else, and
never under the interpreter."""

from __future__ import annotations

import pytest
import torch

from sglang_echo.config import ENV_PDL, ConfigError, EchoSettings, parse_choice
from sglang_echo.kernels.pdl import pdl_supported


def pdl_requested(environ: dict) -> bool:
    return EchoSettings.from_env(environ).pdl


def test_unset_or_one_requests_chaining_and_zero_turns_it_off() -> None:
    assert pdl_requested({}) and pdl_requested({ENV_PDL: "1"}) and pdl_requested({ENV_PDL: ""})
    assert not pdl_requested({ENV_PDL: "0"})


@pytest.mark.parametrize("raw", ["yes", "2", "on"])
def test_a_value_it_does_not_understand_says_what_to_set(raw: str) -> None:
    with pytest.raises(ConfigError, match=f"{ENV_PDL}=.*set it to 1 \\(on\\) or 0 \\(off\\)"):
        pdl_requested({ENV_PDL: raw})


def test_the_cpu_and_the_interpreter_never_chain(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not pdl_supported(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl_supported(torch.device("cuda", 0))


def test_env_choice_takes_the_first_when_unset_and_refuses_the_rest(monkeypatch) -> None:
    from sglang_echo.config import ENV_SPARSE_MLA
    from sglang_echo.model.attention import ModelKernels
    from sglang_echo.model.config import ModelConfigError

    env_choice = parse_choice(("a", "b"))
    assert env_choice("X", None) == "a" and env_choice("X", "") == "a"
    assert env_choice("X", " B ") == "b"
    with pytest.raises(ConfigError, match=r"X='c' is not understood; set it to one of a, b"):
        env_choice("X", "c")
    with pytest.raises(ConfigError, match="auto, torch, kernel"):  # the start-up's parse
        EchoSettings.from_env({ENV_SPARSE_MLA: "fast"})
    with pytest.raises(ModelConfigError, match="auto, torch, kernel"):  # a model built so
        ModelKernels(sparse_mla="fast")
