"""Non-PD prefill admission with ECHO through sglang 0.5.23's real PrefillAdder (its
config read from a scoped runtime context resolved for a DeepSeek-V3.2-shaped model):
with requests running whose future decode tokens exceed the few free device rows, a
context-length prompt is still admitted (EchoPrefillBudget: device rows for prompts,
logical ids for decode tokens), where sglang's own budget, charging those decode tokens
against min(logical, device), starves it."""

from __future__ import annotations

import json
from array import array

import plugin_testenv  # first: sets the process up before sglang loads
import pytest

plugin_testenv.require_sglang()

from sglang_world import DecodeNode, apply_cpu_shims, init_process_group  # noqa: E402
from test_coordinator import assert_back_to_start  # noqa: E402
from test_plugin_args import MODEL_CONFIG  # noqa: E402

from sglang_echo.sglang.prefill_budget import EchoPrefillBudget  # noqa: E402

CONTEXT = 512
TOP_K, DEV_CACHE = 16, 64
CAP = DEV_CACHE // TOP_K


@pytest.fixture(scope="module")
def scheduler_context(tmp_path_factory):
    """sglang's resolved config for a non-PD DSA server, active only inside the test."""
    apply_cpu_shims()
    init_process_group(str(tmp_path_factory.mktemp("pg")))
    from sglang.srt.runtime_context import create_context
    from sglang.srt.server_args import prepare_server_args

    model = tmp_path_factory.mktemp("dsv32")
    (model / "config.json").write_text(json.dumps(MODEL_CONFIG))
    server_args = prepare_server_args(
        ["--model-path", str(model), "--device", "cpu", "--skip-tokenizer-init",
         "--disable-radix-cache", "--random-seed", "1", "--context-length", str(CONTEXT)]
    )  # fmt: skip
    server_args.resolve_once()
    return create_context(server_args, role="scheduler")


def no_tree():
    """The tree cache of a server without a radix cache (sglang's BasePrefixCache for
    what PrefillAdder asks; nothing evictable, no prefix to lock)."""
    from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache

    class NoTree(BasePrefixCache):
        disable = True

        def evictable_size(self) -> int:
            return 0

        def full_evictable_size(self) -> int:
            return 0

        def supports_mamba(self) -> bool:
            return False

        def supports_prefix_sharing(self) -> bool:
            return False

        def lock(self, node):
            return None

        def unlock(self, lock) -> None:
            return None

        def _unused(self, *args, **kwargs):
            raise AssertionError("not used by prefill admission without a radix cache")

        checkpoint = dec_lock_ref = evict = inc_lock_ref = match_prefix = reset = _unused

    return NoTree()


class Batch:
    def __init__(self, reqs) -> None:
        self.reqs = reqs


def adder(node: DecodeNode, running: list):
    from sglang.srt.managers.schedule_policy import PrefillAdder

    return PrefillAdder(
        64, no_tree(), node.allocator, Batch(running), new_token_ratio=0.7,
        rem_input_tokens=16384, rem_chunk_tokens=None, max_running_requests=CAP,
    )  # fmt: skip


def long_prompt():
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req("long", "", array("q", [1] * (CONTEXT - 16)), SamplingParams(max_new_tokens=16))
    req.refresh_fill_ids()  # the scheduler's init_next_round_input (no prefix to match)
    assert len(req.full_untruncated_fill_ids) == CONTEXT - 16
    return req


def test_context_length_prompt_admitted_beside_running_requests(scheduler_context):
    from sglang.srt.managers.schedule_policy import AddReqResult
    from sglang.srt.mem_cache.prefill_budget import PrefillBudget
    from sglang.srt.runtime_context import use_context

    node = DecodeNode(
        layers=1, top_k=TOP_K, dev_cache=DEV_CACHE, max_running=CAP, host_tokens=16384,
        max_context=CONTEXT, prefill_rows=CONTEXT,
    )  # fmt: skip
    rids = [node.prefill(100) for _ in range(CAP - 1)]  # all but one slot running
    running = [node.running[r].req for r in rids]
    for req in running:
        req.sampling_params.max_new_tokens = 1000  # far more than the free device rows
    free_rows = node.allocator.hisparse_attn_allocator.available_size()
    assert free_rows < len(running) * 1000 * 0.7  # what sglang's budget would charge

    with use_context(scheduler_context):
        echo = adder(node, running)
        assert isinstance(echo.memory_budget, EchoPrefillBudget)
        prompt = long_prompt()
        # Admitted; NO_TOKEN then says the device rows are all promised (stop adding).
        assert echo.add_one_req(prompt, False, None) == AddReqResult.NO_TOKEN
        assert echo.can_run_list == [prompt]
        assert echo.memory_budget.device_offset == CONTEXT + 64  # prompt pages + a page
        assert echo.memory_budget.remaining_device == free_rows - CONTEXT - 64

        # sglang's own budget on the same pools starves the prompt.
        stock = node.allocator.create_prefill_budget
        node.allocator.create_prefill_budget = lambda tree, **kw: PrefillBudget(
            node.allocator, tree, **kw
        )
        try:
            starved = adder(node, running)
            assert starved.add_one_req(long_prompt(), False, None) == AddReqResult.NO_TOKEN
            assert starved.can_run_list == []
        finally:
            node.allocator.create_prefill_budget = stock

        # A prompt longer than the free device rows is not admitted whole.
        too_long = adder(node, running)
        too_long.memory_budget.device_offset = 128  # rows promised to another prompt
        assert too_long.add_one_req(long_prompt(), False, None) == AddReqResult.NO_TOKEN
        assert too_long.can_run_list == []
    for rid in rids:
        node.finish(rid)
    assert_back_to_start(node)


def test_decode_prealloc_budget_is_exactly_cap():
    """A PD decode node's pre-allocation queue admits at most
    ``hisparse_attn_allocator.available_size() // (padded_buffer_size +
    spec_swap.scratch_capacity)`` requests beyond those already admitted (sglang 0.5.23,
    DecodePreallocQueue.pop_preallocated). Here the quantities it reads, from the real
    coordinator and allocator: exactly ``cap`` at start, one fewer per admitted request,
    none left at ``cap``; test_decode_prealloc.py runs the real queue itself."""
    node = DecodeNode(
        layers=1, top_k=TOP_K, dev_cache=DEV_CACHE, max_running=CAP, host_tokens=4096,
        max_context=CONTEXT,
    )  # fmt: skip
    coord = node.coord

    def budget() -> int:
        per_request = coord.padded_buffer_size + coord.spec_swap.scratch_capacity
        return node.allocator.hisparse_attn_allocator.available_size() // per_request

    assert budget() == CAP
    rids = []
    for admitted in range(1, CAP + 1):
        rids.append(node.arrive(40))
        assert budget() == CAP - admitted
    for rid in rids:
        node.finish(rid)
    assert budget() == CAP
    assert_back_to_start(node)
