"""A locally prefilled request enters decode with its newest prompt rows already in ECHO's
cache (copied on the device before sglang frees its prompt rows), so its first decode
step does not recall them; a PD request (KV only on the host) brings nothing. On sglang
0.5.23's real classes, CPU."""

from __future__ import annotations

import plugin_testenv  # first: sets the process up before sglang loads
import torch

plugin_testenv.require_sglang()

from sglang_world import DecodeNode  # noqa: E402

# cpu_machine: test_coordinator's autouse set-up (CPU shims, one-rank process group).
from test_coordinator import check_tables, cpu_machine  # noqa: E402, F401

from sglang_echo.offload.device_cache import ABSENT  # noqa: E402


def node() -> DecodeNode:
    return DecodeNode(layers=2, top_k=16, dev_cache=64, max_running=2, host_tokens=4096,
                      max_context=256, prefill_rows=256, seed=3)  # fmt: skip


def resident(n: DecodeNode, rid: str, positions: range) -> list[list[bool]]:
    coord, token = n.coord, n.running[rid]
    ids = coord.req_to_host_pool[token.req.kv.req_pool_idx, list(positions)].long()
    return [(coord.cache.host_to_device[layer, ids] != ABSENT).tolist()
            for layer in range(n.layers)]  # fmt: skip


def test_a_staged_prompt_enters_the_cache_and_its_first_step_recalls_nothing():
    n = node()
    prompt = 150
    rid = n.prefill(prompt)
    coord = n.coord
    warm = coord.warm_tokens
    assert 0 < warm < prompt, "the test needs a window shorter than the prompt"
    assert all(all(r) for r in resident(n, rid, range(prompt - warm, prompt)))
    assert not any(any(r) for r in resident(n, rid, range(0, prompt - warm)))
    # Their cache rows hold the prompt's bytes (the rows sglang's pool held).
    idx = n.running[rid].req.kv.req_pool_idx
    for layer in range(n.layers):
        ids = coord.req_to_host_pool[idx, prompt - warm : prompt].long()
        slots = coord.cache.host_to_device[layer, ids].long()
        got = coord.cache.rows[layer][slots].view(torch.uint8)
        want = n.running[rid].rows[prompt - warm : prompt, layer].view(torch.uint8)
        assert torch.equal(got, want)
    misses = coord.cache.misses.clone()

    def inside_window(layer, r, seq_len):  # the newest prompt tokens and the current one
        return torch.arange(seq_len - n.top_k, seq_len, dtype=torch.int32)

    tables = n.step([rid], 1, inside_window)
    check_tables(n, [rid], tables)
    assert torch.equal(coord.cache.misses, misses), "the first step recalled warmed rows"

    def outside_window(layer, r, seq_len):
        return torch.arange(0, n.top_k, dtype=torch.int32)

    tables = n.step([rid], 1, outside_window)
    check_tables(n, [rid], tables)
    assert torch.all(coord.cache.misses > misses), "older prompt rows must be recalled"
    n.finish(rid)


def test_a_pd_request_brings_nothing_into_the_cache():
    n = node()
    rid = n.arrive(150)
    assert torch.all(n.coord.cache.free_count == n.coord.cache.num_slots)
    assert not any(any(r) for r in resident(n, rid, range(150)))
    n.finish(rid)
