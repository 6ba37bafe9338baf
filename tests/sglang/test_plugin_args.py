"""The plugin in sglang 0.5.23's launcher: dry parse + resolution, in fresh processes
(plugins load once per process), with the entry point installed in this environment."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import plugin_testenv  # first: sets the process up before sglang loads
import pytest

plugin_testenv.require_sglang()

HERE = Path(__file__).parent
TOP_K = 2048
N_G = 260_000

# A DeepSeek-V3.2-shaped config: all that argument resolution reads (no weights).
MODEL_CONFIG = {
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "vocab_size": 1024,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "first_k_dense_replace": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 48,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "n_shared_experts": 1,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": TOP_K,
    "max_position_embeddings": 163840,
    "rope_theta": 10000.0,
    "torch_dtype": "bfloat16",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
}

ECHO_ENV = {"NSA_DEV_CACHE_SIZE": "260_000"}
DP_ATTENTION = ["--tp-size", "8", "--dp-size", "8", "--enable-dp-attention"]
GOOD = {
    "pd_decode": ["--disaggregation-mode", "decode", "--max-total-tokens", "1000000"],
    "server": ["--max-total-tokens", "600000", "--context-length", "8192"],
    "server_capped": [
        "--max-total-tokens", "600000", "--context-length", "8192",
        "--max-running-requests", "4",
    ],
    # The ECHO artifact's deployment: every size below is per attention-DP rank.
    "pd_decode_dp8": [
        "--disaggregation-mode", "decode", "--max-total-tokens", "1000000", *DP_ATTENTION,
    ],
    "server_dp8": ["--max-total-tokens", "600000", "--context-length", "8192", *DP_ATTENTION],
    "pd_decode_dp8_capped": [
        "--disaggregation-mode", "decode", "--max-total-tokens", "1000000", *DP_ATTENTION,
        "--max-running-requests", "70",
    ],
}  # fmt: skip
# Per-rank running requests each GOOD case must resolve to (N_G // top-k unless capped).
PER_RANK_RUNNING = {"server_capped": 4, "pd_decode_dp8_capped": 70 // 8}
# (extra argv, extra env, text every error message must contain)
BAD = {
    "speculative": (["--speculative-algorithm", "EAGLE"], {}, "--speculative-algorithm"),
    "mixed_chunk": (["--enable-mixed-chunk"], {}, "--enable-mixed-chunk"),
    "prefill_node": (["--disaggregation-mode", "prefill"], {}, "--disaggregation-mode prefill"),
    "decode_radix": (
        ["--disaggregation-mode", "decode", "--disaggregation-decode-enable-radix-cache"],
        {},
        "--disaggregation-decode-enable-radix-cache",
    ),
    "decode_backend": (["--dsa-decode-backend", "fa3"], {}, "--dsa-decode-backend fa3"),
    "kv_dtype": (["--kv-cache-dtype", "fp8_e5m2"], {}, "--kv-cache-dtype fp8_e5m2"),
    "hicache": (["--enable-hierarchical-cache"], {}, "--enable-hierarchical-cache"),
    "pipeline": (["--pp-size", "2"], {}, "--pp-size 2"),
    "data_parallel": (["--dp-size", "2"], {}, "--dp-size 2"),
    "own_hisparse_config": (["--hisparse-config", "{}"], {}, "--hisparse-config"),
    "retraction_backup": (
        [
            "--disaggregation-mode",
            "decode",
            "--disaggregation-decode-retraction-backup",
            "cpu_tensor",
        ],
        {},
        "--disaggregation-decode-retraction-backup cpu_tensor",
    ),
    "too_many_running": (["--max-running-requests", "200"], {}, "NSA_DEV_CACHE_SIZE"),
    "bad_cache_size": ([], {"NSA_DEV_CACHE_SIZE": "12k"}, "NSA_DEV_CACHE_SIZE='12k'"),
    "no_host_pool": (None, {}, "--max-total-tokens is required"),
}


def base_argv(model: Path) -> list[str]:
    return ["--model-path", str(model), "--device", "cpu", "--skip-tokenizer-init"]


def run_driver(cases: list[dict], env: dict, tmp: Path, name: str) -> subprocess.Popen:
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(cases))
    full_env = {**os.environ, **env}
    for key in ("NSA_KV_OFFLOAD", "SGLANG_PLUGINS", "NSA_DEV_CACHE_SIZE"):
        if key not in env:
            full_env.pop(key, None)
    return subprocess.Popen(
        [sys.executable, str(HERE / "dry_parse.py"), str(path)],
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def collect(proc: subprocess.Popen) -> tuple[dict, list[dict]]:
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-4000:]
    state = next(json.loads(line[6:]) for line in out.splitlines() if line.startswith("STATE "))
    cases = [json.loads(line[5:]) for line in out.splitlines() if line.startswith("CASE ")]
    return state, cases


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """Three launcher processes in parallel: echo excluded (baseline), echo loaded with
    NSA_KV_OFFLOAD unset, echo on with the good and the bad flag sets."""
    tmp = tmp_path_factory.mktemp("dry")
    model = tmp / "dsv32"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(MODEL_CONFIG))
    base = base_argv(model)
    # --random-seed: otherwise drawn at random per launch, the one field that would differ.
    plain = [
        {"argv": [*base, "--random-seed", "7", "--max-total-tokens", "600000"]},
        {"argv": [*base, "--random-seed", "7", "--enable-hisparse", "--disable-radix-cache"]},
    ]
    on_cases = [{"argv": base + argv, "env": {}} for argv in GOOD.values()]
    for argv, env, _ in BAD.values():
        extra = [] if argv is None else ["--max-total-tokens", "600000", *argv]
        if argv is not None and "--context-length" not in extra:
            extra += ["--context-length", "8192"]
        on_cases.append({"argv": base + extra, "env": env})
    others = "smg-servicer,smg-zmq"  # every general plugin installed here but echo
    procs = {
        "baseline": run_driver(plain, {"SGLANG_PLUGINS": others}, tmp, "baseline"),
        "off": run_driver(plain, {}, tmp, "off"),
        "on": run_driver(on_cases, {"NSA_KV_OFFLOAD": "1", **ECHO_ENV}, tmp, "on"),
    }
    results = {name: collect(proc) for name, proc in procs.items()}
    on_state, on_results = results["on"]
    good = dict(zip(GOOD, on_results[: len(GOOD)], strict=True))
    bad = dict(zip(BAD, on_results[len(GOOD) :], strict=True))
    return {**results, "good": good, "bad": bad, "on_state": on_state}


def test_env_off_changes_nothing(launches):
    base_state, base_cases = launches["baseline"]
    off_state, off_cases = launches["off"]
    assert off_state["echo_plugin_loaded"] and not base_state["echo_plugin_loaded"]
    assert not off_state["echo_installed"]
    assert off_state["coordinator"] == base_state["coordinator"] == "HiSparseCoordinator"
    assert not off_state["runner_guarded"] and not base_state["runner_guarded"]
    assert off_cases == base_cases  # every resolved field, or the same error
    assert all("fields" in case for case in off_cases)


def field(result: dict, name: str):
    assert "fields" in result, result.get("error")
    return eval(result["fields"][name], {})  # values were written with repr()


@pytest.mark.parametrize("name", list(GOOD))
def test_env_on_resolves_what_echo_needs(launches, name):
    assert launches["on_state"]["coordinator"] == "EchoCoordinator"
    assert launches["on_state"]["runner_guarded"]  # a failed REPLACE stops the start
    result = launches["good"][name]
    assert result.get("pickle_stable"), result.get("error")
    pd = name.startswith("pd_decode")
    host = 1_000_000 if pd else 600_000
    running = PER_RANK_RUNNING.get(name, N_G // TOP_K)  # per attention-DP rank
    ranks = 8 if "dp8" in name else 1
    assert field(result, "attn_dp_size") == ranks
    assert field(result, "enable_hisparse") is True
    assert field(result, "disable_radix_cache") is True
    # sglang gives each rank max_running_requests // attn_dp_size.
    assert field(result, "max_running_requests") == running * ranks
    assert field(result, "page_size") == 64
    assert field(result, "dsa_decode_backend") == "flashmla_sparse"
    rows = field(result, "max_total_tokens")
    prefill = 0 if pd else 8192
    assert rows == math.ceil((N_G + 1) / 64) * 64 + 64 * running + prefill
    config = json.loads(field(result, "hisparse_config"))
    ratio = config["host_to_device_ratio"]
    # sglang's host pool has rows x ratio + 64 slots; ECHO keeps two pages: T fit.
    assert rows * ratio - 64 >= host > rows * (ratio - 1) - 64
    assert config["top_k"] == TOP_K and config["echo_dev_cache"] == N_G
    assert config["echo_device_rows"] == rows and config["echo_host_tokens"] == host
    assert config["device_buffer_size"] >= TOP_K
    # PD decode: a retraction keeps no KV copy (test_retraction.py); a local server's
    # retraction re-prefills, and sglang's own choice stays.
    assert field(result, "disaggregation_decode_retraction_backup") == ("none" if pd else None)


@pytest.mark.parametrize("name", list(BAD))
def test_incompatible_settings_fail_clearly(launches, name):
    result = launches["bad"][name]
    assert "error" in result, f"{name} resolved: {result.get('fields', {}).get('enable_hisparse')}"
    message = result["error"]
    assert "ConfigError" in message
    assert BAD[name][2] in message
