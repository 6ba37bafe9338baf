"""The launch-chaining switch (kernels/pdl.py): on by default where supported, off by
SGLANG_ECHO_PDL=0, a clear error for anything else, and never under the interpreter."""

from __future__ import annotations

import pytest
import torch

from sglang_echo.kernels.pdl import ENV_PDL, pdl_requested, pdl_supported


def test_unset_or_one_requests_chaining_and_zero_turns_it_off() -> None:
    assert pdl_requested({}) and pdl_requested({ENV_PDL: "1"}) and pdl_requested({ENV_PDL: ""})
    assert not pdl_requested({ENV_PDL: "0"})


@pytest.mark.parametrize("raw", ["yes", "2", "on"])
def test_a_value_it_does_not_understand_says_what_to_set(raw: str) -> None:
    with pytest.raises(ValueError, match=f"{ENV_PDL}=.*set it to 1 \\(on\\) or 0 \\(off\\)"):
        pdl_requested({ENV_PDL: raw})


def test_the_cpu_and_the_interpreter_never_chain(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not pdl_supported(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl_supported(torch.device("cuda", 0))


def test_env_choice_takes_the_first_when_unset_and_refuses_the_rest(monkeypatch) -> None:
    from sglang_echo.kernels.pdl import env_choice
    from sglang_echo.model import attention
    from sglang_echo.model.config import ModelConfigError

    assert env_choice("X", ("a", "b"), {}) == "a"
    assert env_choice("X", ("a", "b"), {"X": " B "}) == "b"
    with pytest.raises(ValueError, match=r"X='c' is not understood; set it to one of a, b"):
        env_choice("X", ("a", "b"), {"X": "c"})
    monkeypatch.setenv(attention.ENV_SPARSE_MLA, "fast")
    attention.sparse_mla_backend.cache_clear()
    try:
        with pytest.raises(ModelConfigError, match="auto, torch, kernel"):
            attention.sparse_mla_backend()
    finally:
        attention.sparse_mla_backend.cache_clear()
