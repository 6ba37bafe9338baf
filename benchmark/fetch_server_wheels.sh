#!/usr/bin/env bash
# Download (here, where PyPI is reachable) the wheels the HTTP server needs on a machine
# that lacks them (the GPU machine has aiohttp but no fastapi/uvicorn): fastapi, uvicorn
# and their dependencies, for CPython 3.11-3.13 on x86-64 Linux (the package needs >= 3.11;
# the GPU machine runs 3.12). Carry the folder to that machine (the device tool: carry
# [".whl"]); benchmark/serving_sweep.sh installs from it offline into a private folder on
# PYTHONPATH. PY_VERSIONS="3.12" fetches for those versions only (each 3.11 or later).
# Usage: bash benchmark/fetch_server_wheels.sh [DIR]   (default .whl/serve)
set -euo pipefail
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
  sed -n '2,8p' "$0"
  exit 0
fi
dir="${1:-.whl/serve}"
PIP="${PIP:-.venv/bin/pip}"
# pip derives the cp3XX interpreter and ABI tags from --python-version.
PY_VERSIONS="${PY_VERSIONS:-3.11 3.12 3.13}"
for py in $PY_VERSIONS; do
  if ! [[ "$py" =~ ^3\.([0-9]+)$ ]] || (( BASH_REMATCH[1] < 11 )); then
    echo "error: PY_VERSIONS holds '$py'; the package needs Python >= 3.11 (pyproject.toml)," \
      "so give versions such as 3.11 3.12" >&2
    exit 2
  fi
done
mkdir -p "$dir"
for py in $PY_VERSIONS; do
  "$PIP" download -q --disable-pip-version-check --only-binary=:all: -d "$dir" \
    --python-version "$py" --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    "fastapi>=0.110" "uvicorn>=0.29" "pyzmq>=25"
done
ls "$dir"
