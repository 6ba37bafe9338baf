#!/usr/bin/env bash
# Figure 15: latency (TTFT / ITL / E2E) on ShareGPT chats, no-offload then offload, one
# server each (not PD). Results: sharegpt-100/{no-offload,offload}-MMDD/req_rate_R.{jsonl,log}
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/scripts/e2e_lib.sh"

usage() {
  cat << EOF
Usage: [ENGINE=echo|sglang] [DSV32W4=ckpt] [SHAREGPT_DATASET=file.json] e2e_test_mix_sharegpt.sh [options]

ShareGPT latency sweep, no-offload then offload. Without SHAREGPT_DATASET (a ShareGPT
json), the benchmark uses a labelled synthetic ShareGPT-like workload.

Options:
$COMMON_USAGE
EOF
}

REQUEST_RATES_INPUT="${REQUEST_RATES:-inf,0.9,0.8,0.7,0.6,0.5,0.4,0.3,0.2,0.1}"
NUM_PROMPTS="${NUM_PROMPTS:-100}"
WARMUP_REQUESTS="${WARMUP_REQUESTS:-0}"
NO_OFFLOAD_MAX_TOTAL_TOKENS="${NO_OFFLOAD_MAX_TOTAL_TOKENS:-}"
OFFLOAD_MAX_TOTAL_TOKENS="${OFFLOAD_MAX_TOTAL_TOKENS:-}"
OFFLOAD_NSA_DEV_CACHE_SIZE="${OFFLOAD_NSA_DEV_CACHE_SIZE:-200_000}"
NO_OFFLOAD_RES_DIR="${NO_OFFLOAD_RES_DIR:-sharegpt-100/no-offload-${CURRENT_MMDD}}"
OFFLOAD_RES_DIR="${OFFLOAD_RES_DIR:-sharegpt-100/offload-${CURRENT_MMDD}}"
SHAREGPT_DATASET="${SHAREGPT_DATASET:-}"
parse_common_options "$@"

choose_model
trap stop_started EXIT
stop_started

for mode in no-offload offload; do
  res="$NO_OFFLOAD_RES_DIR"
  [[ "$mode" == "offload" ]] && res="$OFFLOAD_RES_DIR"
  launch "$mode" "$res" single
  for rate in "${REQUEST_RATES[@]}"; do
    bench "$res/req_rate_${rate}" "$rate" --dataset-name sharegpt \
      ${SHAREGPT_DATASET:+--dataset-path "$SHAREGPT_DATASET"}
  done
  stop_started
done
echo "results: $NO_OFFLOAD_RES_DIR $OFFLOAD_RES_DIR" >&2
