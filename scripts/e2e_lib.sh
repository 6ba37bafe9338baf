#!/usr/bin/env bash
# Shared by e2e_test_pd_infini.sh, e2e_test_pd_infini_task.sh and e2e_test_mix_sharegpt.sh:
# option parsing, model choice, server launch (ENGINE=echo: this project's server;
# ENGINE=sglang: real SGLang with the ECHO plugin), readiness waits, the benchmark call.
# Every process started here is recorded in $E2E_PID_DIR, and only those are stopped
# (scripts/killall_sglang.sh), never anything found by name.

E2E_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ENGINE="${ENGINE:-echo}"
E2E_WORK="${E2E_WORK:-$E2E_ROOT/.e2e}"
export E2E_PID_DIR="${E2E_PID_DIR:-$E2E_WORK/pids}"
CURRENT_MMDD="$(date +%m%d)"
PORT="${PORT:-30000}"
SERVER_START_TIMEOUT="${SERVER_START_TIMEOUT:-1800}"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$E2E_ROOT/.venv/bin/python" ]]; then PYTHON="$E2E_ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
# python/: the package; the root: benchmark/ (the model loader, the task maker), outside the wheel.
export PYTHONPATH="$E2E_ROOT/python:$E2E_ROOT${PYTHONPATH:+:$PYTHONPATH}"
# The benchmarks' model loader, the server's one extension point (--model-loader): it
# serves the study's worker folders and owns the top-k locality knob, which alters the
# served indexers' weights (python -m benchmark.study.loader --help).
STUDY_LOADER="benchmark.study.loader:load"

case "$ENGINE" in
  echo | sglang) ;;
  *) echo "ENGINE=$ENGINE is not understood; use ENGINE=echo (this project's server) or ENGINE=sglang" >&2; exit 2 ;;
esac

# Options every script accepts (each script's --help lists them with its own defaults).
COMMON_USAGE='  --request-rates LIST              comma-separated request rates, e.g. 0.1,0.5,inf
  --num-prompts N                   prompts per benchmark run
  --warmup-requests N               warmup requests before each run
  --no-offload-res-dir DIR          result folder of the no-offload run
  --offload-res-dir DIR             result folder of the offload run
  --no-offload-max-total-tokens T   --max-total-tokens of the no-offload server (KV pool)
  --offload-max-total-tokens T      --max-total-tokens of the offload server (host pool)
  --offload-nsa-dev-cache-size N    NSA_DEV_CACHE_SIZE of the offload server (slots/layer)
  --context-length N                (ENGINE=echo) server context length
  --max-output-len N                cap on InfiniteBench output lengths (bench; default 256)
  --chunked-prefill-size N          server chunked prefill size
  --cuda-graph-max-bs N             server CUDA-graph batch-size limit
  --max-running-requests N          server max running requests
  --speculative-num-steps S         (ENGINE=echo) both servers decode with MTP, S draft tokens
                                    per round (the checkpoint NextN layer drafts; 1 to 3)
  --port N                          server port (default 30000)
  -h, --help                        this help
Environment: ENGINE=echo|sglang (default echo); DSV32W4=checkpoint (ENGINE=echo without it
uses a generated tiny DeepSeek-V3.2 model); ENGINE_PROCESS=1|0 (ENGINE=echo: the engine in
a process of its own behind the HTTP front, default 1; 0 runs it in the server process);
POLL_COUNTERS_S (the benchmark samples the server counters that often, for steady_* fields);
PYTHON; E2E_WORK (scratch, default .e2e/).'

parse_common_options() {
  # Sets the variables of the options above; the caller provides usage().
  while [[ $# -gt 0 ]]; do
    if [[ "$1" == "-h" || "$1" == "--help" ]]; then usage; exit 0; fi
    if [[ $# -lt 2 ]]; then echo "Missing value for $1 (or unknown option)" >&2; usage >&2; exit 2; fi
    case "$1" in
      --request-rates) REQUEST_RATES_INPUT="$2" ;;
      --num-prompts) NUM_PROMPTS="$2" ;;
      --warmup-requests) WARMUP_REQUESTS="$2" ;;
      --no-offload-res-dir) NO_OFFLOAD_RES_DIR="$2" ;;
      --offload-res-dir) OFFLOAD_RES_DIR="$2" ;;
      --no-offload-max-total-tokens) NO_OFFLOAD_MAX_TOTAL_TOKENS="$2" ;;
      --offload-max-total-tokens) OFFLOAD_MAX_TOTAL_TOKENS="$2" ;;
      --offload-nsa-dev-cache-size) OFFLOAD_NSA_DEV_CACHE_SIZE="$2" ;;
      --context-length) CONTEXT_LENGTH="$2" ;;
      --max-output-len) MAX_OUTPUT_LEN="$2" ;;
      --chunked-prefill-size) CHUNKED_PREFILL_SIZE="$2" ;;
      --cuda-graph-max-bs) CUDA_GRAPH_MAX_BS="$2" ;;
      --max-running-requests) MAX_RUNNING_REQUESTS="$2" ;;
      --speculative-num-steps) SPEC_NUM_STEPS="$2" ;;
      --port) PORT="$2" ;;
      *) echo "Unknown argument: $1" >&2; usage >&2; exit 2 ;;
    esac
    shift 2
  done
  read -r -a REQUEST_RATES <<< "${REQUEST_RATES_INPUT//,/ }"
  if [[ ${#REQUEST_RATES[@]} -eq 0 ]]; then echo "--request-rates cannot be empty" >&2; exit 2; fi
  if [[ -n "${SPEC_NUM_STEPS:-}" && "$ENGINE" == "sglang" ]]; then
    echo "--speculative-num-steps: the ECHO plugin does not run speculative decoding yet" \
      "(README: limits); run it with ENGINE=echo, or leave it out" >&2
    exit 2
  fi
}

# The model: $DSV32W4, or (ENGINE=echo) a tiny generated checkpoint, made once.
choose_model() {
  if [[ -n "${DSV32W4:-}" ]]; then MODEL="$DSV32W4"; return; fi
  if [[ "$ENGINE" == "sglang" ]]; then
    echo "ENGINE=sglang needs DSV32W4=<DeepSeek-V3.2 checkpoint>" >&2; exit 2
  fi
  MODEL="$E2E_WORK/tiny-dsv32"
  local nextn=()
  if [[ -n "${SPEC_NUM_STEPS:-}" ]]; then  # with an MTP (NextN) layer to draft with
    MODEL="$E2E_WORK/tiny-dsv32-mtp"
    nextn=(--num-nextn-predict-layers 1)
  fi
  if [[ ! -f "$MODEL/config.json" ]]; then
    echo "DSV32W4 unset: generating a tiny DeepSeek-V3.2 checkpoint in $MODEL" >&2
    "$PYTHON" "$E2E_ROOT/scripts/make_tiny_checkpoint.py" --out "$MODEL" --layers 4 \
      --index-topk 32 "${nextn[@]}" >&2
  fi
}

stop_started() {
  bash "$E2E_ROOT/scripts/killall_sglang.sh"
  bash "$E2E_ROOT/scripts/ensure_vram_clear.sh"
}

# start_bg NAME LOG ENV... -- CMD...: run CMD in its own process group, pid in $E2E_PID_DIR.
start_bg() {
  local name="$1" log="$2"; shift 2
  local envs=()
  while [[ "$1" != "--" ]]; do envs+=("$1"); shift; done
  shift
  mkdir -p "$E2E_PID_DIR" "$(dirname "$log")"
  env "${envs[@]}" setsid "$@" > "$log" 2>&1 < /dev/null &
  echo $! > "$E2E_PID_DIR/$name.pid"
}

# http_ok URL: a 2xx answer (python's urllib, so no curl is needed on the machine).
http_ok() {
  "$PYTHON" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)' "$1" 2> /dev/null
}

# wait_ready NAME LOG TEXT [URL]: until TEXT is in LOG (and URL answers), bounded in time;
# fail at once if the process died.
wait_ready() {
  local name="$1" log="$2" text="$3" url="${4:-}"
  local pid; pid="$(cat "$E2E_PID_DIR/$name.pid")"
  local deadline=$((SECONDS + SERVER_START_TIMEOUT))
  until [[ -f "$log" ]] && grep -Fq "$text" "$log" && { [[ -z "$url" ]] || http_ok "$url"; }; do
    if ! kill -0 "$pid" 2> /dev/null; then
      echo "$name exited before it was ready; last lines of $log:" >&2
      tail -n 20 "$log" >&2
      return 1
    fi
    if ((SECONDS > deadline)); then
      echo "$name not ready after ${SERVER_START_TIMEOUT}s (see $log)" >&2
      return 1
    fi
    sleep 1
  done
  echo "$name ready" >&2
}

# launch_echo MODE RES_DIR [TOPOLOGY]: this project's server; MODE is no-offload or offload.
# TOPOLOGY pd: a PD decode node with the fake transfer backend (prompt KV synthesized on the
# node, as SGLang benchmarks a decode node alone), served through the benchmarks' loader
# with FAKE_KV_LOCALITY (default 0.9) as its locality knob; single: one server that
# prefills and decodes, through the loader only for a study worker folder.
launch_echo() {
  local mode="$1" res="$2" topology="${3:-single}"
  local args=(-m sglang_echo.launch_server --model-path "$MODEL" --host 127.0.0.1 --port "$PORT"
    --disable-radix-cache --cuda-graph-max-bs "${CUDA_GRAPH_MAX_BS:-48}")
  if [[ "$topology" == "pd" ]]; then
    args+=(--disaggregation-mode decode --disaggregation-transfer-backend fake
      --model-loader "$STUDY_LOADER" "--model-loader-args=--fake-kv-locality ${FAKE_KV_LOCALITY:-0.9}")
  elif [[ -f "$MODEL/study_worker.json" ]]; then
    args+=(--model-loader "$STUDY_LOADER")
  fi
  [[ -n "${CONTEXT_LENGTH:-}" ]] && args+=(--context-length "$CONTEXT_LENGTH")
  [[ -n "${KV_CACHE_DTYPE:-}" ]] && args+=(--kv-cache-dtype "$KV_CACHE_DTYPE")
  [[ -n "${CHUNKED_PREFILL_SIZE:-}" ]] && args+=(--chunked-prefill-size "$CHUNKED_PREFILL_SIZE")
  [[ -n "${MAX_RUNNING_REQUESTS:-}" ]] && args+=(--max-running-requests "$MAX_RUNNING_REQUESTS")
  [[ -n "${SPEC_NUM_STEPS:-}" ]] && args+=(--speculative-algorithm NEXTN
    --speculative-num-steps "$SPEC_NUM_STEPS")
  # The engine in a process of its own behind the HTTP front, so HTTP and detokenizing never
  # hold the engine's GIL (benchmark/results/served_vs_study/); ENGINE_PROCESS=0: in-process.
  [[ "${ENGINE_PROCESS:-1}" == "1" ]] && args+=(--engine-process)
  local envs=(NSA_KV_OFFLOAD=0)
  if [[ "$mode" == "offload" ]]; then
    envs=(NSA_KV_OFFLOAD=1 "NSA_DEV_CACHE_SIZE=$OFFLOAD_NSA_DEV_CACHE_SIZE")
    [[ -n "${OFFLOAD_MAX_TOTAL_TOKENS:-}" ]] && args+=(--max-total-tokens "$OFFLOAD_MAX_TOTAL_TOKENS")
  else
    [[ -n "${NO_OFFLOAD_MAX_TOTAL_TOKENS:-}" ]] && args+=(--max-total-tokens "$NO_OFFLOAD_MAX_TOTAL_TOKENS")
  fi
  start_bg "echo-server" "$res/server.log" "${envs[@]}" -- "$PYTHON" "${args[@]}"
  wait_ready "echo-server" "$res/server.log" "The server is fired up and ready to roll!" \
    "http://127.0.0.1:$PORT/health"
}

# sglang 0.5.23's spelling of the ECHO artifact's deployment (8 GPUs, DP attention).
SGLANG_PARALLEL=(--tp-size 8 --dp-size 8 --enable-dp-attention --quantization moe_wna16)

# launch_sglang_pd MODE RES_DIR: the decode-only benchmark as SGLang 0.5.23 runs it: one
# decode node with the fake transfer backend serves requests directly (their prompt KV is
# not computed; a 0.5.23 prefill node refuses the fake backend, so the artifact's
# fake-prefill + decode + router topology no longer starts). ECHO on it when offloading;
# --max-total-tokens is then each attention-DP rank's host pool.
launch_sglang_pd() {
  local mode="$1" res="$2"
  local decode=(python3 -m sglang.launch_server --model-path "$MODEL" --disaggregation-mode decode
    --disaggregation-transfer-backend fake --host 127.0.0.1 --port "$PORT" "${SGLANG_PARALLEL[@]}"
    --disable-radix-cache --disable-overlap-schedule --cuda-graph-max-bs-decode "${CUDA_GRAPH_MAX_BS:-48}")
  [[ -n "${MAX_RUNNING_REQUESTS:-}" ]] && decode+=(--max-running-requests "$MAX_RUNNING_REQUESTS")
  local envs=(NSA_KV_OFFLOAD=0)
  if [[ "$mode" == "offload" ]]; then
    envs=(NSA_KV_OFFLOAD=1 "NSA_DEV_CACHE_SIZE=$OFFLOAD_NSA_DEV_CACHE_SIZE")
    # 800K: what the plugin's start-up sizing admits for the W4 checkpoint on 8 x H20
    # (README's launch lines; the artifact's 1.8M does not fit beside sglang's index keys).
    decode+=(--max-total-tokens "${OFFLOAD_MAX_TOTAL_TOKENS:-800_000}")
  else
    decode+=(--mem-fraction-static 0.9)
    [[ -n "${NO_OFFLOAD_MAX_TOTAL_TOKENS:-}" ]] && decode+=(--max-total-tokens "$NO_OFFLOAD_MAX_TOTAL_TOKENS")
  fi
  start_bg "sglang-decode" "$res/decode.log" "${envs[@]}" -- "${decode[@]}"
  wait_ready "sglang-decode" "$res/decode.log" "The server is fired up and ready to roll!"
}

# launch_sglang_single MODE RES_DIR: one SGLang server (the ShareGPT mix runs this way).
launch_sglang_single() {
  local mode="$1" res="$2"
  local cmd=(python3 -m sglang.launch_server --model-path "$MODEL" --host 127.0.0.1 --port "$PORT"
    --mem-fraction-static 0.8 --disable-radix-cache --disable-overlap-schedule
    --chunked-prefill-size "${CHUNKED_PREFILL_SIZE:--1}"
    --cuda-graph-max-bs-decode "${CUDA_GRAPH_MAX_BS:-32}" "${SGLANG_PARALLEL[@]}")
  [[ -n "${MAX_RUNNING_REQUESTS:-}" ]] && cmd+=(--max-running-requests "$MAX_RUNNING_REQUESTS")
  local envs=(NSA_KV_OFFLOAD=0)
  if [[ "$mode" == "offload" ]]; then
    envs=(NSA_KV_OFFLOAD=1 "NSA_DEV_CACHE_SIZE=$OFFLOAD_NSA_DEV_CACHE_SIZE")
    cmd+=(--max-total-tokens "${OFFLOAD_MAX_TOTAL_TOKENS:-1000_000}")
  elif [[ -n "${NO_OFFLOAD_MAX_TOTAL_TOKENS:-}" ]]; then
    cmd+=(--max-total-tokens "$NO_OFFLOAD_MAX_TOTAL_TOKENS")
  fi
  start_bg "sglang-server" "$res/server.log" "${envs[@]}" -- "${cmd[@]}"
  wait_ready "sglang-server" "$res/server.log" "The server is fired up and ready to roll!"
}

# launch MODE RES_DIR TOPOLOGY: TOPOLOGY pd (a decode node, fake transfer) or single.
launch() {
  local mode="$1" res="$2" topology="$3"
  mkdir -p "$res"
  if [[ "$ENGINE" == "echo" ]]; then
    launch_echo "$mode" "$res" "$topology"
  elif [[ "$topology" == "pd" ]]; then
    launch_sglang_pd "$mode" "$res"
  else
    launch_sglang_single "$mode" "$res"
  fi
}

# bench RES_FILE_STEM RATE ARGS...: one benchmark run -> STEM.jsonl (+ STEM.log). The same
# client for both engines: it speaks SGLang's /generate protocol, and sglang 0.5.23's own
# bench_serving has no infinitebench dataset or --sort-len.
bench() {
  local stem="$1" rate="$2"; shift 2
  local cmd=("$PYTHON" -m sglang_echo.bench_serving --max-output-len "${MAX_OUTPUT_LEN:-256}" --disable-tqdm)
  cmd+=(--backend sglang --host 127.0.0.1 --port "$PORT" --model "$MODEL"
    --num-prompts "$NUM_PROMPTS" --warmup-requests "$WARMUP_REQUESTS"
    --request-rate "$rate" --output-file "$stem.jsonl" "$@")
  # POLL_COUNTERS_S: sample the server's counters that often during each run (steady_* fields)
  [[ -n "${POLL_COUNTERS_S:-}" ]] && cmd+=(--poll-counters-s "$POLL_COUNTERS_S")
  echo "bench: rate $rate -> $stem.jsonl" >&2
  "${cmd[@]}" > "$stem.log" 2>&1 || { echo "benchmark failed; see $stem.log" >&2; tail -n 5 "$stem.log" >&2; return 1; }
}
