"""MTP speculative decoding in the server's scheduler (runtime/scheduler_speculative.py),
built by the server's own start-up (``build_serving``) and driven in-process, no HTTP.

The promises: the same token ids as the scheduler without speculation (greedy, and seeded
sampling with two seeds), for concurrent requests of different lengths, with the plain
pool and with ECHO evicting at the legal minimum N_G for Q = S + 1, drafts scripted so
windows of every accept length are committed; a stop token, a stop string or
max_new_tokens inside an accepted window ends the request there, with exactly one
terminal event and nothing after it; an abort mid-decode; nothing leaks (token locations,
request rows, ECHO's device slots, no refused release); and the start-up refusals.
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import replace

import pytest
import torch

from scheduler_utils import drain
from scripts.make_tiny_checkpoint import TinySpec, make_tiny_checkpoint
from server_utils import make_serving
from sglang_echo.config import ConfigError, EchoConfig
from sglang_echo.launch_server import main as launch_main
from sglang_echo.runtime import metrics
from sglang_echo.runtime.request import SamplingParams, ServeRequest
from sglang_echo.runtime.scheduler_speculative import SpeculativeDecode
from sglang_echo.runtime.server_args import ServerArgError, parse_server_args
from sglang_echo.runtime.spec_graphs import SpecStepGraphs
from sglang_echo.tokenizer import load_tokenizer
from spec_drafts import ReplayingGraphs, script_drafts

SPEC = TinySpec(seed=4, num_nextn_predict_layers=1)  # index_topk 16: sparse past 16 tokens
CHUNK, CONTEXT, RUNNING, POOL = 16, 128, 3, 1200
S = 2  # draft tokens per round; a verify has Q = S + 1 query tokens per request
Q = S + 1
# The legal minimum N_G for RUNNING requests of Q query tokens (the rule with Q).
MIN_N_G = EchoConfig(offload=True).min_dev_cache_size(
    RUNNING, SPEC.index_topk, CHUNK, queries_per_request=Q
)
SEEDS = (7, 1234)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("sched_spec")
    return {
        "mtp": make_tiny_checkpoint(root / "mtp", SPEC),
        "none": make_tiny_checkpoint(root / "none", replace(SPEC, num_nextn_predict_layers=0)),
    }


def _prompts(seed: int, n: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(3, SPEC.vocab_size) for _ in range(rng.randint(20, 60))] for _ in range(n)
    ]


def _serving(ckpt, kv: str, speculative: bool, n_g: int = MIN_N_G, **flags):
    echo = EchoConfig() if kv == "plain" else EchoConfig(offload=True, dev_cache_size=n_g)
    if speculative:
        flags |= {"speculative_algorithm": "NEXTN", "speculative_num_steps": S}
    sizes = {
        "max_total_tokens": POOL,
        "max_running_requests": RUNNING,
        "chunked_prefill_size": CHUNK,
        "context_length": CONTEXT,
    }
    return make_serving(ckpt, echo, **(sizes | flags))


def _add(sched, prompts, params) -> list[ServeRequest]:
    """One request per prompt added to ``sched``, each recording its events."""
    reqs = []
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        req = ServeRequest(list(prompt), rid=str(i), params=replace(p))
        req.events = []
        req.on_output = req.events.append
        sched.add(req)
        reqs.append(req)
    return reqs


def _run(serving, prompts, params) -> list[ServeRequest]:
    """Every request through the scheduler at once, to the end."""
    reqs = _add(serving.scheduler, prompts, params)
    drain(serving.scheduler)
    return reqs


def _script(monkeypatch, reference: dict[str, list[int]], mode: str = "cycle") -> None:
    """Drafts equal to the reference's next tokens up to a count that cycles with each
    request's rounds (``cycle``: every accept length occurs) or always (``right``), wrong
    after it (tests/spec_drafts.py)."""
    script_drafts(
        monkeypatch,
        SpeculativeDecode,
        lambda lane: reference[lane.seq.rid],
        SPEC.vocab_size,
        produced_of=lambda lane: len(lane.seq.output),
        key_of=lambda lane: lane.seq.rid,
        always_right=mode == "right",
    )


def _assert_events(req: ServeRequest) -> None:
    """Exactly one terminal event, the last one; the events carry the output in order."""
    ends = [i for i, e in enumerate(req.events) if e.finished]
    assert ends == [len(req.events) - 1], (req.rid, ends)
    assert [t for e in req.events for t in e.new_token_ids] == req.output


def _assert_all_free(serving, kv: str) -> None:
    sched = serving.scheduler
    assert sched.steps.allocator.num_free == sched.capacity
    assert sched.steps.table.num_free_rows == sched.steps.max_requests
    assert not sched.live and not sched.running and not sched.waiting
    assert not sched.speculative.lanes  # every draft carry went with its request
    if kv == "echo":
        cache = serving.kv_cache
        assert cache.cache.free_count.tolist() == [MIN_N_G] * cache.num_layers
        assert cache.telemetry()["release_errors"] == 0  # no double (or refused) release


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, **kw)


NEW = (9, 14, 5, 12, 7)


def _params(sampling: str) -> list[SamplingParams]:
    if sampling == "greedy":
        return [_greedy(n) for n in NEW]
    seed = int(sampling.removeprefix("seed"))
    return [
        SamplingParams(
            max_new_tokens=n, temperature=0.9, top_p=0.95, top_k=50, ignore_eos=True, seed=seed
        )
        for n in NEW
    ]


@pytest.mark.parametrize("sampling", ["greedy", *(f"seed{s}" for s in SEEDS)])
@pytest.mark.parametrize("kv", ["plain", "echo"])
def test_speculative_scheduler_equals_plain_scheduler(ckpts, monkeypatch, kv, sampling):
    prompts, params = _prompts(1), _params(sampling)
    base = _run(_serving(ckpts["mtp"], kv, False), prompts, params)
    reference = {r.rid: r.output for r in base}
    assert [len(r.output) for r in base] == list(NEW)
    _script(monkeypatch, reference)
    serving = _serving(ckpts["mtp"], kv, True)
    assert serving.info["speculative_num_steps"] == S
    assert not serving.scheduler.overlap  # turned off under speculation
    spec = _run(serving, prompts, params)
    assert [r.output for r in spec] == [r.output for r in base]
    for r in spec:
        assert r.finish_reason == {"type": "length", "length": r.params.max_new_tokens}
        _assert_events(r)
    lens = serving.scheduler.speculative.accept_lens
    assert set(lens) == set(range(1, Q + 1)), lens  # multi-token rounds did happen
    assert serving.scheduler.stats.decode_steps < sum(NEW) - len(NEW)  # fewer target steps
    if kv == "echo":
        assert sum(serving.kv_cache.telemetry()["evictions"]) > 0  # real pressure
    _assert_all_free(serving, kv)


def test_rounds_from_graphs_captured_at_start_up(ckpts, monkeypatch):
    """The server's start-up capture of every round shape (runtime/spec_graphs.py
    ``capture_all``, with a stand-in graph backend): ECHO's state after it is a fresh
    cache's, no capture happens while serving, and the outputs and accept lengths equal
    the eager rounds' (both with the MoE's graph-safe dispatch)."""
    prompts, params = _prompts(1), _params("greedy")
    base = _run(_serving(ckpts["mtp"], "echo", False), prompts, params)
    _script(monkeypatch, {r.rid: r.output for r in base})

    def speculative(graphs: bool):
        serving = _serving(ckpts["mtp"], "echo", True)
        rounds = serving.scheduler.speculative.rounds
        rounds.target.set_graph_safe(True)
        rounds.draft_model.set_graph_safe(True)
        if graphs:
            fresh = _cache_state(serving.kv_cache)
            rounds.graphs = SpecStepGraphs(
                rounds.target, rounds.draft_model, serving.kv_cache, rounds.draft_cache,
                CONTEXT, backend=ReplayingGraphs(),
            )  # fmt: skip
            captured = rounds.graphs.capture_all(list(range(1, RUNNING + 1)), S)
            assert captured == rounds.graphs.startup_captures == 3 * RUNNING
            after = _cache_state(serving.kv_cache)  # the state as before the capture
            assert all(torch.equal(fresh[k], after[k]) for k in fresh), fresh.keys()
        return serving, _run(serving, prompts, params)

    (eager, eager_reqs), (replayed, reqs) = speculative(False), speculative(True)
    graphs = replayed.scheduler.speculative.rounds.graphs
    assert graphs.captures == graphs.startup_captures  # none while serving
    assert graphs.backend.replays > 0
    assert [r.output for r in reqs] == [r.output for r in eager_reqs] == [r.output for r in base]
    # (the script's cycle of right drafts runs on across both servers: their accept
    # lengths differ, every length occurs in each)
    for serving in (eager, replayed):
        assert set(serving.scheduler.speculative.accept_lens) == set(range(1, Q + 1))
    for r in reqs:
        _assert_events(r)
    _assert_all_free(replayed, "echo")


def _cache_state(cache) -> dict:
    c = cache.cache
    names = ("host_to_device", "device_to_host", "priority", "free_stack", "free_count", "clock")
    state = {n: getattr(c, n).clone() for n in names}
    state |= {f"telemetry.{k}": torch.tensor(v) for k, v in cache.telemetry().items()}
    return state


@pytest.mark.parametrize("kv", ["plain", "echo"])
def test_decode_node_under_speculation_equals_the_plain_decode_node(ckpts, monkeypatch, kv):
    """A PD decode node (fake transfer) with MTP: each arrival brings the draft's KV and
    carry as well, and its rounds give the tokens of the same node decoding one token a
    step (the stand-in first token, then the target's greedy choices), with every accept
    length committed; one terminal event per request, everything freed."""
    node = {"disaggregation_mode": "decode", "disaggregation_transfer_backend": "fake"}
    prompts, params = _prompts(3), _params("greedy")
    base = _run(_serving(ckpts["mtp"], kv, False, **node), prompts, params)
    assert [len(r.output) for r in base] == list(NEW)
    _script(monkeypatch, {r.rid: r.output for r in base})
    serving = _serving(ckpts["mtp"], kv, True, **node)
    source = serving.scheduler.prompt_source
    assert (
        source is not None
        and source.draft_cache is serving.scheduler.speculative.rounds.draft_cache
    )
    spec = _run(serving, prompts, params)
    assert [r.output for r in spec] == [r.output for r in base]
    for r in spec:
        _assert_events(r)
    assert set(serving.scheduler.speculative.accept_lens) == set(range(1, Q + 1))
    assert serving.scheduler.stats.decode_steps < sum(NEW) - len(NEW)
    assert not source._drafts  # every carry taken
    _assert_all_free(serving, kv)


def test_every_step_of_a_round_is_timed_under_its_batch(ckpts, monkeypatch):
    """With a device clock (the decode runner's on CUDA; a recording stand-in here) each
    step of a round (S - 1 draft steps, the verify, the draft over the verified positions
    unless every request ended) is timed under the round's batch size: /metrics' decode
    device time covers a speculative server."""
    calls: list[int] = []

    class Clock:
        @contextlib.contextmanager
        def timed(self, batch_size: int):
            calls.append(batch_size)
            yield

    prompts, params = _prompts(1), _params("greedy")
    serving = _serving(ckpts["mtp"], "plain", True)
    serving.scheduler.speculative.rounds.clock = Clock()
    _run(serving, prompts, params)
    rounds = serving.scheduler.stats.decode_steps
    assert rounds > 0 and 2 * rounds <= len(calls) <= (S + 1) * rounds
    assert set(calls) <= set(range(1, RUNNING + 1))
    assert sum(calls) >= 2 * serving.scheduler.stats.decode_batch_requests  # verify + draft


def test_speculative_gauges_follow_the_rounds(ckpts, monkeypatch):
    """``/metrics`` and ``/get_server_info`` carry SGLang's speculative gauges, computed
    from the rounds' accepted lengths; a server without speculation carries none."""
    prompts, params = _prompts(1), _params("greedy")
    plain = _serving(ckpts["mtp"], "plain", False)
    reference = {r.rid: r.output for r in _run(plain, prompts, params)}
    assert "avg_spec_accept_length" not in metrics.snapshot(plain.scheduler, plain.kv_cache)
    _script(monkeypatch, reference)
    serving = _serving(ckpts["mtp"], "plain", True)
    _run(serving, prompts, params)
    lens = serving.scheduler.speculative.accept_lens
    snap = metrics.snapshot(serving.scheduler, serving.kv_cache)
    rounds = sum(lens.values())
    assert snap["spec_verify_rounds_total"] == rounds > 0
    assert snap["avg_spec_accept_length"] == pytest.approx(
        sum(k * n for k, n in lens.items()) / rounds
    )
    assert 1 < snap["avg_spec_accept_length"] < Q  # every length occurred (scripted cycle)
    kept = sum((k - 1) * n for k, n in lens.items())
    assert snap["spec_accept_rate"] == pytest.approx(kept / (rounds * S))
    text = metrics.render(snap, "m")
    assert 'sglang:spec_accept_length{model_name="m"}' in text
    assert f'sglang:spec_num_draft_tokens{{model_name="m"}} {float(Q)!r}' in text
    assert "sglang:spec_verify_rounds_total" in text


def test_sampling_is_not_greedy_and_seeds_differ(ckpts):
    """The seeded equality above is not greedy's in disguise."""
    prompts = _prompts(1)
    outs = {
        s: [r.output for r in _run(_serving(ckpts["mtp"], "plain", False), prompts, _params(s))]
        for s in ("greedy", *(f"seed{x}" for x in SEEDS))
    }
    assert len({str(o) for o in outs.values()}) == 3


def _mid_window(n_out: int) -> bool:
    """With every draft right, rounds end at outputs 1, 1 + Q, 1 + 2Q...: an output count
    off that grid ended inside an accepted window."""
    return (n_out - 1) % Q != 0


@pytest.mark.parametrize("kv", ["plain", "echo"])
def test_stops_inside_an_accepted_window(ckpts, monkeypatch, kv):
    """A stop token, a stop string and max_new_tokens that fall inside a window end the
    request there (the rest of the window is discarded): the non-speculative outputs and
    finish reasons, one terminal event each, nothing after it."""
    prompts = _prompts(2, 3)
    free = _run(_serving(ckpts["mtp"], "plain", False), prompts, [_greedy(14)] * 3)
    tok = load_tokenizer(ckpts["mtp"])
    # Request 0: a stop token at output 5; request 1: a stop string, a printable
    # character that first appears mid-window; request 2: max_new_tokens 6.
    stop_token = free[0].output[5]
    stop_at = free[0].output.index(stop_token)
    text, stop_str = free[1].output, None
    for i in range(2, len(text)):
        ch = tok.decode([text[i]])
        if _mid_window(i + 1) and len(ch) == 1 and ch.isalnum() and ch not in tok.decode(text[:i]):
            stop_str, str_at = ch, i
            break
    assert stop_str is not None, "no printable stop string candidate in the reference"
    params = [
        _greedy(14, stop_token_ids=[stop_token]),
        _greedy(14, stop=[stop_str]),
        _greedy(6),
    ]
    base = _run(_serving(ckpts["mtp"], kv, False), prompts, params)
    assert [len(r.output) for r in base] == [stop_at + 1, str_at + 1, 6]
    assert all(_mid_window(len(r.output)) for r in base)
    _script(monkeypatch, {r.rid: f.output for r, f in zip(base, free, strict=True)}, "right")
    serving = _serving(ckpts["mtp"], kv, True)
    spec = _run(serving, prompts, params)
    assert [r.output for r in spec] == [r.output for r in base]
    assert [r.finish_reason for r in spec] == [r.finish_reason for r in base]
    assert spec[0].finish_reason == {"type": "stop", "matched": stop_token}
    assert spec[1].finish_reason == {"type": "stop", "matched": stop_str}
    assert spec[2].finish_reason == {"type": "length", "length": 6}
    for r in spec:
        _assert_events(r)
    assert serving.scheduler.speculative.accept_lens.keys() == {Q}  # full windows, cut
    _assert_all_free(serving, kv)


@pytest.mark.parametrize("kv", ["plain", "echo"])
def test_abort_mid_decode(ckpts, monkeypatch, kv):
    prompts = _prompts(3, 3)
    params = [_greedy(20)] * 3
    base = _run(_serving(ckpts["mtp"], kv, False), prompts, params)
    _script(monkeypatch, {r.rid: r.output for r in base})
    serving = _serving(ckpts["mtp"], kv, True)
    sched = serving.scheduler
    reqs = _add(sched, prompts, params)
    while len(reqs[1].output) < 4:
        sched.step()
    assert not reqs[1].finished
    assert sched.abort("1")
    assert reqs[1].finish_reason["type"] == "abort"
    seen = len(reqs[1].events)
    drain(sched)
    assert len(reqs[1].events) == seen  # nothing after its end
    assert reqs[1].output == base[1].output[: len(reqs[1].output)]
    for i in (0, 2):
        assert reqs[i].output == base[i].output
    for r in reqs:
        _assert_events(r)
    _assert_all_free(serving, kv)


def test_preemption_under_speculation_keeps_outputs(ckpts):
    """A pool too small for the running requests' growth: the newest are preempted and recomputed (the
    draft runs over the recomputed sequence again); outputs unchanged, nothing leaks."""
    prompts, params = _prompts(4, 4), [_greedy(12)] * 4
    base = _run(_serving(ckpts["mtp"], "plain", False), prompts, params)
    # The first three fit with one step of growth each, not with all of it.
    pool = max(sum(len(p) + 1 + S for p in prompts[:3]) + 6, max(map(len, prompts)) + 12 + S)
    serving = _serving(ckpts["mtp"], "echo", True, max_total_tokens=pool)
    sched = serving.scheduler
    sched.reserve_steps = 1  # admit greedily, so a round runs out of room
    spec = _run(serving, prompts, params)
    assert [r.output for r in spec] == [r.output for r in base]
    assert sched.stats.preemptions > 0
    for r in spec:
        _assert_events(r)
    _assert_all_free(serving, "echo")


# ------------------------------------------------------------------ start-up refusals
def test_no_nextn_layer_is_refused(ckpts):
    with pytest.raises(ServerArgError) as refused:
        _serving(ckpts["none"], "plain", True)
    for needle in ("num_nextn_predict_layers = 0", "MTP", "drop --speculative-algorithm"):
        assert needle in str(refused.value)


def test_n_g_too_small_for_q_is_refused(ckpts):
    """One slot under the legal minimum for Q: refused naming the largest batch that fits
    and the N_G needed (the plain decode rule, Q = 1, would have accepted it)."""
    _serving(ckpts["mtp"], "echo", False, n_g=MIN_N_G - 1)  # fine without speculation
    with pytest.raises(ConfigError) as refused:
        _serving(ckpts["mtp"], "echo", True, n_g=MIN_N_G - 1)
    msg = str(refused.value)
    for needle in (
        f"NSA_DEV_CACHE_SIZE={MIN_N_G - 1} (N_G)",
        f"Q {Q} query tokens",
        f"largest batch that fits is {RUNNING - 1} (lower --max-running-requests to {RUNNING - 1})",
        f"NSA_DEV_CACHE_SIZE >= {MIN_N_G} for a batch of {RUNNING}",
    ):
        assert needle in msg, (needle, msg)


def test_default_max_running_fits_the_rule_with_q(ckpts):
    """Without --max-running-requests, ECHO's default is capped by the rule with Q."""
    serving = make_serving(
        ckpts["mtp"],
        EchoConfig(offload=True, dev_cache_size=MIN_N_G),
        max_total_tokens=POOL,
        chunked_prefill_size=CHUNK,
        context_length=CONTEXT,
        speculative_algorithm="EAGLE",
        speculative_num_steps=S,
    )
    assert serving.info["max_running_requests"] == RUNNING
    assert serving.info["speculative_algorithm"] == "NEXTN"


@pytest.mark.parametrize(
    ("flags", "needles"),
    [
        (["--speculative-num-steps", "4"], ["--speculative-num-steps 4", "1 to 3"]),
        (["--speculative-eagle-topk", "2"], ["tree drafts are not supported"]),
        (["--speculative-num-draft-tokens", "5"], ["Q must be S + 1"]),
        (["--enable-hisparse"], ["--enable-hisparse", "plain pool and ECHO only"]),
        (["--speculative-draft-model-path", "d"], ["own MTP (NextN) layer"]),
    ],
    ids=["num-steps", "topk", "draft-tokens", "hisparse", "draft-model"],
)
def test_flag_refusals(flags, needles):
    argv = ["--model-path", "m", "--speculative-algorithm", "NEXTN", *flags]
    with pytest.raises(ServerArgError) as refused:
        parse_server_args(argv)
    for needle in needles:
        assert needle in str(refused.value), (needle, str(refused.value))


def test_flags_need_the_algorithm_and_parse(ckpts, capsys):
    with pytest.raises(ServerArgError, match="needs --speculative-algorithm NEXTN"):
        parse_server_args(["--model-path", "m", "--speculative-num-steps", "2"])
    args = parse_server_args(
        [
            *("--model-path", "m", "--speculative-algorithm", "EAGLE"),
            *("--speculative-num-steps", "3", "--speculative-eagle-topk", "1"),
            *("--speculative-num-draft-tokens", "4"),
        ]
    )
    assert args.speculative_algorithm == "EAGLE" and args.speculative_num_steps == 3
    argv = ["--model-path", str(ckpts["mtp"]), "--speculative-algorithm", "NEXTN"]
    assert launch_main([*argv, "--speculative-num-steps", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --speculative-num-steps 0") and "Traceback" not in err
