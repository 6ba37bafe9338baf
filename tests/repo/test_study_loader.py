"""The benchmarks' model loader (benchmark/study/loader.py) and the study's worker folders
(benchmark/study/worker_spec.py) through the server's ``--model-loader`` extension point,
on the CPU. Moved from tests/test_decode_node_server.py: they test the benchmark tooling;
that file keeps the product's side (the decode node, the extension point's flags and
refusals)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from server_utils import make_serving
from sglang_echo.config import EchoConfig
from test_decode_node_server import CONTEXT, MAX_RUNNING, POOL, _loader_flags, _prompts, _serve_all

ROOT = Path(__file__).resolve().parents[2]


def test_loader_help_says_it_alters_weights():
    proc = subprocess.run(
        [sys.executable, "-m", "benchmark.study.loader", "--help"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert (
        "--fake-kv-locality" in proc.stdout and "ALTERS THE SERVED MODEL'S WEIGHTS" in proc.stdout
    )


def test_study_worker_folder_serves_as_a_decode_node(tmp_path):
    """``python -m benchmark.study.worker_spec --out DIR --smoke``: with the benchmarks'
    loader, the server builds the study's worker (routed MoE) from the folder; as a decode
    node with the locality knob, no-offload and ECHO at its smallest legal cache give the
    same tokens. Without the loader the product does not know such a folder."""
    from benchmark.study.worker_spec import main as spec_main

    folder = tmp_path / "worker"
    assert spec_main(["--out", str(folder), "--smoke", "--layers", "2", "--vocab", "300"]) == 0
    assert spec_main(["--out", str(tmp_path / "bad"), "--layers", "0"]) == 2
    flags = dict(
        max_total_tokens=POOL, max_running_requests=MAX_RUNNING, context_length=CONTEXT,
        chunked_prefill_size=32, disaggregation_mode="decode",
        disaggregation_transfer_backend="fake", **_loader_flags(0.9),
    )  # fmt: skip
    with pytest.raises(Exception, match=r"config\.json"):  # a checkpoint loader's refusal
        make_serving(
            folder,
            EchoConfig(offload=False),
            **{**flags, "model_loader": None, "model_loader_args": None},
        )
    prompts = _prompts()[:6]
    plain, _ = _serve_all(make_serving(folder, EchoConfig(offload=False), **flags), prompts)
    n_g = EchoConfig(offload=True).min_dev_cache_size(MAX_RUNNING, 16, 32)
    serving = make_serving(folder, EchoConfig(offload=True, dev_cache_size=n_g), **flags)
    assert serving.info["vocab_size"] == 300 and serving.info["num_layers"] == 2
    echo, state = _serve_all(serving, prompts)
    assert echo == plain and state["evictions"] > 0
