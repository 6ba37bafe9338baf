#!/usr/bin/env bash
# Figures 12-13: generation throughput on InfiniteBench 100K-110K inputs across request
# rates, no-offload then offload (ECHO), back to back. Results:
#   infini-318/{no-offload,offload}-MMDD/req_rate_R.{jsonl,log} (+ server logs)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/scripts/e2e_lib.sh"

usage() {
  cat << EOF
Usage: [ENGINE=echo|sglang] [DSV32W4=ckpt] [INFINI_DATASET=file.jsonl] e2e_test_pd_infini.sh [options]

Runs the InfiniteBench sweep twice: no-offload, then offload (NSA_KV_OFFLOAD=1).
ENGINE=echo (default) serves with this project's runtime as a PD decode node with the fake
transfer backend (prompt KV synthesized on the node; FAKE_KV_LOCALITY=0.9 sets the top-k
locality knob, 0 = random keys: a benchmark-only knob that biases the served indexers'
weights, passed through --model-loader benchmark.study.loader:load); ENGINE=sglang runs
SGLang 0.5.23's decode-only benchmark on 8 GPUs (TP 8, DP attention 8): one decode node with the fake
transfer backend, ECHO plugin on it when offloading.
Without INFINI_DATASET (default /workspace/infini-100K-110K.jsonl when present), the
benchmark uses a labelled synthetic workload of the same lengths, scaled to the context;
INFINI_INPUT_RANGE=LO,HI gives it other prompt lengths (e.g. 100000,108000, the in-process
study's range, when a served run is compared with the study).

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
NO_OFFLOAD_RES_DIR="${NO_OFFLOAD_RES_DIR:-infini-318/no-offload-${CURRENT_MMDD}}"
OFFLOAD_RES_DIR="${OFFLOAD_RES_DIR:-infini-318/offload-${CURRENT_MMDD}}"
INFINI_DATASET="${INFINI_DATASET:-/workspace/infini-100K-110K.jsonl}"
parse_common_options "$@"
[[ -f "$INFINI_DATASET" ]] || INFINI_DATASET=""
range_args=()
if [[ -n "${INFINI_INPUT_RANGE:-}" ]]; then
  if [[ -n "$INFINI_DATASET" ]]; then
    echo "INFINI_INPUT_RANGE sets the synthetic workload's lengths, but INFINI_DATASET=$INFINI_DATASET brings its own: unset one" >&2
    exit 2
  fi
  range_args=(--infinitebench-input-range "$INFINI_INPUT_RANGE")
fi

choose_model
trap stop_started EXIT
stop_started

for mode in no-offload offload; do
  res="$NO_OFFLOAD_RES_DIR"
  [[ "$mode" == "offload" ]] && res="$OFFLOAD_RES_DIR"
  launch "$mode" "$res" pd
  for rate in "${REQUEST_RATES[@]}"; do
    bench "$res/req_rate_${rate}" "$rate" --dataset-name infinitebench \
      --dataset-path "$INFINI_DATASET" --sort-len "${range_args[@]}"
  done
  stop_started
done
echo "results: $NO_OFFLOAD_RES_DIR $OFFLOAD_RES_DIR" >&2
