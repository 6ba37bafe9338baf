"""MTP speculative decoding (runtime/speculative.py): lossless under ECHO (token ids,
every verify's logits and accept lengths equal to the plain pool's, with the device cache
small enough that evictions happen), equal to plain greedy decoding, its accept / stop
rules, with scripted drafts (all wrong, all right); and seeded sampling: speculative output
equal to the scheduler's seeded non-speculative output token for token, with the plain
pool and with ECHO at the legal minimum N_G of the rule with Q (N_G >= batch x Q x top-k)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from scripts.make_tiny_checkpoint import TinySpec, make_tiny_checkpoint
from sglang_echo.config import EchoConfig
from sglang_echo.generate import generate_sampled
from sglang_echo.model.kv_cache import PlainKVCache
from sglang_echo.model.loader import load_model, load_nextn
from sglang_echo.offload.device_cache import ABSENT
from sglang_echo.runtime.engine import Engine
from sglang_echo.runtime.kv_factory import echo_cache_for_model
from sglang_echo.runtime.request import SamplingParams
from sglang_echo.runtime.speculative import SpecRounds, SpeculativeGenerator
from spec_drafts import ReplayingGraphs, script_generator_drafts

SPEC = TinySpec(seed=4, num_nextn_predict_layers=1)  # index_topk 16: sparse past 16 tokens
CHUNK, CONTEXT, NEW = 16, 96, 12
BATCH = 3


def _prompts(seed: int, n: int = BATCH, lengths: tuple[int, int] = (14, 40)) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(3, SPEC.vocab_size) for _ in range(rng.randint(*lengths))] for _ in range(n)
    ]


def _long_prompts() -> list[list[int]]:
    """Prompts whose contexts together pass N_G = B x Q x top-k: evictions happen."""
    return _prompts(0, lengths=(50, 70))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("spec") / "moe", SPEC)
    target = load_model(path)
    return target, load_nextn(path, target=target)


def _capacity(prompts: list[list[int]], new: int) -> int:
    return sum(len(p) + new + 4 for p in prompts)


def _plain(target, prompts, new):
    return PlainKVCache.for_model(target.config, _capacity(prompts, new), torch.float32, "cpu")


def _echo(target, prompts, new, q: int):
    """ECHO at the smallest N_G for BATCH requests of ``q`` query tokens each (a verify
    resolves its B x Q lanes' selections at once: the rule's minimum is also its floor)."""
    n_g = EchoConfig(offload=True).min_dev_cache_size(
        BATCH, target.config.index_topk, CHUNK, queries_per_request=q
    )
    cfg = EchoConfig(offload=True, dev_cache_size=n_g)
    return echo_cache_for_model(cfg, target.config, _capacity(prompts, new), torch.float32, "cpu")


def _speculate(models, cache, prompts, s: int, new: int = NEW, params=None, eos=None):
    target, draft = models
    gen = SpeculativeGenerator(
        target,
        draft,
        cache,
        s,
        _capacity(prompts, new),
        BATCH,
        CONTEXT,
        chunk_size=CHUNK,
        eos_token_ids=eos,
    )
    return gen.generate(prompts, new, params)


@pytest.fixture(scope="module")
def greedy(models):
    """Plain greedy outputs (the offline engine's one-token decode steps), per prompt."""
    target, _ = models
    out = {}
    for prompts in (_prompts(0), _prompts(1), _long_prompts()):
        engine = Engine(
            target, _plain(target, prompts, NEW), _capacity(prompts, NEW), BATCH, CONTEXT, CHUNK
        )
        reqs = engine.generate(prompts, NEW, record_logits=True)
        for p, r in zip(prompts, reqs, strict=True):
            out[tuple(p)] = (list(r.output), r.step_logits)
    return out


def _no_stale_rows(cache) -> None:
    """Every resident device row of ECHO equals its host row (rewritten locations
    included): what a resolve serves is what was last written."""
    c = cache.cache
    for layer in range(c.num_layers):
        d2h = c.device_to_host[layer, 1 : c.num_slots + 1].long()
        slots = torch.nonzero(d2h >= 1).squeeze(1) + 1
        host = cache.host.rows[layer].index_select(0, d2h[slots - 1])
        assert torch.equal(c.rows[layer].index_select(0, slots), host), (
            f"layer {layer}: a resident device row differs from its host row (stale copy)"
        )


@pytest.mark.parametrize("draft", ["nextn", "mixed"])
@pytest.mark.parametrize("s", [1, 2])
def test_echo_mtp_is_bit_identical_to_plain_pool(models, greedy, monkeypatch, s, draft):
    """``nextn``: the real draft (the tiny random NextN layer's drafts are all rejected);
    ``mixed``: scripted drafts right up to a point that moves each round, so windows of
    every accept length are committed and rejected tails are rewritten."""
    prompts = _long_prompts()
    target, _ = models
    if draft == "mixed":
        _scripted(monkeypatch, greedy, "mixed")
    plain = _speculate(models, _plain(target, prompts, NEW), prompts, s)
    echo_cache = _echo(target, prompts, NEW, s + 1)
    resident_rewrites = []
    original = SpeculativeGenerator._round

    def checked_round(self, active, max_new):
        # Rejected tails of the last round that are still resident in layer 0: the verify
        # below rewrites them in place, and must leave no stale device copy.
        h2d = echo_cache.cache.host_to_device[0]
        for live in active:
            tail = torch.tensor(live.seq.locs[live.seq.cached_len :], dtype=torch.int64)
            resident_rewrites.append(int((h2d[tail] != ABSENT).sum()))
        original(self, active, max_new)
        _no_stale_rows(echo_cache)

    monkeypatch.setattr(SpeculativeGenerator, "_round", checked_round)
    echo = _speculate(models, echo_cache, prompts, s)
    assert sum(echo_cache.telemetry()["evictions"]) > 0  # real pressure
    assert sum(resident_rewrites) > 0  # the rewrite-in-place case did occur
    for p, o in zip(plain, echo, strict=True):
        assert o.tokens == p.tokens and o.accept_lens == p.accept_lens
        assert len(o.verify_logits) == len(p.verify_logits)
        assert all(torch.equal(a, b) for a, b in zip(o.verify_logits, p.verify_logits, strict=True))
        assert all(1 <= n <= s + 1 for n in o.accept_lens)
        assert all(v.shape == (s + 1, SPEC.vocab_size) for v in o.verify_logits)
    if draft == "mixed":
        lens = {n for o in echo for n in o.accept_lens}
        assert lens == set(range(1, s + 2)), lens


def _first_difference(ours: list[int], ref: list[int], ref_logits) -> tuple[int, float] | None:
    """(first differing position, relative gap of the reference's top two logits there)."""
    for i, (a, b) in enumerate(zip(ours, ref, strict=False)):
        if a != b:
            top = ref_logits[i].topk(2).values
            return i, float((top[0] - top[1]) / top[0].abs().clamp(min=1e-30))
    return None


@pytest.mark.parametrize("s", [1, 3])
def test_speculative_tokens_equal_plain_greedy(models, greedy, s):
    target, _ = models
    prompts = _prompts(1)
    results = _speculate(models, _plain(target, prompts, NEW), prompts, s)
    for p, r in zip(prompts, results, strict=True):
        ref, ref_logits = greedy[tuple(p)]
        diff = _first_difference(r.tokens, ref, ref_logits)
        # A verify runs B x Q decode lanes where plain decoding runs B: batched matmuls may
        # round differently; a difference is only acceptable at a near tie of the
        # reference's two best candidates.
        assert diff is None or diff[1] < 1e-4, f"first difference at {diff}"
        if diff is None:
            assert r.tokens == ref
        # Accepted rows of the verifies against the decode steps' logits: close, not
        # bit-equal (other batch sizes, other roundings).
        at = 1  # the prefill's token is output 0
        for rows, n in zip(r.verify_logits, r.accept_lens, strict=True):
            for j in range(min(n, len(ref_logits) - at)):
                assert torch.allclose(rows[j], ref_logits[at + j], atol=1e-4, rtol=0)
            at += n
        assert all(1 <= n <= s + 1 for n in r.accept_lens)


def _scripted(monkeypatch, greedy, mode: str) -> None:
    """Drafts replaced by plain greedy's next tokens (``right``), by other tokens
    (``wrong``), or right for the first few only, a count that cycles with the rounds
    (``mixed``); the real draft still runs, so its pool is written as usual."""
    original = SpeculativeGenerator._draft

    def scripted(self, active):
        drafts = original(self, active)
        out = []
        for live, d in zip(active, drafts, strict=True):
            ref, _ = greedy[tuple(live.seq.prompt)]
            at = len(live.result.tokens)
            right = [ref[min(at + j, len(ref) - 1)] for j in range(len(d))]
            keep = {
                "right": len(d),
                "wrong": 0,
                "mixed": len(live.result.accept_lens) % (len(d) + 1),
            }[mode]
            out.append(right[:keep] + [(t + 1) % SPEC.vocab_size for t in right[keep:]])
        return out

    monkeypatch.setattr(SpeculativeGenerator, "_draft", scripted)


@pytest.mark.parametrize("cache", ["plain", "echo"])
def test_rejected_drafts_still_make_progress(models, greedy, monkeypatch, cache):
    target, _ = models
    prompts = _prompts(0)
    _scripted(monkeypatch, greedy, "wrong")
    kv = _plain(target, prompts, NEW) if cache == "plain" else _echo(target, prompts, NEW, 3)
    for p, r in zip(prompts, _speculate(models, kv, prompts, 2), strict=True):
        assert r.accept_lens == [1] * (NEW - 1)  # the prefill gives the first token
        assert r.tokens == greedy[tuple(p)][0]


def test_max_new_tokens_inside_an_accepted_window(models, greedy, monkeypatch):
    target, _ = models
    prompts = _prompts(0)
    _scripted(monkeypatch, greedy, "right")
    new = 6  # 1 from the prefill, a window of 3, then 2 of the next window of 3
    results = _speculate(models, _plain(target, prompts, new), prompts, 2, new)
    for p, r in zip(prompts, results, strict=True):
        assert r.finish_reason == "length" and len(r.tokens) == new
        assert r.accept_lens == [3, 3]
        assert r.tokens == greedy[tuple(p)][0][:new]


# ------------------------------------------------------------------ seeded sampling
SAMPLED = SamplingParams(max_new_tokens=NEW, temperature=0.9, top_p=0.95, top_k=50, ignore_eos=True)
SEEDS = (7, 1234)
# Long enough that BATCH contexts overflow the legal minimum N_G for Q = 3 (BATCH x 3 x 16).
LONG = (50, 70)


@pytest.fixture(scope="module")
def seeded(models):
    """The scheduler's seeded non-speculative outputs (one-token decode steps), per
    (seed, prompt); the same prompts with every seed."""
    target, _ = models
    prompts = _prompts(2, lengths=LONG)
    out = {}
    for seed in SEEDS:
        engine = Engine(
            target, _plain(target, prompts, NEW), _capacity(prompts, NEW), BATCH, CONTEXT, CHUNK
        )
        done = generate_sampled(engine, prompts, replace(SAMPLED, seed=seed))
        for p, r in zip(prompts, done, strict=True):
            out[seed, tuple(p)] = list(r.output)
    return out


def _scripted_from(monkeypatch, reference) -> None:
    """Drafts right (the seeded reference's next tokens) up to a count that cycles with
    the rounds, wrong after it: every accept length occurs (tests/spec_drafts.py)."""
    script_generator_drafts(
        monkeypatch,
        lambda live: reference[live.params.seed, tuple(live.seq.prompt)],
        SPEC.vocab_size,
    )


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("cache", ["plain", "echo"])
def test_seeded_speculative_equals_seeded_decoding(models, seeded, monkeypatch, cache, seed):
    """Each verify position's token is the request's own seeded draw at that output index,
    a draft is kept iff it equals it: the same tokens as plain seeded decoding, with drafts
    accepted at every length, ECHO evicting at the legal minimum N_G for Q = S + 1."""
    target, _ = models
    prompts, s = _prompts(2, lengths=LONG), 2
    _scripted_from(monkeypatch, seeded)
    kv = _plain(target, prompts, NEW) if cache == "plain" else _echo(target, prompts, NEW, s + 1)
    results = _speculate(models, kv, prompts, s, params=replace(SAMPLED, seed=seed), eos=[])
    for p, r in zip(prompts, results, strict=True):
        assert r.tokens == seeded[seed, tuple(p)]
        assert len(r.tokens) == NEW
    assert {n for r in results for n in r.accept_lens} == set(range(1, s + 2))
    if cache == "echo":
        assert sum(kv.telemetry()["evictions"]) > 0  # real pressure


def test_seeded_sampling_is_not_greedy_and_the_seed_matters(models, seeded):
    """The equality above is not trivial: the seeds' outputs differ from each other and
    from greedy, and the speculative path follows the seed it is given."""
    target, _ = models
    prompts = _prompts(2, lengths=LONG)
    a, b = SEEDS
    assert any(seeded[a, tuple(p)] != seeded[b, tuple(p)] for p in prompts)
    greedy_out = _speculate(models, _plain(target, prompts, NEW), prompts, 1, eos=[])
    assert any(g.tokens != seeded[a, tuple(p)] for p, g in zip(prompts, greedy_out, strict=True))
    spec = {
        seed: _speculate(
            models,
            _plain(target, prompts, NEW),
            prompts,
            1,
            params=replace(SAMPLED, seed=seed),
            eos=[],
        )
        for seed in SEEDS
    }
    assert [r.tokens for r in spec[a]] != [r.tokens for r in spec[b]]
    for seed in SEEDS:
        assert [r.tokens for r in spec[seed]] == [seeded[seed, tuple(p)] for p in prompts]


FP8_SPEC = TinySpec(seed=7, layers=2, kv_lora_rank=128, index_topk=8, num_nextn_predict_layers=1)


@pytest.fixture(scope="module")
def fp8_models(tmp_path_factory):
    """A tiny model with a NextN layer whose latent is one fp8 tile wide (kv_lora_rank 128),
    so its KV rows can be stored as fp8."""
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("spec-fp8") / "moe", FP8_SPEC)
    target = load_model(path)
    return target, load_nextn(path, target=target)


@pytest.mark.parametrize("place", [True, False], ids=["placed", "host-only"])
@pytest.mark.parametrize("rows", ["auto", "fp8_e4m3"], ids=["fp32", "fp8"])
def test_echo_mtp_bit_identical_with_fp8_rows_and_without_placement(
    fp8_models, monkeypatch, rows, place
):
    """ECHO + MTP against the plain pool + MTP with the same stored rows (fp32 or fp8),
    with the decoded tokens placed on the device or written to the host only
    (SGLANG_ECHO_DECODE_PLACE=0, where a rewritten rejected position must not leave a
    stale device row), at the legal minimum N_G for Q = 3 (evicting), drafts scripted so
    every accept length is committed: tokens, accept lengths and verify logits equal."""
    target, _ = fp8_models
    s, prompts = 2, _prompts(5, lengths=(30, 40))
    capacity = _capacity(prompts, NEW)

    def plain_pool():
        return PlainKVCache.for_model(
            target.config, capacity, torch.float32, "cpu", kv_cache_dtype=rows
        )

    reference = {  # real drafts (all rejected): the model's own tokens
        tuple(p): r.tokens
        for p, r in zip(prompts, _speculate(fp8_models, plain_pool(), prompts, s), strict=True)
    }
    script_generator_drafts(
        monkeypatch, lambda live: reference[tuple(live.seq.prompt)], FP8_SPEC.vocab_size
    )
    plain = _speculate(fp8_models, plain_pool(), prompts, s)
    n_g = EchoConfig(offload=True).min_dev_cache_size(
        BATCH, target.config.index_topk, CHUNK, queries_per_request=s + 1
    )
    echo_cache = echo_cache_for_model(
        EchoConfig(offload=True, dev_cache_size=n_g, decode_place=place),
        target.config,
        capacity,
        torch.float32,
        "cpu",
        kv_cache_dtype=rows,
    )
    echo = _speculate(fp8_models, echo_cache, prompts, s)
    assert (echo_cache.host.rows.dtype == torch.uint8) == (rows == "fp8_e4m3")
    assert sum(echo_cache.telemetry()["evictions"]) > 0  # real pressure
    assert {n for o in echo for n in o.accept_lens} == set(range(1, s + 2))
    for prompt, p, o in zip(prompts, plain, echo, strict=True):
        assert o.tokens == p.tokens == reference[tuple(prompt)]
        assert o.accept_lens == p.accept_lens
        assert all(torch.equal(a, b) for a, b in zip(o.verify_logits, p.verify_logits, strict=True))
    _no_stale_rows(echo_cache)


@pytest.mark.parametrize("fail", [False, True], ids=["captured", "capture-fails"])
def test_rounds_replayed_from_graphs_equal_eager_rounds(models, greedy, monkeypatch, fail):
    """ECHO + MTP with every round step replayed from a (stand-in) graph equals the plain
    pool replayed the same way (tokens, accept lengths, verify logits) and the eager
    rounds' tokens. Scripted drafts commit windows of every length; a failed capture
    (injected for the verify's lanes) leaves that shape eager, the output unchanged."""
    s = 2
    prompts = _long_prompts()
    target, _ = models
    _scripted(monkeypatch, greedy, "mixed")
    eager = _speculate(models, _plain(target, prompts, NEW), prompts, s)

    def replayed(cache, backend):
        gen = SpeculativeGenerator(
            *models, cache, s, _capacity(prompts, NEW), BATCH, CONTEXT, chunk_size=CHUNK,
            cuda_graphs=True, graph_backend=backend,
        )  # fmt: skip
        return gen, gen.generate(prompts, NEW)

    try:
        _, plain = replayed(_plain(target, prompts, NEW), ReplayingGraphs())
        backend = ReplayingGraphs(fail_lanes=(BATCH * (s + 1),) if fail else ())
        echo_cache = _echo(target, prompts, NEW, s + 1)
        gen, echo = replayed(echo_cache, backend)
    finally:  # the module's other tests run the models eagerly
        for model in models:
            model.set_graph_safe(False)
    graphs = gen.rounds.graphs
    assert backend.replays > 0 and graphs.captures == len(backend.captured)
    # verify (B x Q lanes), draft steps (B lanes), draft over the verified (B x Q, B rows)
    kinds = {(k[0], k[2] > 0) for k in graphs.shapes}
    assert ("draft", False) in kinds and ("draft", True) in kinds
    assert (("verify", False) in kinds) != fail
    assert graphs.capture_failures == (1 if fail else 0)
    for p, o, e in zip(plain, echo, eager, strict=True):
        assert o.tokens == p.tokens == e.tokens and o.accept_lens == p.accept_lens
        assert all(torch.equal(a, b) for a, b in zip(o.verify_logits, p.verify_logits, strict=True))
        # Graphs run the MoE's fixed-shape dispatch (set_graph_safe), eager steps its
        # sparse one: the same experts, summed in another order.
        assert all(
            torch.allclose(a, b, atol=1e-5, rtol=0)
            for a, b in zip(o.verify_logits, e.verify_logits, strict=True)
        )
    _no_stale_rows(echo_cache)


def test_graph_rounds_draft_as_eager_rounds(models, monkeypatch):
    """The draft's own steps from graphs (its step lanes, the draft over the verified
    positions with its rows of logits, the carried states) give the eager rounds' draft
    tokens, round for round: the real NextN draft, no script (the MoE's graph-safe
    dispatch in both)."""
    s = 3
    prompts = _long_prompts()
    target, _ = models
    drafted: list[list[list[int]]] = []
    original = SpecRounds.draft
    monkeypatch.setattr(
        SpecRounds,
        "draft",
        lambda self, lanes: drafted.append(original(self, lanes)) or drafted[-1],
    )

    def run(graphs: bool) -> list[list[list[int]]]:
        drafted.clear()
        gen = SpeculativeGenerator(
            *models, _plain(target, prompts, NEW), s, _capacity(prompts, NEW), BATCH, CONTEXT,
            chunk_size=CHUNK, cuda_graphs=graphs,
            graph_backend=ReplayingGraphs() if graphs else None,
        )  # fmt: skip
        gen.generate(prompts, NEW)
        return list(drafted)

    for model in models:
        model.set_graph_safe(True)
    try:
        eager, replayed = run(False), run(True)
    finally:
        for model in models:
            model.set_graph_safe(False)
    assert len(eager) > 2 and replayed == eager
