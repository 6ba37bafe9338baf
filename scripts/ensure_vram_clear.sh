#!/usr/bin/env bash
# Wait until the processes the e2e scripts started are gone and, where nvidia-smi exists,
# until no GPU memory is held by them (pids in $E2E_PID_DIR/*.pid, and their process
# groups). Never inspects or stops other processes. Bounded by $VRAM_WAIT_S (default 120).
set -euo pipefail

if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
  cat << 'EOF2'
Usage: scripts/ensure_vram_clear.sh
Waits (at most $VRAM_WAIT_S seconds, default 120) until the processes recorded by the e2e
scripts in $E2E_PID_DIR (default .e2e/pids) and their process groups have exited and
hold no GPU memory. Exits 1 if they still do; it never kills anything itself (see
scripts/killall_sglang.sh).
EOF2
  exit 0
fi

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PID_DIR="${E2E_PID_DIR:-$ROOT/.e2e/pids}"
WAIT="${VRAM_WAIT_S:-120}"
shopt -s nullglob

ours() {
  # Live pids of recorded processes and of their process groups.
  local f pid
  for f in "$PID_DIR"/*.pid; do
    pid="$(tr -dc '0-9' < "$f")"
    [[ -z "$pid" ]] && continue
    kill -0 "$pid" 2> /dev/null && echo "$pid"
    ps -o pid= -g "$pid" 2> /dev/null | tr -d ' ' || true
  done | sort -u
}

gpu_held() {
  command -v nvidia-smi > /dev/null || return 1
  local mine; mine="$(ours)"
  [[ -z "$mine" ]] && return 1
  nvidia-smi --query-compute-apps=pid --format=csv,noheader 2> /dev/null | tr -d ' ' \
    | grep -Fxq -f <(echo "$mine")
}

deadline=$((SECONDS + WAIT))
while [[ -n "$(ours)" ]] || gpu_held; do
  if ((SECONDS > deadline)); then
    echo "processes started by the e2e scripts still running or holding GPU memory: $(ours | tr '\n' ' ')" >&2
    exit 1
  fi
  sleep 1
done
