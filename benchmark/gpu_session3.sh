set -uo pipefail
export PYTHONPATH=$PWD/python PYTHONUNBUFFERED=1 ECHO_REPORT_DIR=$OUT
python3 benchmark/kernels/cache_ops_bench.py --out $OUT 2>&1 | tee $OUT/cache_ops.log
python3 benchmark/kernels/prefill_prefetch_bench.py --out $OUT 2>&1 | tee $OUT/prefill_prefetch.log | tail -20
python3 -m pytest -q --runxfail -m gpu -x -p no:cacheprovider tests/test_serving_gpu.py 2>&1 | tee $OUT/serving_gpu.log | tail -15
