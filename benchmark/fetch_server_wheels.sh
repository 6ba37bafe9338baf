#!/usr/bin/env bash
# Download (here, where PyPI is reachable) the wheels the HTTP server needs on a machine
# that lacks them (the GPU machine has aiohttp but no fastapi/uvicorn): fastapi, uvicorn
# and their dependencies, for CPython 3.10-3.13 on x86-64 Linux. Carry the folder to that
# machine (the device tool: carry [".whl"]); benchmark/serving_sweep.sh installs from it
# offline into a private folder on PYTHONPATH.
# Usage: bash benchmark/fetch_server_wheels.sh [DIR]   (default .whl/serve)
set -euo pipefail
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
  sed -n '2,8p' "$0"
  exit 0
fi
dir="${1:-.whl/serve}"
mkdir -p "$dir"
PIP="${PIP:-.venv/bin/pip}"
for py in 3.10 3.11 3.12 3.13; do
  "$PIP" download -q --disable-pip-version-check --only-binary=:all: -d "$dir" \
    --python-version "$py" --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    "fastapi>=0.110" "uvicorn>=0.29"
done
ls "$dir"
