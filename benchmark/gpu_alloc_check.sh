#!/usr/bin/env bash
# One device call for the cache-management kernels: their tests against the torch
# reference on CUDA, the lossless GPU tests with the kernels in place, the cache-ops bench.
# Usage on the device machine: bash benchmark/gpu_alloc_check.sh "$OUT"
set -uo pipefail
out=${1:-/tmp/echo-gpu}
mkdir -p "$out"
export PYTHONPATH=$PWD/python PYTHONUNBUFFERED=1 ECHO_REPORT_DIR=$out
python3 -m pytest -q -x -p no:cacheprovider tests/test_kernel_alloc.py tests/test_kernel_recall.py 2>&1 | tee "$out/kernel_tests.log" | tail -6
python3 benchmark/kernels/cache_ops_bench.py --out "$out" 2>&1 | tee "$out/cache_ops.log"
python3 -m pytest -q -m gpu -x -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$out/gpu_tests.log" | tail -6
