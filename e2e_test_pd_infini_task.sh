#!/usr/bin/env bash
# Figure 14: per-task throughput, one InfiniteBench task file at a time
# ($TASK_DATASET_DIR/*.jsonl), no-offload then offload. Results:
#   infini-task/{no-offload,offload}-MMDD/<task>/req_rate_R.{jsonl,log}
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/scripts/e2e_lib.sh"

usage() {
  cat << EOF
Usage: [ENGINE=echo|sglang] [DSV32W4=ckpt] [TASK_DATASET_DIR=dir] e2e_test_pd_infini_task.sh [options]

Benchmarks every <task>.jsonl in TASK_DATASET_DIR (default /workspace/infinibench_task),
no-offload then offload. With ENGINE=echo and no such folder, a labelled synthetic task
folder (random text in InfiniteBench's format, sized to the context) is written under
\$E2E_WORK and used instead.

Options:
$COMMON_USAGE
EOF
}

REQUEST_RATES_INPUT="${REQUEST_RATES:-0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,inf}"
NUM_PROMPTS="${NUM_PROMPTS:-318}"
WARMUP_REQUESTS="${WARMUP_REQUESTS:-0}"
NO_OFFLOAD_MAX_TOTAL_TOKENS="${NO_OFFLOAD_MAX_TOTAL_TOKENS:-}"
OFFLOAD_MAX_TOTAL_TOKENS="${OFFLOAD_MAX_TOTAL_TOKENS:-}"
OFFLOAD_NSA_DEV_CACHE_SIZE="${OFFLOAD_NSA_DEV_CACHE_SIZE:-260_000}"
NO_OFFLOAD_RES_DIR="${NO_OFFLOAD_RES_DIR:-infini-task/no-offload-${CURRENT_MMDD}}"
OFFLOAD_RES_DIR="${OFFLOAD_RES_DIR:-infini-task/offload-${CURRENT_MMDD}}"
TASK_DATASET_DIR="${TASK_DATASET_DIR:-/workspace/infinibench_task}"
parse_common_options "$@"

choose_model
if [[ ! -d "$TASK_DATASET_DIR" ]]; then
  if [[ "$ENGINE" != "echo" ]]; then
    echo "Task dataset directory not found: $TASK_DATASET_DIR (set TASK_DATASET_DIR)" >&2
    exit 2
  fi
  TASK_DATASET_DIR="$E2E_WORK/infinibench_task_synthetic"
  "$PYTHON" -m benchmark.make_tasks --out "$TASK_DATASET_DIR" --num "$NUM_PROMPTS" \
    --model-path "$MODEL" ${CONTEXT_LENGTH:+--context-length "$CONTEXT_LENGTH"}
fi
shopt -s nullglob
task_files=("$TASK_DATASET_DIR"/*.jsonl)
shopt -u nullglob
if [[ ${#task_files[@]} -eq 0 ]]; then
  echo "no *.jsonl task files in $TASK_DATASET_DIR" >&2
  exit 2
fi

trap stop_started EXIT
stop_started

for mode in no-offload offload; do
  res="$NO_OFFLOAD_RES_DIR"
  [[ "$mode" == "offload" ]] && res="$OFFLOAD_RES_DIR"
  launch "$mode" "$res" pd
  for task_file in "${task_files[@]}"; do
    task="$(basename "$task_file" .jsonl)"
    mkdir -p "$res/$task"
    for rate in "${REQUEST_RATES[@]}"; do
      bench "$res/$task/req_rate_${rate}" "$rate" --dataset-name infinitebench \
        --dataset-path "$TASK_DATASET_DIR" --infinitebench-task "$task" --sort-len
    done
  done
  stop_started
done
echo "results: $NO_OFFLOAD_RES_DIR $OFFLOAD_RES_DIR" >&2
