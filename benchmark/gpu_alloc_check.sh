set -uo pipefail
export PYTHONPATH=$PWD/python PYTHONUNBUFFERED=1 ECHO_REPORT_DIR=$OUT
python3 -m pytest -q -x -p no:cacheprovider tests/test_kernel_alloc.py tests/test_kernel_recall.py 2>&1 | tee $OUT/kernel_tests.log | tail -15
python3 benchmark/kernels/cache_ops_bench.py --out $OUT 2>&1 | tee $OUT/cache_ops.log
python3 -m pytest -q -m gpu -x -p no:cacheprovider tests/test_gpu.py 2>&1 | tee $OUT/gpu_tests.log | tail -8
