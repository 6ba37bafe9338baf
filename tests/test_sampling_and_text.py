"""The batch sampler and the incremental detokenizer, without a model.

Sampling: a pure function of (request key, output index, logits), so batch composition
cannot change a request's tokens; it follows the distribution; top-k/top-p exclude what
they should; non-finite rows are flagged instead of raising. Text: one token at a time
equals decoding everything at once, stop strings are found across token boundaries and
cut, and the streamed text never holds part of a stop string.
"""

from __future__ import annotations

import random

import pytest
import torch

from sglang_echo.runtime.detokenizer import IncrementalText
from sglang_echo.runtime.request import SamplingParams
from sglang_echo.runtime.sampling import race_uniforms, sample_batch
from sglang_echo.tokenizer import build_byte_tokenizer


def _params(**kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=8, **kw)


def test_race_uniforms_are_a_pure_function_in_the_open_interval():
    keys = torch.tensor([0, 1, -5, 2**62], dtype=torch.int64)
    counters = torch.tensor([0, 0, 7, 3], dtype=torch.int64)
    u = race_uniforms(keys, counters, 1000)
    assert u.dtype == torch.float32 and u.shape == (4, 1000)
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    assert torch.equal(u, race_uniforms(keys, counters, 1000))
    # Rows differ by key and by counter; row 0 alone gives row 0 of the batch.
    assert not torch.equal(u[0], u[1])
    assert torch.equal(race_uniforms(keys[:1], counters[:1], 1000)[0], u[0])
    assert abs(float(u.mean()) - 0.5) < 0.02


def test_sampled_token_does_not_depend_on_the_batch():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 300, generator=gen)
    params = [_params(temperature=0.8, top_p=0.9, top_k=40) for _ in range(5)]
    keys = [11, 12, 13, 2**64 - 1, 2**63]
    counters = [0, 4, 9, 2, 5]
    whole = sample_batch(logits, params, keys, counters).tokens
    for i in range(5):
        alone = sample_batch(
            logits[i : i + 1], params[i : i + 1], keys[i : i + 1], counters[i : i + 1]
        )
        assert alone.tokens == [whole[i]]
    # Mixed with greedy rows: the sampled rows keep their tokens.
    mixed = [_params(temperature=0.0), *params[1:]]
    got = sample_batch(logits, mixed, keys, counters).tokens
    assert got[1:] == whole[1:] and got[0] == int(torch.argmax(logits[0]))


def test_samples_follow_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(4000, 4).contiguous()
    out = sample_batch(logits, [_params(temperature=1.0)] * 4000, [7] * 4000, list(range(4000)))
    freq = torch.bincount(torch.tensor(out.tokens), minlength=4).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03), freq


def test_top_k_and_top_p_exclude_the_tail():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).expand(500, 5).contiguous()
    top_k = sample_batch(logits, [_params(top_k=2)] * 500, [1] * 500, list(range(500)))
    assert set(top_k.tokens) == {0, 1}
    # Softmax of the row: 0.64, 0.24, 0.09, ...: top_p 0.7 keeps the first two.
    top_p = sample_batch(logits, [_params(top_p=0.7)] * 500, [2] * 500, list(range(500)))
    assert set(top_p.tokens) == {0, 1}


def test_tiny_temperature_is_greedy_and_non_finite_rows_are_flagged():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(3))
    logits[2, 7] = float("nan")
    params = [_params(temperature=1e-320), _params(temperature=1e-6), _params(temperature=1.0)]
    out = sample_batch(logits, params, [1, 2, 3], [0, 0, 0])
    assert out.tokens[:2] == torch.argmax(logits[:2], dim=-1).tolist()
    assert out.finite == [True, True, False]


def test_logprobs_are_log_softmax_of_the_logits():
    logits = torch.randn(2, 40, generator=torch.Generator().manual_seed(5))
    params = [_params(temperature=0.0, logprobs=True, top_logprobs=3), _params(temperature=0.0)]
    out = sample_batch(logits, params, [0, 0], [0, 0])
    lsm = torch.log_softmax(logits[0], dim=-1)
    lp = out.logprobs[0]
    assert lp.token_id == out.tokens[0]
    assert lp.logprob == pytest.approx(float(lsm[lp.token_id]), abs=1e-6)
    assert [t for t, _ in lp.top] == torch.topk(lsm, 3).indices.tolist()
    assert out.logprobs[1] is None


# ----------------------------------------------------------------------- text
@pytest.fixture(scope="module")
def tok():
    return build_byte_tokenizer()


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text).ids


@pytest.mark.parametrize("text", ["hello world", "naïve café — ünïcödé ✓ 日本語", "a\nb\tc  "])
def test_incremental_text_equals_full_decode(tok, text):
    inc = IncrementalText(tok.decode)
    streamed = ""
    for t in _ids(tok, text):
        assert inc.push(t) is None
        streamed += inc.take_stream_delta(final=False)
        assert "\ufffd" not in streamed  # partial UTF-8 sequences are held back
    inc.finish()
    streamed += inc.take_stream_delta(final=True)
    assert streamed == inc.text == tok.decode(_ids(tok, text)) == text


def test_stop_string_across_tokens_is_cut_and_never_streamed(tok):
    text = "the stress and the sea"
    inc = IncrementalText(tok.decode, ["e se", "zz"])
    streamed, matched = "", None
    for t in _ids(tok, text):
        matched = inc.push(t)
        streamed += inc.take_stream_delta(final=matched is not None)
        if matched:
            break
    assert matched == "e se"
    assert inc.text == "the stress and th"
    assert streamed == inc.text  # nothing of the stop string went out, then all the rest


def test_earliest_stop_wins_and_random_texts_match_a_plain_search(tok):
    rng = random.Random(0)
    for _ in range(50):
        text = "".join(rng.choice("abc ") for _ in range(40))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 3))) for _ in range(2)]
        inc = IncrementalText(tok.decode, stops)
        streamed = ""
        for t in _ids(tok, text):
            m = inc.push(t)
            streamed += inc.take_stream_delta(final=m is not None)
            if m:
                break
        hits = [(text.find(s), s) for s in stops if s in text]
        if hits:
            # The first stop completed while reading left to right ends the text.
            end = min(text.find(s) + len(s) for s in stops if s in text)
            cut = min(text.find(s) for s in stops if s in text[:end])
            assert inc.text == text[:cut] and streamed == inc.text
        else:
            inc.finish()
            assert inc.text == text
