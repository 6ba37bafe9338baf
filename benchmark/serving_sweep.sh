#!/usr/bin/env bash
# The serving sweep on one GPU, in one command: generate a bigger random DeepSeek-V3.2
# model (DeepSeek-V3.2's per-layer KV and indexer dimensions, fewer layers), serve it with
# this project's server, run bench_serving's InfiniteBench-like workload at several request
# rates with no-offload and then ECHO at equal HBM, and plot. No network needed.
#
# Usage (on the GPU machine, repository root): bash benchmark/serving_sweep.sh [OUTDIR]
# fastapi/uvicorn missing there? Run bash benchmark/fetch_server_wheels.sh here first and
# carry .whl/ along; they are installed offline into a private folder on PYTHONPATH.
# Knobs (environment): LAYERS=4 CONTEXT=16384 NUM_PROMPTS=16 RATES=0.5,1,2,inf (defaults fit
#   one 10-minute device call: the last H200 run of 16 prompts at 2 rates took 250 s)
#   NO_OFFLOAD_TOKENS=131072 DEV_CACHE=65536 OFFLOAD_TOKENS=(equal-HBM default)
#   INDEXER_MODE=fp8_hadamard MAX_OUTPUT_LEN=256 SHAREGPT=0 (1: also the ShareGPT sweep)
#   WARMUP_REQUESTS=NUM_PROMPTS (at most 32; sent at once before each rate, so that every
#   decode batch size up to it has its CUDA graph captured and its kernels compiled)
set -euo pipefail
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
  sed -n '2,15p' "$0"
  exit 0
fi
cd "$(dirname "$0")/.."
OUT="$(mkdir -p "${1:-${OUT:-benchmark/results/serving}}" && cd "${1:-${OUT:-benchmark/results/serving}}" && pwd)"
export PYTHON="${PYTHON:-python3}"
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
LAYERS="${LAYERS:-4}"
CONTEXT="${CONTEXT:-16384}"
NUM_PROMPTS="${NUM_PROMPTS:-16}"
RATES="${RATES:-0.5,1,2,inf}"
NO_OFFLOAD_TOKENS="${NO_OFFLOAD_TOKENS:-131072}"
DEV_CACHE="${DEV_CACHE:-65536}"
INDEXER_MODE="${INDEXER_MODE:-fp8_hadamard}"
MAX_OUTPUT_LEN="${MAX_OUTPUT_LEN:-256}"
WORK="${E2E_WORK:-/tmp/echo-serving-sweep}"
export E2E_WORK="$WORK"

source benchmark/web_stack.sh
ensure_web_stack "$WORK"

MODEL="${MODEL:-$WORK/dsv32-l$LAYERS}"
if [[ ! -f "$MODEL/config.json" ]]; then
  "$PYTHON" scripts/make_tiny_checkpoint.py --out "$MODEL" --layers "$LAYERS" --dense-layers 1 \
    --hidden 1024 --heads 16 --q-lora-rank 512 --kv-lora-rank 512 --qk-nope-head-dim 128 \
    --qk-rope-head-dim 64 --v-head-dim 128 --intermediate 2048 --moe-intermediate 512 \
    --experts 16 --experts-per-tok 4 --n-group 4 --topk-group 2 --index-heads 64 \
    --index-dim 128 --index-topk 2048 --max-position "$CONTEXT" --init-std 0.02
  "$PYTHON" - "$MODEL" "$INDEXER_MODE" << 'PY'
import json, sys
path = f"{sys.argv[1]}/config.json"
cfg = json.load(open(path))
if sys.argv[2] != "bf16":
    cfg["indexer_mode"] = sys.argv[2]
json.dump(cfg, open(path, "w"))
PY
fi

# Equal HBM: the offload host pool is as large as the device bytes of the no-offload pool
# allow, once the device cache and the device-resident indexer keys are paid for.
OFFLOAD_TOKENS="${OFFLOAD_TOKENS:-$("$PYTHON" - "$MODEL" "$NO_OFFLOAD_TOKENS" "$DEV_CACHE" << 'PY'
import sys, torch
from sglang_echo.model.config import load_config
cfg = load_config(sys.argv[1])
plain, n_g = int(sys.argv[2]), int(sys.argv[3])
kv = cfg.kv_row_dim * 2  # bfloat16
idx = cfg.index_row_dim * torch.empty(0, dtype=cfg.index_row_dtype(torch.bfloat16)).element_size()
print(max(plain, (plain * (kv + idx) - n_g * (kv + 13)) // (idx + 4)))
PY
)}"
echo "model $MODEL: no-offload pool $NO_OFFLOAD_TOKENS tokens; offload host pool $OFFLOAD_TOKENS tokens, NSA_DEV_CACHE_SIZE $DEV_CACHE" | tee "$OUT/sweep_config.txt"
{
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2> /dev/null || true
  "$PYTHON" -c "import torch; print('torch', torch.__version__)"
  echo "LAYERS=$LAYERS CONTEXT=$CONTEXT NUM_PROMPTS=$NUM_PROMPTS RATES=$RATES INDEXER_MODE=$INDEXER_MODE"
} >> "$OUT/sweep_config.txt"

common=(--request-rates "$RATES" --num-prompts "$NUM_PROMPTS" --context-length "$CONTEXT"
  --max-output-len "$MAX_OUTPUT_LEN" --no-offload-max-total-tokens "$NO_OFFLOAD_TOKENS"
  --offload-max-total-tokens "$OFFLOAD_TOKENS" --offload-nsa-dev-cache-size "$DEV_CACHE"
  --warmup-requests "${WARMUP_REQUESTS:-$((NUM_PROMPTS < 32 ? NUM_PROMPTS : 32))}"
  --chunked-prefill-size "${CHUNKED_PREFILL_SIZE:-$((DEV_CACHE < 8192 ? DEV_CACHE : 8192))}")
start=$SECONDS
ENGINE=echo DSV32W4="$MODEL" INFINI_DATASET="${INFINI_DATASET:-}" bash e2e_test_pd_infini.sh \
  "${common[@]}" --no-offload-res-dir "$OUT/infini/no-offload" --offload-res-dir "$OUT/infini/offload"
roots=("$OUT/infini")
if [[ "${SHAREGPT:-0}" == "1" ]]; then
  ENGINE=echo DSV32W4="$MODEL" bash e2e_test_mix_sharegpt.sh "${common[@]}" \
    --no-offload-res-dir "$OUT/sharegpt/no-offload" --offload-res-dir "$OUT/sharegpt/offload"
  roots+=("$OUT/sharegpt")
fi
echo "sweep took $((SECONDS - start)) s" | tee -a "$OUT/sweep_config.txt"
# The record {name, device, date, command, sweeps, config, metrics}, written by the plot
# tool (the same command merges several sweeps' folders into one record).
"$PYTHON" -m sglang_echo.bench.plot "${roots[@]}" --out-dir "$OUT/plots" \
  --record "$OUT/serving_sweep.json" --config "$OUT/sweep_config.txt" \
  --sweep-command "bash benchmark/serving_sweep.sh $*" || true
