#!/usr/bin/env bash
# One device call (about 8-9 minutes on an H200): environment facts, the CUDA tests (oracle,
# lossless with CUDA-graph decode, the cache/recall/indexer kernels and decode prefetch in
# place, the scheduler with CUDA graphs), the kernel tests under the GPU machine's torch,
# then every kernel benchmark. Writes JSON, PNG and logs to OUTDIR, packed into
# OUTDIR/gpu_checks_all.tgz (unpack with tar -xzf).
# Usage on the device machine, from the repository root:
#   bash benchmark/gpu_checks.sh "$OUT" [all|tests|benches] [BENCH...]
# `tests` or `benches` alone fit a call comfortably if both together come near the 10-minute
# limit; BENCH names (cache_ops decode_prefetch prefill_prefetch recall indexer sparse_mla)
# pick benchmarks.
set -uo pipefail
out=${1:-/tmp/echo-gpu}
part=${2:-all}
benches=("${@:3}")
[ ${#benches[@]} -gt 0 ] || benches=(cache_ops decode_prefetch prefill_prefetch recall indexer sparse_mla)
case "$part" in all|tests|benches) ;; *) echo "part must be all, tests or benches, got $part" >&2; exit 2;; esac
mkdir -p "$out"
res=$(mktemp -d)  # results, packed into OUTDIR at the end
# Keeps what the caller put on PYTHONPATH (device_session.sh puts FlashInfer there when
# .peer is carried, for the peer benchmarks).
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 ECHO_REPORT_DIR=$res
SECONDS=0
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee "$res/env.txt"
step() { echo "[gpu_checks] ${SECONDS}s: $*"; }
if [ "$part" != benches ]; then
step "CUDA tests"
python3 -m pytest -q -m gpu -s -p no:cacheprovider --durations=25 tests/test_gpu.py tests/test_serving_gpu.py tests/test_fp8_kv.py tests/test_kernel_alloc.py \
  tests/test_kernel_sparse_mla.py tests/test_kernel_topk.py tests/repo/test_kernel_topk_pivot.py 2>&1 | tee "$res/gpu_tests.log" | tail -45
step "kernel and model tests under this torch"
python3 -m pytest -q -p no:cacheprovider tests/test_kernel_alloc.py tests/test_kernel_release.py tests/test_kernel_recall.py \
  tests/test_kernel_indexer.py tests/test_kernel_decode_stage.py tests/test_kernel_prefill_prefetch.py tests/test_kernel_decode_write.py \
  tests/test_kernel_topk.py tests/repo/test_kernel_topk_pivot.py tests/test_kernel_sparse_mla.py tests/test_model_oracle.py tests/test_indexer.py 2>&1 | tee "$res/kernel_tests.log" | tail -5
fi
[ "$part" = tests ] && benches=()
for bench in ${benches[@]+"${benches[@]}"}; do
  step "benchmark $bench"
  python3 benchmark/kernels/${bench}_bench.py --out "$res" 2>&1 | tee "$res/${bench}_bench.log" | tail -14
done
step "done"
# The device returns a limited number of files: everything travels in one archive.
tar -czf "$out/gpu_checks_all.tgz" -C "$res" .
rm -rf "$res"
ls -la "$out"
