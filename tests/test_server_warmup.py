"""launch_server's start-up warm-up: what it sends before the server says ready."""

from __future__ import annotations

from sglang_echo.kernels.alloc_common import ONE_PROGRAM_LANES
from sglang_echo.launch_server import warmup_bodies

ECHO = {
    "kv_backend": "echo",
    "disaggregation_mode": "null",
    "chunked_prefill_size": 8192,
    "context_length": 110592,
    "max_total_tokens": 1_800_000,
}


def test_echo_prefill_server_warms_the_multi_launch_append():
    """A prompt one token past what one allocation program serves, so the append path that
    a chunk of several prompts takes is compiled before the first client."""
    short, long_ = warmup_bodies(ECHO)
    assert len(short["input_ids"]) == 8
    assert len(long_["input_ids"]) == ONE_PROGRAM_LANES + 1
    assert long_["sampling_params"]["max_new_tokens"] == 1


def test_short_warmup_only_where_no_long_append_can_happen():
    for change in (
        {"kv_backend": "no-offload"},
        {"disaggregation_mode": "decode"},  # a decode node prefills nothing
        {"chunked_prefill_size": ONE_PROGRAM_LANES},  # no chunk exceeds one program
        {"context_length": 2048},
        {"max_total_tokens": ONE_PROGRAM_LANES},
    ):
        assert len(warmup_bodies({**ECHO, **change})) == 1, change
