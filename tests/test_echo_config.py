"""Unit tests for ECHO's environment configuration and the host pool's allocation error."""

from __future__ import annotations

import pytest
import torch

from sglang_echo.config import (
    DEFAULT_DEV_CACHE_SIZE,
    ENV_DEV_CACHE,
    ENV_FUSE_DECODE,
    ENV_FUSE_EXTEND,
    ENV_OFFLOAD,
    ConfigError,
    EchoConfig,
    parse_size,
)
from sglang_echo.offload import host_pool
from sglang_echo.offload.host_pool import HostKVPool

FLAGS = {ENV_OFFLOAD: "offload", ENV_FUSE_EXTEND: "fuse_extend"}


def test_variable_names() -> None:
    # The names are the user-facing interface (documented, shared with SGLang).
    assert ENV_OFFLOAD == "NSA_KV_OFFLOAD"
    assert ENV_DEV_CACHE == "NSA_DEV_CACHE_SIZE"
    assert ENV_FUSE_DECODE == "SGLANG_NSA_FUSE_LOGITS_RECALL_DECODE"
    assert ENV_FUSE_EXTEND == "SGLANG_NSA_FUSE_LOGITS_RECALL_EXTEND"


# ------------------------------------------------------------------------ parse_size


@pytest.mark.parametrize(
    ("raw", "value"),
    [
        ("1", 1),
        ("42", 42),
        ("260_000", 260_000),
        ("1_2_3", 123),
        ("  8192 ", 8192),
        ("007", 7),
    ],
)
def test_parse_size_accepts(raw: str, value: int) -> None:
    assert parse_size("SOME_VAR", raw) == value


@pytest.mark.parametrize(
    "raw",
    ["", "   ", "abc", "-5", "+5", "1.5", "1e3", "0x10", "_1", "1_", "1__0", "12 34", "12k"],
)
def test_parse_size_rejects_non_numbers(raw: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_size("SOME_VAR", raw)
    msg = str(info.value)
    assert f"SOME_VAR={raw!r}" in msg
    assert "whole number" in msg
    assert "260_000" in msg  # shows an example of a valid value


@pytest.mark.parametrize("raw", ["0", "000", "0_0"])
def test_parse_size_rejects_zero(raw: str) -> None:
    with pytest.raises(ConfigError, match=r"SOME_VAR must be > 0"):
        parse_size("SOME_VAR", raw)


def test_config_error_is_value_error() -> None:
    assert issubclass(ConfigError, ValueError)


def test_parse_size_unicode_digit_is_config_error() -> None:
    with pytest.raises(ConfigError, match="SOME_VAR"):
        parse_size("SOME_VAR", "²")


# -------------------------------------------------------------------------- from_env


def test_defaults_when_unset() -> None:
    cfg = EchoConfig.from_env({})
    assert cfg == EchoConfig()
    assert cfg.offload is False
    assert cfg.fuse_decode == "auto"  # the decode prefetch under its measured rule
    assert cfg.fuse_extend is False
    assert cfg.dev_cache_size == DEFAULT_DEV_CACHE_SIZE == 260_000


def test_unrelated_variables_ignored() -> None:
    assert EchoConfig.from_env({"PATH": "/bin", "NSA_KV_OFFLOADX": "junk"}) == EchoConfig()


def test_from_env_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_OFFLOAD, "1")
    monkeypatch.setenv(ENV_DEV_CACHE, "1_024")
    monkeypatch.delenv(ENV_FUSE_DECODE, raising=False)
    monkeypatch.delenv(ENV_FUSE_EXTEND, raising=False)
    assert EchoConfig.from_env() == EchoConfig(offload=True, dev_cache_size=1024)


@pytest.mark.parametrize("name", list(FLAGS))
@pytest.mark.parametrize(
    ("raw", "on"), [("0", False), ("", False), (" 0 ", False), ("1", True), (" 1\n", True)]
)
def test_flags_on_and_off(name: str, raw: str, on: bool) -> None:
    cfg = EchoConfig.from_env({name: raw})
    assert getattr(cfg, FLAGS[name]) is on
    # The other flags stay off.
    for other, attr in FLAGS.items():
        if other != name:
            assert getattr(cfg, attr) is False


@pytest.mark.parametrize("name", list(FLAGS))
@pytest.mark.parametrize("raw", ["yes", "true", "on", "2", "-1", "01", "1.0"])
def test_flags_bad_values(name: str, raw: str) -> None:
    with pytest.raises(ConfigError) as info:
        EchoConfig.from_env({name: raw})
    msg = str(info.value)
    assert f"{name}={raw!r}" in msg
    assert "1 (on) or 0 (off)" in msg


@pytest.mark.parametrize(
    ("raw", "mode"),
    [("0", "0"), ("", "auto"), ("1", "1"), (" 1\n", "1"), ("auto", "auto"), (" AUTO ", "auto")],
)
def test_decode_prefetch_modes(raw: str, mode: str) -> None:
    cfg = EchoConfig.from_env({ENV_FUSE_DECODE: raw})
    assert cfg.fuse_decode == mode
    assert cfg.offload is False and cfg.fuse_extend is False


@pytest.mark.parametrize("raw", ["yes", "on", "2", "automatic"])
def test_decode_prefetch_bad_modes(raw: str) -> None:
    with pytest.raises(ConfigError, match=f"{ENV_FUSE_DECODE}={raw!r}") as info:
        EchoConfig.from_env({ENV_FUSE_DECODE: raw})
    assert "auto" in str(info.value)


def test_decode_prefetch_mode_from_a_bool() -> None:
    assert EchoConfig(fuse_decode=True).fuse_decode == "1"
    assert EchoConfig(fuse_decode=False).fuse_decode == "0"
    with pytest.raises(ConfigError, match="mode"):
        EchoConfig(fuse_decode="yes")


@pytest.mark.parametrize(("raw", "value"), [("260_000", 260_000), ("64", 64), ("1_000_000", 10**6)])
def test_dev_cache_size_from_env(raw: str, value: int) -> None:
    cfg = EchoConfig.from_env({ENV_OFFLOAD: "1", ENV_DEV_CACHE: raw})
    assert cfg.offload is True
    assert cfg.dev_cache_size == value


def test_dev_cache_size_parsed_even_when_offload_off() -> None:
    assert EchoConfig.from_env({ENV_DEV_CACHE: "512"}).dev_cache_size == 512
    with pytest.raises(ConfigError, match=ENV_DEV_CACHE):
        EchoConfig.from_env({ENV_DEV_CACHE: "lots"})


@pytest.mark.parametrize("raw", ["abc", "-5", "0", "", "1_", "3.0"])
def test_dev_cache_size_bad_values(raw: str) -> None:
    with pytest.raises(ConfigError) as info:
        EchoConfig.from_env({ENV_OFFLOAD: "1", ENV_DEV_CACHE: raw})
    assert ENV_DEV_CACHE in str(info.value)


# -------------------------------------------------------------------------- validate


@pytest.mark.parametrize(
    ("mrr", "topk", "chunk", "need"),
    [
        (8, 2048, 8192, 16384),  # decode selections bind
        (2, 2048, 8192, 8192),  # prefill chunk binds
        (1, 64, 64, 64),  # both equal
        (3, 5, 1, 15),
        (1, 100, 1, 100),
    ],
)
def test_validate_minimum(mrr: int, topk: int, chunk: int, need: int) -> None:
    kwargs = dict(host_tokens=10_000, max_running_requests=mrr, topk=topk, chunk_size=chunk)
    assert EchoConfig().min_dev_cache_size(mrr, topk, chunk) == need

    EchoConfig(offload=True, dev_cache_size=need).validate(**kwargs)  # exactly enough
    EchoConfig(offload=True, dev_cache_size=need + 1).validate(**kwargs)

    with pytest.raises(ConfigError) as info:
        EchoConfig(offload=True, dev_cache_size=need - 1).validate(**kwargs)
    msg = str(info.value)
    assert f"{ENV_DEV_CACHE}={need - 1} is too small" in msg
    assert f"{ENV_DEV_CACHE} >= {need}" in msg
    assert f"{mrr} x top-k {topk} = {mrr * topk}" in msg
    assert f"chunk writes {chunk}" in msg


@pytest.mark.parametrize("size", [1, 3, 100])
def test_validate_far_too_small(size: int) -> None:
    with pytest.raises(ConfigError, match=rf"{ENV_DEV_CACHE} >= 4096\b"):
        EchoConfig(dev_cache_size=size).validate(
            host_tokens=1, max_running_requests=2, topk=2048, chunk_size=1024
        )


def test_validate_rejects_empty_host_pool() -> None:
    with pytest.raises(ConfigError, match=r"host pool must hold >= 1 token, got 0"):
        EchoConfig(dev_cache_size=10**6).validate(
            host_tokens=0, max_running_requests=1, topk=8, chunk_size=8
        )


def test_validate_rejects_no_running_requests() -> None:
    with pytest.raises(ConfigError, match=r"max running requests must be >= 1, got 0"):
        EchoConfig(dev_cache_size=10**6).validate(
            host_tokens=100, max_running_requests=0, topk=8, chunk_size=8
        )


def test_validate_default_size_fits_a_typical_deployment() -> None:
    # DeepSeek-V3.2 top-k 2048, 64 running requests, 8192-token chunks -> 131072 <= 260000.
    EchoConfig(offload=True).validate(
        host_tokens=1_000_000, max_running_requests=64, topk=2048, chunk_size=8192
    )
    with pytest.raises(ConfigError, match=r">= 262144"):
        EchoConfig(offload=True).validate(
            host_tokens=1_000_000, max_running_requests=128, topk=2048, chunk_size=8192
        )


# ------------------------------------------------------------------------ host pool


def test_host_pool_shape_and_rows() -> None:
    pool = HostKVPool(num_layers=3, num_tokens=10, row_dim=4, dtype=torch.float32, pin=False)
    assert pool.rows.shape == (3, 12, 4)
    assert pool.scratch_row == 11
    assert pool.nbytes == 3 * 12 * 4 * 4
    assert not pool.pinned
    assert torch.count_nonzero(pool.rows) == 0
    assert pool.view_for(torch.device("cpu")) is pool.rows


@pytest.mark.parametrize(
    ("pin", "verb", "error"),
    [
        (False, "allocate", RuntimeError("DefaultCPUAllocator: can't allocate memory")),
        (True, "pin", RuntimeError("cudaHostAlloc failed")),
        (False, "allocate", MemoryError()),
    ],
)
def test_host_pool_allocation_failure(
    monkeypatch: pytest.MonkeyPatch, pin: bool, verb: str, error: BaseException
) -> None:
    calls = []

    def failing_zeros(*args, **kwargs):
        calls.append((args, kwargs))
        raise error

    monkeypatch.setattr(host_pool.torch, "zeros", failing_zeros)
    layers, tokens, row_dim = 61, 1_000_000, 576
    with pytest.raises(ConfigError) as info:
        HostKVPool(layers, tokens, row_dim, torch.bfloat16, pin=pin)
    assert info.value.__cause__ is error
    assert calls and calls[0][1]["pin_memory"] is pin
    gib = layers * (tokens + 2) * row_dim * 2 / 2**30
    msg = str(info.value)
    assert f"could not {verb} the host KV pool" in msg
    assert f"{gib:.2f} GiB" in msg
    assert "GiB" in msg
    assert f"{tokens} tokens x {layers} layers x {row_dim} values" in msg
    assert "--max-total-tokens" in msg


def test_eviction_reserve_from_the_environment_and_its_bound():
    from sglang_echo.config import ENV_DEV_CACHE, ENV_EVICTION_RESERVE

    assert EchoConfig.from_env({}).eviction_reserve == 260_000 // 32  # the default: N_G / 32
    assert EchoConfig.from_env({ENV_DEV_CACHE: "1_000_000"}).eviction_reserve == 8192  # capped
    assert EchoConfig(dev_cache_size=4096).eviction_reserve == 128
    assert EchoConfig.from_env({ENV_EVICTION_RESERVE: "0"}).eviction_reserve == 0  # off
    assert EchoConfig.from_env({ENV_EVICTION_RESERVE: "8_192"}).eviction_reserve == 8192
    with pytest.raises(ConfigError, match=ENV_EVICTION_RESERVE):
        EchoConfig.from_env({ENV_EVICTION_RESERVE: "-3"})
    too_many = EchoConfig(offload=True, dev_cache_size=4096, eviction_reserve=3000)
    with pytest.raises(ConfigError, match="at most 2048"):
        too_many.validate(host_tokens=10_000, max_running_requests=1, topk=2048, chunk_size=512)
