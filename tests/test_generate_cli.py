"""End-to-end tests of ``python -m sglang_echo.generate`` on a tiny random checkpoint.

The CLI is called in-process through ``sglang_echo.generate.main`` (it returns the exit
code and prints ``error: ...`` to stderr); only ``--help`` goes through a subprocess.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scripts.make_tiny_checkpoint import TinySpec, make_tiny_checkpoint
from sglang_echo.generate import main
from sglang_echo.tokenizer import load_tokenizer

SPEC = TinySpec(
    seed=0,
    layers=2,
    dense_layers=1,
    hidden=32,
    heads=2,
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
    intermediate=32,
    moe_intermediate=16,
    experts=4,
    experts_per_tok=2,
    n_group=2,
    topk_group=1,
    index_heads=2,
    index_dim=16,
    index_topk=4,
    max_position=256,
)
BATCH = 2
CHUNK = 8
# Smallest legal NSA_DEV_CACHE_SIZE for BATCH and CHUNK (the host pool is larger than CHUNK).
MIN_DEV_CACHE = max(BATCH * SPEC.index_topk, CHUNK)
ENV_VARS = (
    "NSA_KV_OFFLOAD",
    "NSA_DEV_CACHE_SIZE",
    "SGLANG_NSA_FUSE_LOGITS_RECALL_DECODE",
    "SGLANG_NSA_FUSE_LOGITS_RECALL_EXTEND",
)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_ckpt"), SPEC)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner's own environment must not switch ECHO on or off behind a test's back."""
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]):
    """Run the CLI in-process; returns (exit code, stderr)."""

    def run(*argv: str) -> tuple[int, str]:
        capsys.readouterr()  # drop anything printed before
        rc = main(["--quiet", "--device", "cpu", *argv])
        return rc, capsys.readouterr().err

    return run


def write_prompts(path: Path, records: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture
def good_prompts(tmp_path: Path) -> Path:
    return write_prompts(tmp_path / "good.jsonl", [{"input_ids": [5, 6, 7]}])


def base_args(model: Path | str, prompts: Path, out: Path, new_tokens: int = 2) -> list[str]:
    return [
        "--model-path",
        str(model),
        "--prompts-file",
        str(prompts),
        "--max-new-tokens",
        str(new_tokens),
        "--output",
        str(out),
    ]


def assert_error(rc: int, err: str, *needles: str) -> None:
    assert rc == 2, err
    assert err.startswith("error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, f"{needle!r} not in {err!r}"


# ----------------------------------------------------------------------------- help


def test_help_mentions_offload_switch() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "sglang_echo.generate", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k not in ENV_VARS},
    )
    assert proc.returncode == 0, proc.stderr
    assert "NSA_KV_OFFLOAD" in proc.stdout
    assert "NSA_DEV_CACHE_SIZE" in proc.stdout
    for flag in ("--model-path", "--prompts-file", "--max-new-tokens", "--output"):
        assert flag in proc.stdout


# ------------------------------------------------------------------------ model path


def test_model_path_missing(cli, tmp_path: Path, good_prompts: Path) -> None:
    missing = tmp_path / "no_such_model"
    rc, err = cli(*base_args(missing, good_prompts, tmp_path / "out.jsonl"))
    assert_error(rc, err, str(missing), "does not exist")
    assert not (tmp_path / "out.jsonl").exists()


def test_model_path_is_a_file(cli, tmp_path: Path, good_prompts: Path) -> None:
    rc, err = cli(*base_args(good_prompts, good_prompts, tmp_path / "out.jsonl"))
    assert_error(rc, err, "is not a directory")


def test_model_dir_without_config(cli, tmp_path: Path, good_prompts: Path) -> None:
    empty = tmp_path / "empty_model"
    empty.mkdir()
    rc, err = cli(*base_args(empty, good_prompts, tmp_path / "out.jsonl"))
    assert_error(rc, err, "has no config.json")


def test_model_dir_with_llama_config(cli, tmp_path: Path, good_prompts: Path) -> None:
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
                "vocab_size": 32000,
                "hidden_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
            }
        )
    )
    rc, err = cli(*base_args(llama, good_prompts, tmp_path / "out.jsonl"))
    assert_error(rc, err, "'llama'", "LlamaForCausalLM", "is not a DeepSeek-V3.2", "deepseek_v32")


def test_model_dir_without_weights(
    cli, tmp_path: Path, good_prompts: Path, checkpoint: Path
) -> None:
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(checkpoint / "config.json", no_weights / "config.json")
    rc, err = cli(*base_args(no_weights, good_prompts, tmp_path / "out.jsonl"))
    assert_error(rc, err, "no *.safetensors")


# ---------------------------------------------------------------------- prompts file


def test_prompt_longer_than_context(cli, tmp_path: Path, checkpoint: Path) -> None:
    prompts = tmp_path / "long.jsonl"
    long_prompt = json.dumps({"input_ids": list(range(3, 23))})  # 20 tokens
    # Line 2 is blank: the reported line number must still be the file's line 3.
    prompts.write_text(json.dumps({"input_ids": [5, 6]}) + "\n\n" + long_prompt + "\n")
    rc, err = cli(*base_args(checkpoint, prompts, tmp_path / "out.jsonl"), "--context-length", "16")
    assert_error(rc, err, f"{prompts}:3", "20 tokens", "context limit of 16")
    assert not (tmp_path / "out.jsonl").exists()


def test_prompt_fits_context_exactly(cli, tmp_path: Path, checkpoint: Path) -> None:
    # 14 prompt tokens + 2 new tokens == context length 16: allowed.
    prompts = write_prompts(tmp_path / "p.jsonl", [{"input_ids": list(range(3, 17))}])
    rc, err = cli(*base_args(checkpoint, prompts, tmp_path / "out.jsonl"), "--context-length", "16")
    assert rc == 0, err
    # One token more no longer fits.
    write_prompts(prompts, [{"input_ids": list(range(3, 18))}])
    rc, err = cli(*base_args(checkpoint, prompts, tmp_path / "out.jsonl"), "--context-length", "16")
    assert_error(rc, err, f"{prompts}:1", "context limit of 16")


@pytest.mark.parametrize("bad_id", [SPEC.vocab_size, 100000, -1])
def test_token_id_outside_vocabulary(cli, tmp_path: Path, checkpoint: Path, bad_id: int) -> None:
    prompts = write_prompts(
        tmp_path / "p.jsonl", [{"input_ids": [5, 6]}, {"input_ids": [5, bad_id, 7]}]
    )
    rc, err = cli(*base_args(checkpoint, prompts, tmp_path / "out.jsonl"))
    assert_error(
        rc,
        err,
        f"{prompts}:2",
        f"token id {bad_id}",
        f"outside the vocabulary [0, {SPEC.vocab_size})",
    )


@pytest.mark.parametrize("content", ["", "\n\n   \n\t\n"], ids=["zero_bytes", "blank_lines"])
def test_prompts_file_without_prompts(cli, tmp_path: Path, checkpoint: Path, content: str) -> None:
    prompts = tmp_path / "empty.jsonl"
    prompts.write_text(content)
    rc, err = cli(*base_args(checkpoint, prompts, tmp_path / "out.jsonl"))
    assert_error(rc, err, "holds no prompts", str(prompts))


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ('{"input_ids": [5, 6]', "not valid JSON"),
        ("not json at all", "not valid JSON"),
        ("[5, 6, 7]", "expected a JSON object"),
        ('{"ids": [5, 6]}', "needs 'input_ids' (list of ints) or 'text' (string)"),
        ('{"input_ids": []}', "the prompt is empty"),
        ('{"text": ""}', "the prompt is empty"),
        ('{"input_ids": [5, 1.5]}', "'input_ids' must be a list of integers"),
        ('{"input_ids": [5, true]}', "'input_ids' must be a list of integers"),
        ('{"input_ids": "5 6"}', "'input_ids' must be a list of integers"),
        ('{"text": 42}', "'text' must be a string"),
    ],
    ids=[
        "truncated_json",
        "not_json",
        "json_array",
        "no_ids_or_text",
        "empty_input_ids",
        "empty_text",
        "float_id",
        "bool_id",
        "ids_not_list",
        "text_not_string",
    ],
)
def test_malformed_prompt_line(
    cli, tmp_path: Path, checkpoint: Path, line: str, needle: str
) -> None:
    prompts = tmp_path / "bad.jsonl"
    prompts.write_text(json.dumps({"input_ids": [5]}) + "\n" + line + "\n")
    rc, err = cli(*base_args(checkpoint, prompts, tmp_path / "out.jsonl"))
    assert_error(rc, err, f"{prompts}:2", needle)


def test_text_prompt_without_tokenizer(cli, tmp_path: Path, checkpoint: Path) -> None:
    bare = tmp_path / "no_tokenizer"
    bare.mkdir()
    for name in ("config.json", *(p.name for p in checkpoint.glob("*.safetensors"))):
        shutil.copy(checkpoint / name, bare / name)
    prompts = write_prompts(tmp_path / "p.jsonl", [{"text": "hi"}])
    rc, err = cli(*base_args(bare, prompts, tmp_path / "out.jsonl"))
    assert_error(rc, err, f"{prompts}:1", "no tokenizer.json")


def test_prompts_file_missing(cli, tmp_path: Path, checkpoint: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    rc, err = cli(*base_args(checkpoint, missing, tmp_path / "out.jsonl"))
    assert_error(rc, err, "cannot read prompts file", str(missing), "No such file")


def test_prompts_file_is_a_directory(cli, tmp_path: Path, checkpoint: Path) -> None:
    rc, err = cli(*base_args(checkpoint, tmp_path, tmp_path / "out.jsonl"))
    assert_error(rc, err, "cannot read prompts file", str(tmp_path))


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root reads any file")
def test_prompts_file_unreadable(cli, tmp_path: Path, checkpoint: Path) -> None:
    prompts = write_prompts(tmp_path / "p.jsonl", [{"input_ids": [5]}])
    prompts.chmod(0)
    try:
        rc, err = cli(*base_args(checkpoint, prompts, tmp_path / "out.jsonl"))
    finally:
        prompts.chmod(0o644)
    assert_error(rc, err, "cannot read prompts file", "Permission denied")


def test_prompts_file_not_utf8(cli, tmp_path: Path, checkpoint: Path) -> None:
    prompts = tmp_path / "latin1.jsonl"
    prompts.write_bytes(b'\xff\xfe{"input_ids": [5]}\n')
    rc, err = cli(*base_args(checkpoint, prompts, tmp_path / "out.jsonl"))
    assert_error(rc, err, str(prompts), "not UTF-8")


# ----------------------------------------------------------------------- numeric flags


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--max-new-tokens", "0"),
        ("--max-new-tokens", "-3"),
        ("--batch-size", "0"),
        ("--chunked-prefill-size", "0"),
        ("--context-length", "0"),
        ("--max-total-tokens", "0"),
    ],
)
def test_non_positive_flag(
    cli, tmp_path: Path, checkpoint: Path, good_prompts: Path, flag: str, value: str
) -> None:
    args = base_args(checkpoint, good_prompts, tmp_path / "out.jsonl")
    args += [flag, value]  # argparse keeps the last occurrence
    rc, err = cli(*args)
    assert_error(rc, err, f"{flag} must be >= 1, got {value}")
    assert not (tmp_path / "out.jsonl").exists()


def test_max_total_tokens_too_small(cli, tmp_path: Path, checkpoint: Path) -> None:
    prompts = write_prompts(tmp_path / "p.jsonl", [{"input_ids": list(range(3, 13))}])
    rc, err = cli(
        *base_args(checkpoint, prompts, tmp_path / "out.jsonl", 4), "--max-total-tokens", "13"
    )
    assert_error(rc, err, "--max-total-tokens 13", "longest request (14 tokens")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda(
    cli, tmp_path: Path, checkpoint: Path, good_prompts: Path
) -> None:
    rc, err = cli(*base_args(checkpoint, good_prompts, tmp_path / "out.jsonl"), "--device", "cuda")
    assert_error(rc, err, "--device cuda", "no CUDA device")


# ------------------------------------------------------------------- ECHO environment


def test_dev_cache_too_small(
    cli, tmp_path: Path, checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = write_prompts(tmp_path / "p.jsonl", [{"input_ids": list(range(3, 20))}] * 3)
    monkeypatch.setenv("NSA_KV_OFFLOAD", "1")
    for size in (3, MIN_DEV_CACHE - 1):
        monkeypatch.setenv("NSA_DEV_CACHE_SIZE", str(size))
        rc, err = cli(
            *base_args(checkpoint, prompts, tmp_path / "out.jsonl"),
            "--batch-size",
            str(BATCH),
            "--chunked-prefill-size",
            str(CHUNK),
        )
        assert_error(
            rc,
            err,
            f"NSA_DEV_CACHE_SIZE={size} is too small",
            f"NSA_DEV_CACHE_SIZE >= {MIN_DEV_CACHE}",
        )
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ("abc", "NSA_DEV_CACHE_SIZE='abc' is not a whole number"),
        ("-5", "NSA_DEV_CACHE_SIZE='-5' is not a whole number"),
        ("0", "NSA_DEV_CACHE_SIZE must be > 0"),
        ("1.5", "NSA_DEV_CACHE_SIZE='1.5' is not a whole number"),
    ],
)
def test_dev_cache_size_not_a_size(
    cli,
    tmp_path: Path,
    checkpoint: Path,
    good_prompts: Path,
    monkeypatch: pytest.MonkeyPatch,
    raw: str,
    needle: str,
) -> None:
    monkeypatch.setenv("NSA_KV_OFFLOAD", "1")
    monkeypatch.setenv("NSA_DEV_CACHE_SIZE", raw)
    rc, err = cli(*base_args(checkpoint, good_prompts, tmp_path / "out.jsonl"))
    assert_error(rc, err, needle)


@pytest.mark.parametrize("raw", ["yes", "true", "2"])
def test_offload_flag_not_understood(
    cli,
    tmp_path: Path,
    checkpoint: Path,
    good_prompts: Path,
    monkeypatch: pytest.MonkeyPatch,
    raw: str,
) -> None:
    monkeypatch.setenv("NSA_KV_OFFLOAD", raw)
    rc, err = cli(*base_args(checkpoint, good_prompts, tmp_path / "out.jsonl"))
    assert_error(rc, err, f"NSA_KV_OFFLOAD={raw!r} is not understood", "1 (on) or 0 (off)")


# --------------------------------------------------------------------------- success


MIXED_PROMPTS: list[dict] = [
    {"input_ids": [(7 * i + 3) % 256 + 3 for i in range(23)]},
    {"text": "The quick brown fox"},
    {"input_ids": [42]},
    {"input_ids": [(5 * i + 11) % 256 + 3 for i in range(9)]},
    {"text": "héllo, wörld ✓"},
]
NEW_TOKENS = 6


def expected_prompt_ids(checkpoint: Path) -> list[list[int]]:
    tok = load_tokenizer(checkpoint)
    assert tok is not None
    return [
        r["input_ids"] if "input_ids" in r else tok.encode(r["text"]).ids for r in MIXED_PROMPTS
    ]


def run_mixed(cli, tmp_path: Path, checkpoint: Path, out: Path) -> tuple[int, str]:
    prompts = tmp_path / "mixed.jsonl"
    # Blank lines between prompts are skipped.
    prompts.write_text("\n".join(json.dumps(r) for r in MIXED_PROMPTS) + "\n\n")
    return cli(
        *base_args(checkpoint, prompts, out, NEW_TOKENS),
        "--ignore-eos",
        "--batch-size",
        str(BATCH),
        "--chunked-prefill-size",
        str(CHUNK),
    )


def test_generate_success(cli, tmp_path: Path, checkpoint: Path) -> None:
    out = tmp_path / "nested" / "dir" / "out.jsonl"  # parent folders are created
    rc, err = run_mixed(cli, tmp_path, checkpoint, out)
    assert rc == 0, err
    assert "error" not in err
    records = [json.loads(line) for line in out.read_text().splitlines()]
    want = expected_prompt_ids(checkpoint)
    assert len(records) == len(MIXED_PROMPTS)
    # Text prompts were tokenized byte-wise: more than one id for a multi-byte string.
    assert len(want[1]) == len(MIXED_PROMPTS[1]["text"])
    assert len(want[4]) > len(MIXED_PROMPTS[4]["text"])
    tok = load_tokenizer(checkpoint)
    for record, ids in zip(records, want, strict=True):
        assert record["input_ids"] == ids  # input order is preserved
        assert len(record["output_ids"]) == NEW_TOKENS
        assert all(0 <= t < SPEC.vocab_size for t in record["output_ids"])
        assert record["text"] == tok.decode(record["output_ids"])
    assert re.search(rf"requests {len(MIXED_PROMPTS)}\b", err)
    assert f"prompt tokens {sum(map(len, want))}" in err
    assert f"output tokens {len(MIXED_PROMPTS) * NEW_TOKENS}" in err
    assert "tok/s" in err
    assert "kv: no-offload" in err


def test_generate_is_deterministic_and_batch_independent(
    cli, tmp_path: Path, checkpoint: Path
) -> None:
    rc, err = run_mixed(cli, tmp_path, checkpoint, tmp_path / "a.jsonl")
    assert rc == 0, err
    prompts = tmp_path / "mixed.jsonl"
    rc, err = cli(
        *base_args(checkpoint, prompts, tmp_path / "b.jsonl", NEW_TOKENS),
        "--ignore-eos",
        "--batch-size",
        "1",
    )
    assert rc == 0, err
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()


def test_echo_offload_matches_no_offload(
    cli, tmp_path: Path, checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain, echo = tmp_path / "plain.jsonl", tmp_path / "echo.jsonl"
    rc, err = run_mixed(cli, tmp_path, checkpoint, plain)
    assert rc == 0, err
    assert "hit rate per layer" not in err

    monkeypatch.setenv("NSA_KV_OFFLOAD", "1")
    monkeypatch.setenv("NSA_DEV_CACHE_SIZE", str(MIN_DEV_CACHE))
    rc, err = run_mixed(cli, tmp_path, checkpoint, echo)
    assert rc == 0, err
    assert echo.read_bytes() == plain.read_bytes()
    assert "kv: ECHO" in err
    assert f"({MIN_DEV_CACHE} slots/layer)" in err
    rates = re.search(r"hit rate per layer: (.*)", err)
    assert rates is not None, err
    values = [float(v) for v in rates.group(1).split()]
    assert len(values) == SPEC.layers
    assert all(0.0 <= v <= 1.0 for v in values)
    # The device cache was really under pressure, so equality above is not trivial.
    evictions = re.search(r"evictions (\d+)", err)
    assert evictions is not None and int(evictions.group(1)) > 0, err


def test_context_length_above_model_limit(cli, tmp_path: Path, checkpoint: Path) -> None:
    prompts = write_prompts(tmp_path / "p.jsonl", [{"input_ids": [5, 6]}])
    rc, err = cli(
        *base_args(checkpoint, prompts, tmp_path / "out.jsonl"), "--context-length", "10000000"
    )
    assert_error(rc, err, "max_position_embeddings")
