#!/usr/bin/env bash
# Stop the servers that the e2e scripts started, and only those: each one's pid (and its
# process group, since they are started with setsid) is read from $E2E_PID_DIR/*.pid.
# Nothing is looked up by name. TERM first, KILL after a grace period.
set -euo pipefail

if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
  cat << 'EOF2'
Usage: scripts/killall_sglang.sh
Stops the processes recorded in $E2E_PID_DIR/*.pid (default .e2e/pids) by the e2e
scripts (their whole process groups), waits up to $KILL_GRACE_S seconds (default 30),
then sends KILL. Never matches processes by name.
EOF2
  exit 0
fi

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PID_DIR="${E2E_PID_DIR:-$ROOT/.e2e/pids}"
GRACE="${KILL_GRACE_S:-30}"
shopt -s nullglob
files=("$PID_DIR"/*.pid)
[[ ${#files[@]} -eq 0 ]] && exit 0

alive() { kill -0 "$1" 2> /dev/null; }
signal() {
  # The group when the pid leads one (setsid), else the single process.
  local sig="$1" pid="$2"
  kill "-$sig" -- "-$pid" 2> /dev/null || kill "-$sig" "$pid" 2> /dev/null || true
}

pids=()
for f in "${files[@]}"; do
  pid="$(tr -dc '0-9' < "$f")"
  if [[ -n "$pid" ]] && alive "$pid"; then
    pids+=("$pid")
    signal TERM "$pid"
    echo "stopping $(basename "$f" .pid) (pid $pid)" >&2
  fi
done
deadline=$((SECONDS + GRACE))
for pid in "${pids[@]}"; do
  while alive "$pid" && ((SECONDS < deadline)); do sleep 0.2; done
  if alive "$pid"; then signal KILL "$pid"; fi
done
rm -f "${files[@]}"
