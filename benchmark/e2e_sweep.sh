#!/usr/bin/env bash
# The end-to-end request-rate sweeps through the HTTP server (ECHO Figures 12-15), on one GPU:
# the study's worker (DeepSeek-V3.2 attention dimensions, one DP worker's routed MoE,
# LAYERS layers; python -m benchmark.study.worker_spec) served as a PD decode node with
# the fake transfer backend (prompt KV synthesized on the node, FAKE_KV_LOCALITY top-k
# locality; both through the server's --model-loader benchmark.study.loader:load, set by
# scripts/e2e_lib.sh), no-offload then ECHO, InfiniteBench-like 100K-110K prompts at each
# rate, then the plot tool writes OUTDIR/e2e_sweep.json (command, device, date, metrics)
# and plots.
# TASKS=1 adds Figure 14 (per task: code_debug, code_run, longbook_choice_eng,
# longbook_qa_eng; synthetic files of InfiniteBench's published task lengths unless
# TASK_DATASET_DIR holds real ones), SHAREGPT=1 Figure 15 (ShareGPT-like chats on one
# server that prefills and decodes: TTFT, ITL, E2E latency). INFINI=0 skips Figures 12-13
# (to split the sweeps over several device calls); TASK_RATES, SHAREGPT_RATES and
# TASK_NUM_PROMPTS (per task) default to RATES and NUM_PROMPTS. KV_CACHE_DTYPE=fp8_e4m3
# stores 656-byte fp8 KV rows on both servers (default auto: the model dtype). The record's command names every knob's value, so it reruns as it ran.
#
# Usage (GPU machine, repository root): bash benchmark/e2e_sweep.sh [OUTDIR]
# Knobs (environment): LAYERS=8 RATES=0.5,1,2,inf NUM_PROMPTS=32 CONTEXT=110592
#   NO_OFFLOAD_TOKENS=380000 (the paper's per-worker pool) DEV_CACHE=260000
#   OFFLOAD_TOKENS=1800000 FAKE_KV_LOCALITY=0.9 MAX_OUTPUT_LEN=256 WARMUP_REQUESTS=16
#   INFINI_INPUT_RANGE=LO,HI: the synthetic InfiniteBench-like prompts' lengths (default
#   the bench's, 100000,110000)
#   SMOKE=1: tiny dimensions and sizes (a CPU check of the whole pipeline)
#   ENGINE_PROCESS=1 (default): both servers with --engine-process (the engine behind the
#   HTTP front); 0: the engine in the server process
# fastapi/uvicorn missing there? bash benchmark/fetch_server_wheels.sh here, carry .whl/.
set -euo pipefail
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
  sed -n '2,27p' "$0"
  exit 0
fi
cd "$(dirname "$0")/.."
OUT="$(mkdir -p "${1:-benchmark/results/e2e_sweep}" && cd "${1:-benchmark/results/e2e_sweep}" && pwd)"
export PYTHON="${PYTHON:-python3}"
export PYTHONPATH="$PWD/python:$PWD${PYTHONPATH:+:$PYTHONPATH}"  # sglang_echo, benchmark/
export PYTHONUNBUFFERED=1
WORK="${E2E_WORK:-/tmp/echo-e2e-sweep}"
export E2E_WORK="$WORK"
spec_flags=()  # worker_spec options (SMOKE=1: tiny dimensions)
if [[ "${SMOKE:-0}" == "1" ]]; then
  LAYERS="${LAYERS:-2}" RATES="${RATES:-inf}" NUM_PROMPTS="${NUM_PROMPTS:-4}"
  CONTEXT="${CONTEXT:-512}" NO_OFFLOAD_TOKENS="${NO_OFFLOAD_TOKENS:-1200}"
  DEV_CACHE="${DEV_CACHE:-64}" OFFLOAD_TOKENS="${OFFLOAD_TOKENS:-4000}"
  MAX_OUTPUT_LEN="${MAX_OUTPUT_LEN:-8}" WARMUP_REQUESTS="${WARMUP_REQUESTS:-0}"
  spec_flags=(--smoke --vocab 300 --max-position 1024)
fi
LAYERS="${LAYERS:-8}"
RATES="${RATES:-0.5,1,2,inf}"
NUM_PROMPTS="${NUM_PROMPTS:-32}"
CONTEXT="${CONTEXT:-110592}"
NO_OFFLOAD_TOKENS="${NO_OFFLOAD_TOKENS:-380000}"
DEV_CACHE="${DEV_CACHE:-260000}"
OFFLOAD_TOKENS="${OFFLOAD_TOKENS:-1800000}"
MAX_OUTPUT_LEN="${MAX_OUTPUT_LEN:-256}"
WARMUP_REQUESTS="${WARMUP_REQUESTS:-16}"
export FAKE_KV_LOCALITY="${FAKE_KV_LOCALITY:-0.9}"
export KV_CACHE_DTYPE="${KV_CACHE_DTYPE:-auto}"
INFINI="${INFINI:-1}" TASKS="${TASKS:-0}" SHAREGPT="${SHAREGPT:-0}"
TASK_RATES="${TASK_RATES:-$RATES}" SHAREGPT_RATES="${SHAREGPT_RATES:-$RATES}"
TASK_NUM_PROMPTS="${TASK_NUM_PROMPTS:-$NUM_PROMPTS}"
knobs="SMOKE=${SMOKE:-0} LAYERS=$LAYERS RATES=$RATES NUM_PROMPTS=$NUM_PROMPTS CONTEXT=$CONTEXT"
knobs+=" NO_OFFLOAD_TOKENS=$NO_OFFLOAD_TOKENS DEV_CACHE=$DEV_CACHE OFFLOAD_TOKENS=$OFFLOAD_TOKENS"
knobs+=" FAKE_KV_LOCALITY=$FAKE_KV_LOCALITY KV_CACHE_DTYPE=$KV_CACHE_DTYPE MAX_OUTPUT_LEN=$MAX_OUTPUT_LEN"
knobs+=" WARMUP_REQUESTS=$WARMUP_REQUESTS INFINI=$INFINI TASKS=$TASKS TASK_RATES=$TASK_RATES"
knobs+=" TASK_NUM_PROMPTS=$TASK_NUM_PROMPTS"
knobs+=" SHAREGPT=$SHAREGPT SHAREGPT_RATES=$SHAREGPT_RATES ENGINE_PROCESS=${ENGINE_PROCESS:-1}"
[[ -n "${INFINI_INPUT_RANGE:-}" ]] && knobs+=" INFINI_INPUT_RANGE=$INFINI_INPUT_RANGE"
export INFINI_INPUT_RANGE="${INFINI_INPUT_RANGE:-}"
if [[ "$INFINI$TASKS$SHAREGPT" != *1* ]]; then
  echo "nothing to run: INFINI=0 and neither TASKS=1 nor SHAREGPT=1" >&2
  exit 2
fi

source benchmark/web_stack.sh
ensure_web_stack "$WORK"

MODEL="$WORK/study-l$LAYERS"
"$PYTHON" -m benchmark.study.worker_spec --out "$MODEL" --layers "$LAYERS" "${spec_flags[@]}"
{
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2> /dev/null || echo "device: cpu"
  "$PYTHON" -c "import torch; print('torch', torch.__version__)"
  echo "study worker: LAYERS=$LAYERS (DeepSeek-V3.2 attention dims unless SMOKE=1), decode node with fake transfer, FAKE_KV_LOCALITY=$FAKE_KV_LOCALITY"
  echo "no-offload pool $NO_OFFLOAD_TOKENS tokens; ECHO host pool $OFFLOAD_TOKENS tokens, NSA_DEV_CACHE_SIZE $DEV_CACHE"
  echo "$knobs"
} > "$OUT/sweep_config.txt"
cat "$OUT/sweep_config.txt"

start=$SECONDS
common=(--num-prompts "$NUM_PROMPTS" --warmup-requests "$WARMUP_REQUESTS"
  --context-length "$CONTEXT" --max-output-len "$MAX_OUTPUT_LEN"
  --no-offload-max-total-tokens "$NO_OFFLOAD_TOKENS" --offload-max-total-tokens "$OFFLOAD_TOKENS"
  --offload-nsa-dev-cache-size "$DEV_CACHE")
roots=()
if [[ "$INFINI" == "1" ]]; then
  ENGINE=echo DSV32W4="$MODEL" bash e2e_test_pd_infini.sh "${common[@]}" --request-rates "$RATES" \
    --no-offload-res-dir "$OUT/infini/no-offload" --offload-res-dir "$OUT/infini/offload"
  roots+=("$OUT/infini")
fi
if [[ "$TASKS" == "1" ]]; then
  ENGINE=echo DSV32W4="$MODEL" bash e2e_test_pd_infini_task.sh "${common[@]}" \
    --request-rates "$TASK_RATES" --num-prompts "$TASK_NUM_PROMPTS" \
    --no-offload-res-dir "$OUT/tasks/no-offload" --offload-res-dir "$OUT/tasks/offload"
  roots+=("$OUT/tasks")
fi
if [[ "$SHAREGPT" == "1" ]]; then
  ENGINE=echo DSV32W4="$MODEL" bash e2e_test_mix_sharegpt.sh "${common[@]}" \
    --request-rates "$SHAREGPT_RATES" \
    --no-offload-res-dir "$OUT/sharegpt/no-offload" --offload-res-dir "$OUT/sharegpt/offload"
  roots+=("$OUT/sharegpt")
fi
echo "sweep took $((SECONDS - start)) s" | tee -a "$OUT/sweep_config.txt"
"$PYTHON" -m sglang_echo.bench.plot "${roots[@]}" --out-dir "$OUT/plots" \
  --record "$OUT/e2e_sweep.json" --config "$OUT/sweep_config.txt" \
  --sweep-command "$knobs bash benchmark/e2e_sweep.sh $*"
