"""docs/ERRORS.md's table: ``ERRORS`` (what the user does, where it fails, the check it
meets and that check's arguments) and ``error_rows``, which calls each check and keeps the
message it raised."""

from __future__ import annotations

import shlex

from .error_checks import CHECKS

# what the user does | where it fails | the call: a CHECKS name and its arguments
ERRORS = """
`NSA_KV_OFFLOAD=2` | start-up (server, `generate`, plugin) | env NSA_KV_OFFLOAD=2
`NSA_DEV_CACHE_SIZE=260k` | start-up | env NSA_DEV_CACHE_SIZE=260k
`NSA_DEV_CACHE_SIZE=0` | start-up | env NSA_DEV_CACHE_SIZE=0
`SGLANG_ECHO_SPARSE_MLA=fast` (an internal knob) | start-up (server, `generate`) | env SGLANG_ECHO_SPARSE_MLA=fast
`SGLANG_ECHO_TOPK=flashinfer` (a retired knob) | start-up (server, `generate`) | env SGLANG_ECHO_TOPK=flashinfer
a device cache smaller than one decode step's selections | start-up (server, `generate`) | validate dev_cache_size=65536 host_tokens=1800000 max_running_requests=64 topk=2048 chunk_size=8192
an eviction reserve above half the device cache | start-up | validate dev_cache_size=16384 eviction_reserve=10000 host_tokens=1800000 max_running_requests=4 topk=2048 chunk_size=8192
an empty host pool | start-up | validate host_tokens=0 max_running_requests=4 topk=2048 chunk_size=8192
a prompt + `max_new_tokens` longer than the context | server: that request fails (HTTP 400) | request prompt=130000 new=4096 context=131072 pool=2000000
a request longer than the KV pool (`--max-total-tokens`) | server: that request fails (HTTP 400) | request prompt=100000 new=1000 context=131072 pool=100000
a request body with a number of 5,000 digits | server: that request fails (HTTP 400) | body digits=5000
a request body of arrays nested 100,000 deep | server: that request fails (HTTP 400) | body depth=100000
a prompts-file line longer than the context less `--max-new-tokens` | `generate` | prompts tokens=4000 new=256 context=4096
a host pool the machine cannot pin (DeepSeek-V3.2's 61 layers of 656-byte fp8 rows, `--max-total-tokens 100_000_000`) | start-up (server, `generate`) | host_pool layers=61 tokens=100000000 row_bytes=656
`--tp 8` on this runtime | server start-up | server --tp 8
`--disaggregation-mode prefill` on this runtime | server start-up | server --disaggregation-mode prefill
`--disaggregation-mode decode` without the fake transfer backend | server start-up | server --disaggregation-mode decode
`--fake-kv-locality 0.9` on the server | server start-up | server --fake-kv-locality 0.9
`--hisparse-config` without `--enable-hisparse` | server start-up | server --hisparse-config {}
`--model-loader` that is not MODULE:FUNCTION | server start-up | server --model-loader benchmark/study/loader.py
a draft of more tokens than its steps chain (`--speculative-num-steps 2 --speculative-num-draft-tokens 4`) | `generate` | generate --speculative-algorithm NEXTN --speculative-num-steps 2 --speculative-num-draft-tokens 4
a tree draft (`--speculative-eagle-topk 2`) | `generate` | generate --speculative-algorithm NEXTN --speculative-eagle-topk 2
plugin: no `--max-total-tokens` | `sglang.launch_server` with `NSA_KV_OFFLOAD=1` | plugin max_total_tokens=None
plugin: more running requests than the device cache serves | `sglang.launch_server` with `NSA_KV_OFFLOAD=1` | plugin max_running_requests=256
plugin: the same under DP attention (8 ranks) | `sglang.launch_server` with `NSA_KV_OFFLOAD=1` | plugin max_running_requests=2048 dp_size=8 enable_dp_attention=True
plugin: flags ECHO cannot run with | `sglang.launch_server` with `NSA_KV_OFFLOAD=1` | plugin speculative_algorithm=EAGLE page_size=32 dp_size=8 kv_cache_dtype=fp8_e5m2
plugin: a prefill node | `sglang.launch_server` with `NSA_KV_OFFLOAD=1` | plugin disaggregation_mode=prefill
plugin: pools that do not fit the GPUs (fp8 DeepSeek-V3.2, PD decode, DP attention on 8 x H200 at `--mem-fraction-static 0.85`, `--max-total-tokens 4000000`) | `sglang.launch_server` with `NSA_KV_OFFLOAD=1`, before the weights load | sizing dev_cache=260000 host_tokens=4000000 gpu_gib=140.4 fraction=0.85
plugin: GPUs the weights alone fill (the same on 8 x 80 GB) | `sglang.launch_server` with `NSA_KV_OFFLOAD=1`, before the weights load | sizing dev_cache=260000 host_tokens=2000000 gpu_gib=79.6 fraction=0.9
"""


def error_rows() -> list[tuple[str, str, str, str]]:
    """(what, where, the check, the message it raised) per line of ``ERRORS``; torch's own
    words in a message are replaced (they differ by machine and version)."""
    rows = []
    for line in ERRORS.strip().splitlines():
        what, where, call = (c.strip() for c in line.split(" | "))
        name, *args = shlex.split(call)
        check, fn = CHECKS[name]
        try:
            fn(args)
        except (ValueError, RuntimeError) as exc:
            message = str(exc)
            if exc.__cause__ is not None and str(exc.__cause__) in message:
                message = message.replace(str(exc.__cause__), "the allocator's reason")
        else:
            message = "NOT REFUSED: the check accepted this setting"
        rows.append((what, where, check, message))
    return rows
