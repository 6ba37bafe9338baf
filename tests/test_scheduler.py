"""The continuous-batching scheduler in-process (no HTTP), on the CPU.

Requests queue instead of failing when the token pool or the request rows run out, greedy
output equals the offline engine's, aborts return every slot, seeded sampling does not
depend on batch composition, and bad settings fail at start-up with the flag to change.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from scheduler_utils import echo_scheduler, random_prompts
from server_utils import make_serving
from sglang_echo.config import ConfigError, EchoConfig
from sglang_echo.launch_server import main as launch_main
from sglang_echo.model.kv_cache import PlainKVCache
from sglang_echo.model.loader import load_model
from sglang_echo.runtime.engine import Engine
from sglang_echo.runtime.request import SamplingParams, ServeRequest
from sglang_echo.runtime.scheduler import RequestRejected, Scheduler
from sglang_echo.runtime.server_args import ServerArgError, parse_server_args


@pytest.fixture(scope="module")
def model(small_checkpoint):
    return load_model(small_checkpoint)


def _prompts(seed: int, n: int) -> list[list[int]]:
    return random_prompts(seed, n)


def _offline(model, prompts, new_tokens: int) -> list[list[int]]:
    cap = sum(len(p) + new_tokens for p in prompts)
    cache = PlainKVCache.for_model(model.config, cap, torch.float32, "cpu")
    engine = Engine(model, cache, cap, 4, 128, 64, ignore_eos=True)
    return [r.output for r in engine.generate(prompts, new_tokens)]


def _echo_scheduler(model, max_running: int, pool: int, chunk: int = 16, overlap: bool = False):
    return echo_scheduler(model, max_running, pool, chunk=chunk, overlap=overlap)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def _drain(sched: Scheduler, max_steps: int = 10_000) -> list[int]:
    running = []
    for _ in range(max_steps):
        if not sched.has_work():
            return running
        sched.step()
        running.append(len(sched.running))
    raise AssertionError("scheduler did not finish")


def _assert_all_free(sched: Scheduler, cache, n_g: int) -> None:
    assert sched.steps.allocator.num_free == sched.capacity
    assert sched.steps.table.num_free_rows == sched.steps.max_requests
    assert not sched.live
    assert cache.cache.free_count.tolist() == [n_g] * cache.num_layers


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_tight_pool_queues_and_matches_offline(model, overlap):
    prompts = _prompts(1, 10)
    new = 6
    expected = _offline(model, prompts, new)
    longest = max(len(p) for p in prompts) + new
    # The pool holds about two requests at a time: the rest must wait their turn.
    sched, cache, n_g = _echo_scheduler(model, max_running=4, pool=2 * longest, overlap=overlap)
    reqs = [ServeRequest(p, rid=str(i), params=_greedy(new)) for i, p in enumerate(prompts)]
    for r in reqs:
        sched.add(r)
    counts = _drain(sched)
    assert [r.output for r in reqs] == expected
    assert max(counts) <= 4 and max(counts) < len(prompts)
    assert all(r.finish_reason == {"type": "length", "length": new} for r in reqs)
    _assert_all_free(sched, cache, n_g)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_requests_join_midway_and_max_running_holds(model, overlap):
    prompts = _prompts(2, 9)
    expected = _offline(model, prompts, 5)
    sched, cache, n_g = _echo_scheduler(model, max_running=3, pool=2000, overlap=overlap)
    reqs = [ServeRequest(p, rid=str(i), params=_greedy(5)) for i, p in enumerate(prompts)]
    counts = []
    for r in reqs:  # one new request per step, while others decode
        sched.add(r)
        sched.step()
        counts.append(len(sched.running))
    counts += _drain(sched)
    assert max(counts) == 3
    assert [r.output for r in reqs] == expected
    _assert_all_free(sched, cache, n_g)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_abort_waiting_and_running_frees_everything(model, overlap):
    sched, cache, n_g = _echo_scheduler(model, max_running=2, pool=400, overlap=overlap)
    events = []
    reqs = [
        ServeRequest(p, rid=str(i), params=_greedy(50), on_output=events.append)
        for i, p in enumerate(_prompts(3, 4))
    ]
    for r in reqs:
        sched.add(r)
    for _ in range(4):
        sched.step()
    assert len(sched.running) == 2 and len(sched.waiting) == 2
    assert sched.abort("0") and sched.abort("3")  # one running (mid-decode), one waiting
    assert not sched.abort("nope")
    _drain(sched)
    _assert_all_free(sched, cache, n_g)
    ends = {e.rid: e.finish_reason["type"] for e in events if e.finished}
    assert ends == {"0": "abort", "1": "length", "2": "length", "3": "abort"}


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_seeded_sampling_is_independent_of_batch(model, overlap):
    prompt = _prompts(4, 1)[0]

    def run(extra: int, seed: int) -> list[int]:
        sched, _, _ = _echo_scheduler(model, max_running=4, pool=1000, overlap=overlap)
        params = SamplingParams(max_new_tokens=8, temperature=1.0, top_p=0.9, top_k=50, seed=seed)
        target = ServeRequest(prompt, rid="t", params=params)
        sched.add(target)
        for i, p in enumerate(_prompts(5, extra)):
            sched.add(ServeRequest(p, rid=f"o{i}", params=_greedy(8)))
        _drain(sched)
        return target.output

    alone = run(0, seed=11)
    assert run(3, seed=11) == alone
    assert run(0, seed=12) != alone


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_stop_token_ends_request(model, overlap):
    prompt = _prompts(6, 1)[0]
    free_run = _offline(model, [prompt], 12)[0]
    stop_at = next(i for i in range(2, 12) if free_run[i] not in free_run[:i])
    sched, cache, n_g = _echo_scheduler(model, max_running=1, pool=200, overlap=overlap)
    params = SamplingParams(
        max_new_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[free_run[stop_at]]
    )
    req = ServeRequest(prompt, rid="s", params=params)
    sched.add(req)
    _drain(sched)
    assert req.output == free_run[: stop_at + 1]
    assert req.finish_reason == {"type": "stop", "matched": free_run[stop_at]}
    _assert_all_free(sched, cache, n_g)


def test_impossible_request_is_rejected_not_queued(model):
    sched, _, _ = _echo_scheduler(model, max_running=1, pool=50)
    with pytest.raises(RequestRejected, match="max-total-tokens"):
        sched.add(ServeRequest([5] * 40, rid="x", params=_greedy(20)))
    with pytest.raises(RequestRejected, match="context length"):
        sched.add(ServeRequest([5] * 10, rid="y", params=_greedy(200)))
    assert not sched.has_work()


def test_echo_settings_checked_at_startup(small_checkpoint):
    with pytest.raises(ConfigError, match="NSA_DEV_CACHE_SIZE"):
        make_serving(
            small_checkpoint,
            EchoConfig(offload=True, dev_cache_size=64),
            max_running_requests=8,  # 8 x top-k 16 = 128 > 64 slots
            max_total_tokens=500,
            chunked_prefill_size=32,
        )
    # Unset limits are capped to what the device cache holds instead of failing.
    serving = make_serving(
        small_checkpoint, EchoConfig(offload=True, dev_cache_size=64), max_total_tokens=500
    )
    assert serving.info["max_running_requests"] == 64 // 16
    assert serving.info["chunked_prefill_size"] == 64


def test_sglang_flags(small_checkpoint, capsys):
    args = parse_server_args(
        ["--model-path", "m", "--tp", "1", "--disable-radix-cache", "--max-total-tokens", "1_000"]
    )
    assert args.max_total_tokens == 1000 and args.disable_radix_cache
    for bad in (["--tp", "8"], ["--enable-dp-attention"], ["--disaggregation-mode", "decode"]):
        with pytest.raises(ServerArgError, match="plugin"):
            parse_server_args(["--model-path", "m", *bad])
    with pytest.raises(ServerArgError, match="unknown flag"):
        parse_server_args(["--model-path", "m", "--frobnicate"])
    # MTP runs in the server (tests/test_scheduler_speculative.py); a separate draft model
    # does not, and is not pointed at the plugin (which refuses speculation under ECHO).
    assert parse_server_args(["--model-path", "m", "--speculative-algorithm", "NEXTN"])
    with pytest.raises(ServerArgError, match=r"own MTP \(NextN\) layer"):
        parse_server_args(["--model-path", "m", "--speculative-draft-model-path", "d"])
    assert launch_main(["--model-path", str(small_checkpoint), "--tp-size=8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --tp-size 8 is not supported") and "sglang" in err


def test_admission_runs_while_the_decode_step_runs_and_changes_no_output(model):
    """A request that waits while a decode step is launched is admitted before that step's
    tokens are sampled (the host works while the device runs), and every output still
    equals the offline engine's."""
    prompts = _prompts(3, 2)
    expected = _offline(model, prompts, 4)
    sched, cache, n_g = _echo_scheduler(model, max_running=2, pool=2000)
    first, second = (ServeRequest(p, rid=str(i), params=_greedy(4)) for i, p in enumerate(prompts))
    order: list[str] = []
    decode, admit, accept = sched.steps.decode, sched.steps.admit, sched._accept_batch

    def decode_then_queue(active):
        logits = decode(active)
        order.append(f"decode{len(active)}")
        if second.status.name == "WAITING" and second not in sched.waiting:
            sched.add(second)  # arrives while the step runs
        return logits

    sched.steps.decode = decode_then_queue
    sched.steps.admit = lambda req: (order.append(f"admit {req.rid}"), admit(req))[1]
    sched._accept_batch = lambda reqs, logits: (order.append("sample"), accept(reqs, logits))[1]
    sched.add(first)
    _drain(sched)
    i = order.index("decode1")
    assert order[i : i + 3] == ["decode1", "admit 1", "sample"], order
    assert [first.output, second.output] == expected
    _assert_all_free(sched, cache, n_g)


def test_a_steps_events_go_out_after_the_next_launch_in_order_and_none_after_the_last(model):
    """Token events of decode step N are handed out once step N+1 is launched (their
    consumer runs while the device works), in the order they were made; each request gets
    exactly one terminal event and nothing after it, and the last ones are not held back."""
    prompts = _prompts(4, 3)
    expected = _offline(model, prompts, 6)
    sched, cache, n_g = _echo_scheduler(model, max_running=3, pool=2000)
    held_at_launch: list[tuple[int, int]] = []  # (events held, batch size) at each launch
    decode = sched.steps.decode

    def logged_decode(active):
        held_at_launch.append((len(sched.events.held), len(active)))
        return decode(active)

    sched.steps.decode = logged_decode
    events: list = []
    reqs = []
    for i, p in enumerate(prompts):
        r = ServeRequest(p, rid=str(i), params=_greedy(6))
        r.on_output = events.append
        reqs.append(r)
        sched.add(r)
    _drain(sched)
    assert [r.output for r in reqs] == expected
    # At each launch, nothing or exactly the previous step's events are still held, and
    # in the steady stretch they are.
    pairs = list(itertools.pairwise(held_at_launch))
    assert all(now_held in (0, prev_bs) for (_, prev_bs), (now_held, _) in pairs)
    assert sum(now_held == prev_bs > 0 for (_, prev_bs), (now_held, _) in pairs) >= 3
    for r in reqs:
        mine = [e for e in events if e.rid == r.rid]
        assert [t for e in mine for t in e.new_token_ids] == r.output  # each token once, in order
        ends = [k for k, e in enumerate(mine) if e.finish_reason is not None]
        assert ends == [len(mine) - 1]  # one terminal event, the last
    assert not sched.events.held
    _assert_all_free(sched, cache, n_g)
