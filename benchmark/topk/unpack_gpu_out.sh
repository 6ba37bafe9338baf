#!/usr/bin/env bash
# Put the files that run_on_gpu.sh returned in place (run from the repository root):
#   bash benchmark/topk/unpack_gpu_out.sh <folder holding topk_bundle.tar, model-*.safetensors, topk_traces.npz>
set -euo pipefail
src=${1:?usage: unpack_gpu_out.sh FOLDER}
ckpt=models/tiny-dsv32-trained
[ -f "$src/topk_bundle.tar" ] || { echo "error: $src/topk_bundle.tar not found" >&2; exit 1; }
mkdir -p "$ckpt" benchmark/results
rm -f "$ckpt"/*.safetensors
tar -xf "$src/topk_bundle.tar"
cp "$src"/*.safetensors "$ckpt"/
[ -f "$src/topk_traces.npz" ] && cp "$src/topk_traces.npz" benchmark/results/
ls -la "$ckpt" benchmark/results/topk_*
