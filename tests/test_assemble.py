"""One start-up for both composition roots (issue 51): ``generate.run`` and
``runtime/serving.build_serving`` go through ``runtime/assemble.py``, so a flag one refuses
the other refuses with the same words, each as its own error type."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sglang_echo.config import EchoConfig
from sglang_echo.generate import InputError, build_parser, run
from sglang_echo.model.config import DeepseekV32Config
from sglang_echo.runtime import assemble
from sglang_echo.runtime.server_args import ServerArgError, ServerArgs
from sglang_echo.runtime.serving import build_serving


def _generate(model: Path, tmp_path: Path, *flags: str) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"input_ids": [5, 6]}) + "\n")
    argv = ["--model-path", str(model), "--prompts-file", str(prompts)]
    argv += ["--max-new-tokens", "2", "--output", str(tmp_path / "out.jsonl"), *flags]
    run(build_parser().parse_args(argv))


def _serve(model: Path, **flags) -> None:
    build_serving(ServerArgs(model_path=str(model), **flags), echo=EchoConfig())


def _refusals(small_checkpoint, tmp_path, gen_flags, serve_flags) -> tuple[str, str]:
    with pytest.raises(InputError) as offline:
        _generate(small_checkpoint, tmp_path, *gen_flags)
    with pytest.raises(ServerArgError) as served:
        _serve(small_checkpoint, **serve_flags)
    return str(offline.value), str(served.value)


def test_a_context_past_the_model_is_refused_in_the_same_words(small_checkpoint, tmp_path):
    cfg = DeepseekV32Config.from_dict(json.loads((small_checkpoint / "config.json").read_text()))
    asked = cfg.max_position_embeddings + 1
    offline, served = _refusals(
        small_checkpoint,
        tmp_path,
        ["--device", "cpu", "--context-length", str(asked)],
        {"device": "cpu", "dtype": "float32", "context_length": asked},
    )
    with pytest.raises(ValueError) as shared:
        assemble.check_context(cfg, asked)
    assert offline == served == str(shared.value)
    assert f"--context-length {asked} exceeds the model's max_position_embeddings" in offline


def test_a_kv_dtype_the_model_cannot_store_is_refused_in_the_same_words(small_checkpoint, tmp_path):
    offline, served = _refusals(
        small_checkpoint,
        tmp_path,
        ["--device", "cpu", "--dtype", "float32", "--kv-cache-dtype", "bfloat16"],
        {"device": "cpu", "dtype": "float32", "kv_cache_dtype": "bfloat16"},
    )
    assert offline == served
    assert "--kv-cache-dtype bfloat16 needs a bfloat16 model" in offline


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_device_is_refused_in_the_same_words(small_checkpoint, tmp_path):
    offline, served = _refusals(
        small_checkpoint, tmp_path, ["--device", "cuda"], {"device": "cuda"}
    )
    assert offline == served == "--device cuda was given but no CUDA device is available"


def test_the_start_up_resolves_what_both_report():
    start = assemble.resolve_start_up("cpu", "auto")
    assert (start.device, start.dtype_name, start.dtype) == (
        torch.device("cpu"),
        "float32",
        torch.float32,
    )
    assert not start.cuda_graphs(disabled=False)  # CUDA graphs only on CUDA
    assert assemble.resolve_dtype_name("auto", torch.device("cuda")) == "bfloat16"
    assert assemble.resolve_dtype_name("bfloat16", torch.device("cpu")) == "bfloat16"
    given = EchoConfig(offload=True, dev_cache_size=4096)
    assert assemble.resolve_start_up("cpu", "float32", echo=given).echo is given


def test_the_context_defaults_to_the_model_limit():
    cfg = SimpleNamespace(max_position_embeddings=64)  # all the check reads
    assert assemble.check_context(cfg, None) == 64
    assert assemble.check_context(cfg, 16) == 16
