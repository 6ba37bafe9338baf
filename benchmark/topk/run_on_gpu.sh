#!/usr/bin/env bash
# One device call (< 10 min on one H200): train the small DSA model (about 6.5 min), then
# trace held-out decodes with the trained and the untrained model and analyze them.
# Usage, from the repository root:  bash benchmark/topk/run_on_gpu.sh "$OUT"
#
# What comes back in OUT (5 files, each < 16 MiB):
#   model-*.safetensors          the checkpoint's weight shards (models/tiny-dsv32-trained/)
#   topk_traces.npz              raw per-layer, per-step selections (benchmark/results/)
#   topk_bundle.tar              everything else, paths relative to the repository root:
#                                the checkpoint's config/tokenizer/model card/train_spec,
#                                benchmark/results/topk_*.json + PNGs, and the logs
# Put them in place with:  bash benchmark/topk/unpack_gpu_out.sh <folder holding those files>
set -uo pipefail
out=${1:?usage: run_on_gpu.sh OUTDIR}
mkdir -p "$out"
export PYTHONPATH=$PWD/python:$PWD PYTHONUNBUFFERED=1  # sglang_echo; research/ (outside the wheel)
# Long (16K) and short (4K) training batches alternate: let the allocator grow segments.
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
ckpt=models/tiny-dsv32-trained
results=benchmark/results
logs=benchmark/results/topk_logs
train_budget=${TRAIN_BUDGET_S:-390}
# Extra flags (e.g. for a CPU smoke test of this script); later flags override earlier ones.
train_extra=${TRAIN_EXTRA:-}
trace_extra=${TRACE_EXTRA:-}
mkdir -p "$logs" "$results"
SECONDS=0

bundle() {  # (re)pack the small files; shards and npz travel as files of their own
  local files=()
  for f in "$ckpt"/config.json "$ckpt"/generation_config.json "$ckpt"/model.safetensors.index.json \
           "$ckpt"/tokenizer.json "$ckpt"/tokenizer_config.json "$ckpt"/README.md "$ckpt"/train_spec.json \
           "$results"/topk_train.json "$results"/topk_traces.json "$results"/topk_*.png "$logs"/*.log; do
    [ -f "$f" ] && files+=("$f")
  done
  tar -cf "$out/topk_bundle.tar" "${files[@]}"
  echo "[run] bundle: ${#files[@]} files, $(du -h "$out/topk_bundle.tar" | cut -f1)"
}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python -c "import sys, torch, triton, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee "$logs/env.log"

echo "[run] $SECONDS s: training (budget ${train_budget} s)"
timeout $((train_budget + 60)) python scripts/train_tiny_dsa.py --out "$ckpt" \
  --log-json "$results/topk_train.json" --time-budget-s "$train_budget" $train_extra 2>&1 | tee "$logs/train.log"
train_rc=${PIPESTATUS[0]}
echo "[run] $SECONDS s: training exit code $train_rc"
if ls "$ckpt"/*.safetensors >/dev/null 2>&1; then
  cp "$ckpt"/*.safetensors "$out"/
fi
bundle

left=$((570 - SECONDS - 45))
if [ "$train_rc" -eq 0 ] && [ "$left" -ge 30 ]; then
  echo "[run] $SECONDS s: tracing (limit ${left} s)"
  rm -f "$results/topk_traces.npz"
  timeout "$left" python benchmark/topk/trace.py --model "$ckpt" --out-npz "$results/topk_traces.npz" \
    $trace_extra 2>&1 | tee "$logs/trace.log"
  echo "[run] $SECONDS s: trace exit code ${PIPESTATUS[0]}"
  if [ -f "$results/topk_traces.npz" ]; then
    cp "$results/topk_traces.npz" "$out"/
    timeout $((585 - SECONDS)) python benchmark/topk/analyze.py --npz "$results/topk_traces.npz" \
      --train-json "$results/topk_train.json" --out-dir "$results" 2>&1 | tee "$logs/analyze.log" | tail -n 3
    echo "[run] $SECONDS s: analyze exit code ${PIPESTATUS[0]}"
  fi
  bundle
else
  echo "[run] skipping traces (training exit code $train_rc, ${left} s left)"
fi

python - "$results" <<'EOF' 2>&1 | tee -a "$logs/summary.log"
import json, sys
from pathlib import Path
res = Path(sys.argv[1])
train = res / "topk_train.json"
if train.is_file():
    r = json.loads(train.read_text())
    m = r["metrics"]
    print("[summary] train:", json.dumps({k: m[k] for k in ("steps_done", "dense_steps", "tokens_seen", "train_seconds", "last_train_lm", "last_train_kl")}))
    print("[summary] held-out dense/sparse:", json.dumps([m["heldout_dense"], m["heldout_sparse"]]))
    print("[summary] retrain:", r["retrain_command"])
traces = res / "topk_traces.json"
if traces.is_file():
    r = json.loads(traces.read_text())
    for key, pair in r["metrics"]["side_by_side"].items():
        print(f"[summary] {key}: " + ", ".join(f"{t} {v:.4g}" for t, v in pair.items()))
    print("[summary] oracle:", json.dumps(r["setup"].get("oracle")))
EOF
bundle >/dev/null
ls -la "$out"
echo "[run] done in $SECONDS s"
