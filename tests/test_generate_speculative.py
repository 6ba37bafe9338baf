"""MTP speculative decoding behind ``python -m sglang_echo.generate`` (SGLang's
``--speculative-*`` flags) on a tiny random checkpoint with one NextN layer: the same
output ids as plain greedy generation, with the plain pool and with ECHO under eviction
pressure; seeded sampling (``--temperature``/``--seed``) equal to seeded non-speculative
generation token for token; the statistics in the summary; EAGLE as NEXTN's alias; the
capacity rule with Q = S + 1 at start-up; and the refusals.

The CLI is called in-process, as in tests/test_generate_cli.py.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from scripts.make_tiny_checkpoint import make_tiny_checkpoint
from sglang_echo.config import ConfigError, dev_cache_for
from sglang_echo.generate import InputError, build_parser, main, run
from spec_drafts import script_generator_drafts
from test_generate_cli import SPEC as CLI_SPEC

# The CLI tests' tiny model, with one NextN (MTP) layer.
SPEC = replace(CLI_SPEC, seed=3, num_nextn_predict_layers=1)
BATCH, CHUNK, NEW = 2, 8, 7
STEPS = 2  # S; a verify has Q = S + 1 query tokens per request
# Smallest legal NSA_DEV_CACHE_SIZE under speculation: one verify step's selections
# (BATCH x Q x top-k, the rule with Q) and one prefill chunk.
MIN_DEV_CACHE = max(dev_cache_for(BATCH, SPEC.index_topk, queries_per_request=STEPS + 1), CHUNK)
ENV_VARS = (
    "NSA_KV_OFFLOAD",
    "NSA_DEV_CACHE_SIZE",
    "SGLANG_NSA_FUSE_LOGITS_RECALL_DECODE",
    "SGLANG_NSA_FUSE_LOGITS_RECALL_EXTEND",
)
PROMPTS = [
    [(7 * i + 3) % 250 + 3 for i in range(23)],
    [(5 * i + 11) % 250 + 3 for i in range(9)],
    [42],
    [(3 * i + 1) % 250 + 3 for i in range(17)],
    [(11 * i + 5) % 250 + 3 for i in range(30)],
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spec_ckpt")
    return {
        "mtp": make_tiny_checkpoint(root / "mtp", SPEC),
        "none": make_tiny_checkpoint(root / "none", replace(SPEC, num_nextn_predict_layers=0)),
    }


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("spec_prompts") / "p.jsonl"
    path.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in PROMPTS))
    return path


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)


def _argv(model: Path, prompts: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--quiet",
        "--device",
        "cpu",
        "--model-path",
        str(model),
        "--prompts-file",
        str(prompts),
        "--max-new-tokens",
        str(NEW),
        "--output",
        str(out),
        "--ignore-eos",
        "--batch-size",
        str(BATCH),
        "--chunked-prefill-size",
        str(CHUNK),
        *extra,
    ]


def _generate(model: Path, prompts: Path, out: Path, *extra: str) -> tuple[list, dict]:
    """(output ids per prompt, the summary) of one in-process run."""
    summary = run(build_parser().parse_args(_argv(model, prompts, out, *extra)))
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["input_ids"] for r in records] == PROMPTS  # input order
    return [r["output_ids"] for r in records], summary


@pytest.mark.parametrize("kv", ["plain", "echo"])
def test_speculative_output_equals_greedy(
    checkpoints, prompts_file, tmp_path, monkeypatch, capsys, kv
) -> None:
    if kv == "echo":
        monkeypatch.setenv("NSA_KV_OFFLOAD", "1")
        monkeypatch.setenv("NSA_DEV_CACHE_SIZE", str(MIN_DEV_CACHE))
    model = checkpoints["mtp"]
    plain_out, plain_summary = _generate(model, prompts_file, tmp_path / "plain.jsonl")
    assert "speculative" not in plain_summary
    capsys.readouterr()
    spec_out, summary = _generate(
        model,
        prompts_file,
        tmp_path / "spec.jsonl",
        "--speculative-algorithm",
        "NEXTN",
        "--speculative-num-steps",
        str(STEPS),
    )
    err = capsys.readouterr().err
    assert spec_out == plain_out
    assert all(len(o) == NEW for o in spec_out)
    assert (tmp_path / "spec.jsonl").read_bytes() == (tmp_path / "plain.jsonl").read_bytes()
    spec = summary["speculative"]
    assert spec["algorithm"] == "NEXTN"
    assert spec["num_steps"] == 2 and spec["num_draft_tokens"] == 3
    assert spec["rounds"] >= (NEW - 1) * len(PROMPTS) / 3  # a round commits at most 3
    assert 1.0 <= spec["accept_length"] <= 3.0
    assert summary["output_tokens"] == NEW * len(PROMPTS)
    assert summary["prompt_tokens"] == sum(map(len, PROMPTS))
    assert re.search(r"speculative: NEXTN  steps 2  rounds \d+  accept length [\d.]+", err), err
    if kv == "echo":
        assert summary["kv"]["backend"] == "echo"
        assert sum(summary["kv"]["evictions"]) > 0  # real pressure: equality is not trivial
        assert "kv: ECHO" in err


def test_eagle_is_an_alias_of_nextn(checkpoints, prompts_file, tmp_path) -> None:
    model = checkpoints["mtp"]
    nextn, _ = _generate(
        model, prompts_file, tmp_path / "n.jsonl", "--speculative-algorithm", "NEXTN"
    )
    eagle, summary = _generate(
        model,
        prompts_file,
        tmp_path / "e.jsonl",
        "--speculative-algorithm",
        "EAGLE",
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        "2",
    )
    assert eagle == nextn
    spec = summary["speculative"]
    assert spec["algorithm"] == "NEXTN"
    assert spec["num_steps"] == 1 and spec["num_draft_tokens"] == 2  # the default S
    assert 1.0 <= spec["accept_length"] <= 2.0


@pytest.mark.parametrize(
    ("ckpt", "flags", "needles"),
    [
        (
            "mtp",
            ["--speculative-algorithm", "NEXTN", "--speculative-eagle-topk", "2"],
            ["--speculative-eagle-topk 2", "tree drafts are not supported", "topk 1"],
        ),
        (
            "mtp",
            [
                *("--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2"),
                *("--speculative-num-draft-tokens", "4"),
            ],
            ["--speculative-num-draft-tokens 4", "S + 1", "--speculative-num-draft-tokens 3"],
        ),
        (
            "mtp",
            ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "4"],
            ["--speculative-num-steps 4", "use --speculative-num-steps 1 to 3"],
        ),
        (
            "mtp",
            ["--speculative-num-steps", "2"],
            ["--speculative-num-steps", "needs --speculative-algorithm NEXTN"],
        ),
        (
            "none",
            ["--speculative-algorithm", "NEXTN"],
            ["num_nextn_predict_layers = 0", "MTP", "drop --speculative-algorithm"],
        ),
    ],
    ids=["topk", "draft-tokens", "num-steps", "no-algorithm", "no-nextn-layer"],
)
def test_refusals(checkpoints, prompts_file, tmp_path, capsys, ckpt, flags, needles) -> None:
    out = tmp_path / "out.jsonl"
    capsys.readouterr()
    rc = main(_argv(checkpoints[ckpt], prompts_file, out, *flags))
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("error: ") and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, f"{needle!r} not in {err!r}"
    assert not out.exists()


def test_refusal_is_the_cli_error_type(checkpoints, prompts_file, tmp_path) -> None:
    args = build_parser().parse_args(
        _argv(
            checkpoints["mtp"],
            prompts_file,
            tmp_path / "o.jsonl",
            "--speculative-algorithm",
            "NEXTN",
            "--speculative-eagle-topk",
            "4",
        )
    )
    with pytest.raises(InputError, match="tree drafts"):
        run(args)


def test_help_explains_each_flag() -> None:
    text = " ".join(build_parser().format_help().split())  # lines wrap at any width
    for flag in (
        "--speculative-algorithm",
        "--speculative-num-steps",
        "--speculative-eagle-topk",
        "--speculative-num-draft-tokens",
    ):
        assert flag in text
    assert "EAGLE" in text and "tree drafts are not supported" in text


SAMPLING = ("--temperature", "0.8", "--top-p", "0.9", "--top-k", "40")


def _script_drafts(monkeypatch: pytest.MonkeyPatch, reference: dict[tuple, list[int]]) -> None:
    """Every accept length occurs (tests/spec_drafts.py)."""
    script_generator_drafts(
        monkeypatch, lambda live: reference[tuple(live.seq.prompt)], SPEC.vocab_size
    )


@pytest.mark.parametrize("seed", ["5", "99"])
@pytest.mark.parametrize("kv", ["plain", "echo"])
def test_seeded_speculative_output_equals_seeded_output(
    checkpoints, prompts_file, tmp_path, monkeypatch, kv, seed
) -> None:
    """``--temperature``/``--top-p``/``--top-k``/``--seed`` with NEXTN: the same ids as the
    seeded run without speculation, drafts accepted at every length, ECHO evicting at the
    legal minimum N_G for Q = S + 1."""
    if kv == "echo":
        monkeypatch.setenv("NSA_KV_OFFLOAD", "1")
        monkeypatch.setenv("NSA_DEV_CACHE_SIZE", str(MIN_DEV_CACHE))
    model = checkpoints["mtp"]
    flags = (*SAMPLING, "--seed", seed)
    plain_out, _ = _generate(model, prompts_file, tmp_path / "plain.jsonl", *flags)
    greedy_out, _ = _generate(model, prompts_file, tmp_path / "greedy.jsonl")
    assert plain_out != greedy_out  # sampling is on: the equality below is not greedy's
    _script_drafts(monkeypatch, {tuple(p): o for p, o in zip(PROMPTS, plain_out, strict=True)})
    spec_out, summary = _generate(
        model,
        prompts_file,
        tmp_path / "spec.jsonl",
        *flags,
        *("--speculative-algorithm", "NEXTN", "--speculative-num-steps", str(STEPS)),
    )
    assert spec_out == plain_out
    assert all(len(o) == NEW for o in spec_out)
    assert summary["speculative"]["accept_length"] > 1.0  # drafts were accepted
    if kv == "echo":
        assert sum(summary["kv"]["evictions"]) > 0


def test_a_different_seed_gives_different_output(checkpoints, prompts_file, tmp_path) -> None:
    model = checkpoints["mtp"]
    spec = ("--speculative-algorithm", "NEXTN", "--speculative-num-steps", str(STEPS))
    a, _ = _generate(model, prompts_file, tmp_path / "a.jsonl", *SAMPLING, "--seed", "5", *spec)
    again, _ = _generate(model, prompts_file, tmp_path / "c.jsonl", *SAMPLING, "--seed", "5", *spec)
    b, _ = _generate(model, prompts_file, tmp_path / "b.jsonl", *SAMPLING, "--seed", "6", *spec)
    assert a == again  # seeded: repeatable
    assert a != b


@pytest.mark.parametrize(
    ("dev_cache", "batch", "fits"),
    [(MIN_DEV_CACHE - 1, BATCH, BATCH - 1), (SPEC.index_topk, 1, 0)],
    ids=["one-short", "none-fits"],
)
def test_capacity_rule_with_q_refuses_at_start_up(
    checkpoints, prompts_file, tmp_path, monkeypatch, capsys, dev_cache, batch, fits
) -> None:
    """N_G >= batch x Q x top-k under speculation: one slot short of the legal minimum is
    refused before anything runs, naming N_G, Q, top-k, the largest batch that fits and
    the N_G this batch needs (the plain decode rule alone would have accepted it)."""
    monkeypatch.setenv("NSA_KV_OFFLOAD", "1")
    monkeypatch.setenv("NSA_DEV_CACHE_SIZE", str(dev_cache))
    out = tmp_path / "out.jsonl"
    argv = _argv(checkpoints["mtp"], prompts_file, out, "--speculative-algorithm", "NEXTN")
    argv += ["--speculative-num-steps", str(STEPS), "--batch-size", str(batch)]
    argv += ["--chunked-prefill-size", str(min(CHUNK, dev_cache))]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    need = dev_cache_for(batch, SPEC.index_topk, queries_per_request=STEPS + 1)
    for needle in (
        f"NSA_DEV_CACHE_SIZE={dev_cache} (N_G)",
        f"Q {STEPS + 1} query tokens",
        f"top-k {SPEC.index_topk}",
        f"largest batch that fits is {fits}",
        f"NSA_DEV_CACHE_SIZE >= {need} for a batch of {batch}",
    ):
        assert needle in err, (needle, err)
    assert not out.exists()
    with pytest.raises(ConfigError):
        run(build_parser().parse_args(argv))


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--temperature", "-1"], "--temperature must be in [0, 100]"),
        (["--top-p", "0"], "--top-p must be in (0, 1]"),
        (["--top-k", "0"], "--top-k must be -1 (all) or >= 1"),
    ],
)
def test_bad_sampling_flags_are_refused(checkpoints, prompts_file, tmp_path, flags, needle):
    args = build_parser().parse_args(
        _argv(checkpoints["mtp"], prompts_file, tmp_path / "o.jsonl", *flags)
    )
    with pytest.raises(InputError) as refused:
        run(args)
    assert needle in str(refused.value)
