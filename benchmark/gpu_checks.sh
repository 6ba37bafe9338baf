#!/usr/bin/env bash
# One device call: environment facts, the CUDA test suite (oracle fp32/bf16, lossless with
# CUDA-graph decode and sync checks), then the CPU suites under the GPU machine's torch.
# Usage on the device machine: bash benchmark/gpu_checks.sh "$OUT"
set -uo pipefail
out=${1:-/tmp/echo-gpu}
mkdir -p "$out"
export PYTHONPATH=$PWD/python PYTHONUNBUFFERED=1 ECHO_REPORT_DIR=$out
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee "$out/env.txt"
python3 -m pytest -q -m gpu -s -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$out/gpu_tests.log" | tail -40
python3 -m pytest -q -p no:cacheprovider tests/test_model_oracle.py tests/test_kernel_recall.py tests/test_kernel_indexer.py tests/test_indexer.py -x 2>&1 | tee "$out/cpu_tests_torch211.log" | tail -5
python3 benchmark/kernels/recall_bench.py --out "$out" 2>&1 | tee "$out/recall_bench.log" | tail -5
python3 benchmark/kernels/cache_ops_bench.py --out "$out" 2>&1 | tee "$out/cache_ops_bench.log" | tail -3
python3 benchmark/kernels/indexer_bench.py --out "$out" 2>&1 | tee "$out/indexer_bench.log" | tail -3
