#!/usr/bin/env bash
# Every H200 measurement behind the README, each stage under its own time limit and packed
# into OUTDIR as it finishes (a call cut short still returns what ran). Records keep the
# commands that made them. Stage times seen on 2026-12-01 (a call is at most 10 minutes):
# tests ~490 s, kernels ~300 s, study ~165 s (5 repeats; ~210 s on 2026-12-03), study_fp8 ~80 s,
# topk ~120 s, cache ~75 s (with its tests and the launch-shape sweep it ran then ~450 s on 2026-12-03),
# mla_profile ~20 s, indexer_profile ~25 s; topk_peer ~5 min (est.: the FlashInfer top-k JIT build is ~4).
# On 2026-12-05 sweep_200k and sharegpt ran past 200 s (their limits now 280 / 330 s).
# On 2026-12-06 (an H100, warm): itl_trace 103 s, sweep 196 s, sweep_200k 173 s, sweep_110k 197 s,
# tasks 115 s, sharegpt 238 s, served_vs_study 380 s (Figures 12-15 in three calls); later that
# day (an H100): harness 93 s, served_vs_study at 318 prompts 287 s, tasks_repeats 454 s.
#   bash benchmark/device_session.sh OUTDIR tests                          # one call
#   bash benchmark/device_session.sh OUTDIR kernels mla_profile study     # one call
#   bash benchmark/device_session.sh OUTDIR topk study_fp8                # one call
#   bash benchmark/device_session.sh OUTDIR cache                          # one call
#   bash benchmark/device_session.sh OUTDIR topk_peer                     # one call (.peer carried)
#   bash benchmark/device_session.sh OUTDIR e2e      # decode-node sweep + the study, bf16 and fp8 (~9 min)
#   bash benchmark/device_session.sh OUTDIR figures  # Figure 13 at 110K, 14 and 15 (past one call's 10 min: name two)
# (`checks` = tests + kernels, more than one call's 10 minutes now: name the stages. The
# GPU tests in three calls: cuda_tests_graphs, cuda_tests_rest, kernel_tests.)
# Records that name their commit read ECHO_COMMIT: give the sha literally (the tree's git on
# the device machine is the last landed commit, so `$(git rev-parse HEAD)` expanded there lies).
# Carry .whl (bash benchmark/fetch_server_wheels.sh) for the sweep's web stack, and .peer for
# FlashInfer beside our sparse MLA (checks) and top-k (topk_peer).
set -uo pipefail
usage="usage: device_session.sh OUTDIR checks|e2e|figures|STAGE... (stages: arrival_probe ingress_probe step_trace readback_ab itl_ab itl_trace served_equal mtp_served mtp_study admission_probe cuda_tests_graphs cuda_tests_rest capture_probe graph_repeats served_vs_study harness tests kernel_tests kernels release mla_profile decode_stage prefetch_tests prefetch_profile prefetch_study indexer_profile cache cache_bench cache_profile topk topk_peer prefetch sweep sweep_200k sweep_110k tasks tasks_repeats sharegpt study study_fp8)"
out=${1:?$usage}
shift
[ $# -gt 0 ] || { echo "$usage" >&2; exit 2; }
mkdir -p "$out"
export PYTHONPATH=$PWD/python PYTHONUNBUFFERED=1
if [ -d .triton_cache ]; then  # compiled kernels carried from an earlier call (same GPU, Triton)
  export TRITON_CACHE_DIR=$PWD/.triton_cache
  echo "[device_session] Triton cache carried: $(du -sh .triton_cache | cut -f1)"
fi
SECONDS=0
stage() {  # stage NAME LIMIT_S COMMAND...: run, log, pack NAME.tgz from /tmp/ds/NAME
  local name=$1 limit=$2
  shift 2
  # Emptied first: a warm machine keeps /tmp between calls, and a stage that writes fewer
  # files than the last one (other rates) would pack the last call's beside its own.
  rm -rf "/tmp/ds/$name"
  mkdir -p "/tmp/ds/$name"
  echo "[device_session] ${SECONDS}s: $name (limit ${limit}s)"
  timeout "$limit" "$@" > "/tmp/ds/$name/$name.log" 2>&1
  echo "[device_session] $name exit $?"
  tail -6 "/tmp/ds/$name/$name.log"
  tar -czf "$out/$name.tgz" -C /tmp/ds "$name"
}
peer_env() {  # FlashInfer from the carried .peer/ bundle on PYTHONPATH (once per call); fails without it
  [ -n "${PEER_SITE:-}" ] && return 0
  [ -f .peer/flashinfer_trim.tar.xz ] || return 1
  local site
  site=$(mktemp -d)
  python3 -m pip install -q --no-index --no-deps --target "$site" .peer/apache_tvm_ffi*.whl \
    && tar -xJf .peer/flashinfer_trim.tar.xz -C "$site" || return 1
  if [ -f .peer/flashinfer_topk_sm90a.so.gz ]; then  # a top-k module built on an earlier machine (gzipped: a call carries 64 MiB)
    mkdir -p "$site/flashinfer/data/aot/topk" && gunzip -c .peer/flashinfer_topk_sm90a.so.gz > "$site/flashinfer/data/aot/topk/topk.so"
  fi
  export PYTHONPATH="$site:$PYTHONPATH" FLASHINFER_CUDA_ARCH_LIST=9.0a FLASHINFER_TOPK_ALGO=default PEER_SITE=$site
}
peer_or_say() {  # FlashInfer where .peer is carried (the peer benchmarks), else say so
  peer_env || echo "[device_session] no .peer/ bundle carried: FlashInfer is absent"
}
run_stage() {
  case "$1" in
    tests) stage tests 555 bash benchmark/gpu_checks.sh /tmp/ds/tests tests ;;  # 321-397 s of CUDA tests seen, then the kernel tests
    kernels)
      # FlashInfer's MLA decode beside our sparse MLA where the peer bundle is carried (.peer/,
      # gitignored: flashinfer-python 0.7.2.post1 for cp312, its wheel trimmed to the Python
      # modules, headers and the top-k and batch-MLA sources as flashinfer_trim.tar.xz, and
      # the apache_tvm_ffi wheel it needs; 62 MB untrimmed); its JIT build takes ~20 s.
      peer=""
      peer_env && peer="--peer flashinfer"
      stage kernels 360 bash -c "python3 benchmark/kernels/sparse_mla_bench.py --out /tmp/ds/kernels \
        --batches 3,17,48 $peer; for b in recall cache_ops indexer; do
        python3 benchmark/kernels/\${b}_bench.py --out /tmp/ds/kernels; done" ;;
    mla_profile)  # Nsight Compute on one decode sparse-MLA launch at batches 3 and 48: what
      # its warps stall on (needs ncu's hardware counters: the Firecracker machines have them)
      stage mla_profile 120 bash -c 'n=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
        for b in 3 48; do "$n" --clock-control none -k regex:_sparse_mla_kernel -c 1 \
          --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \
          --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
          python3 benchmark/kernels/sparse_mla_once.py --batch $b > /tmp/ds/mla_profile/ncu_b$b.txt 2>&1
          echo "batch $b: ncu exit $?"; done' ;;
    cache_profile)  # Nsight Compute on the look-back resolve's first launch at batch 48 (a graph
      # replay past cache_ops_bench --profile's 20 warm-up resolves): what its warps stall on
      stage cache_profile 150 bash -c 'n=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
        "$n" --clock-control none -k regex:_lookup_rank_kernel --launch-skip 20 -c 1 \
          --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats \
          --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
          python3 benchmark/kernels/cache_ops_bench.py --profile > /tmp/ds/cache_profile/ncu_lookup_rank.txt 2>&1
        echo "ncu exit $?"' ;;
    indexer_profile)  # Nsight Compute on one decode indexer step at batches 1 and 48: the fp8
      # logits launch and the radix top-k's six, what bounds each (DRAM, issue, stalls)
      stage indexer_profile 150 bash -c 'n=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
        for b in 1 48; do "$n" --clock-control none -k "regex:_fp8_index_logits_kernel|_hist_kernel|_split_kernel|_cand_hist_kernel|_count_kernel|_collect_kernel" -c 7 \
          --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats \
          --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
          python3 benchmark/kernels/indexer_once.py --batch $b > /tmp/ds/indexer_profile/ncu_b$b.txt 2>&1
          echo "batch $b: ncu exit $?"; done' ;;
    release)  # the batched release of a finished request (kernels/release.py) against the
      # per-layer torch release it replaced, at 61 layers x 260K slots x 2M host tokens
      stage release 150 python3 benchmark/kernels/release_bench.py --out /tmp/ds/release ;;
    cache)  # the cache kernels' GPU tests, then their benchmark (launch chaining beside)
      # its GPU tests took 161 s on 1651a32
      stage cache 520 bash -c "python3 -m pytest -q -p no:cacheprovider tests/test_kernel_alloc.py \
        tests/test_kernel_recall.py tests/test_kernel_topk_rows.py tests/test_pdl.py tests/test_decode_write.py tests/test_kernel_decode_write.py \
        && python3 benchmark/kernels/cache_ops_bench.py --out /tmp/ds/cache" ;;
    cache_bench)  # the cache kernels' benchmark alone, no tests (~75 s)
      stage cache_bench 200 python3 benchmark/kernels/cache_ops_bench.py --out /tmp/ds/cache_bench ;;
    topk)  # both top-k kernels' tests, the GPU-marked ones too (the pivot's exactness at full
      # scale, which must pass before SGLANG_ECHO_TOPK_PIVOT=1 is allowed on CUDA again),
      # then the indexer bench (the pivot's states beside)
      stage topk 200 bash -c "python3 -m pytest -q -p no:cacheprovider -m 'gpu or not gpu' tests/test_kernel_topk.py \
        tests/repo/test_kernel_topk_pivot.py && python3 benchmark/kernels/indexer_bench.py --out /tmp/ds/topk" ;;
    topk_peer)  # FlashInfer's radix top-k beside ours (.peer carried): its top-k JIT build
      # takes ~4 minutes on a fresh machine, then the sets are checked and both timed. The
      # module it built comes back as OUTDIR/flashinfer_topk_sm90a.so.gz: copied into .peer/,
      # peer_env installs it as FlashInfer's prebuilt (AOT) module, and the next machine
      # skips the build.
      peer_or_say
      stage topk_peer 420 python3 benchmark/kernels/topk_peer_bench.py --out /tmp/ds/topk_peer
      local built
      built=$(ls ~/.cache/flashinfer/*/*/cached_ops/topk/topk.so 2>/dev/null | head -1)
      [ -n "$built" ] && gzip -c "$built" > "$out/flashinfer_topk_sm90a.so.gz" ;;
    kernel_tests)  # gpu_checks.sh's second step alone: the kernel and model tests, this torch
      stage kernel_tests 240 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_alloc.py tests/test_kernel_release.py \
        tests/test_kernel_recall.py tests/test_kernel_indexer.py tests/test_kernel_decode_stage.py \
        tests/test_kernel_prefill_prefetch.py tests/test_kernel_topk.py tests/repo/test_kernel_topk_pivot.py tests/test_kernel_sparse_mla.py \
        tests/test_model_oracle.py tests/test_indexer.py tests/test_pdl.py tests/test_decode_write.py tests/test_kernel_decode_write.py ;;
    decode_stage)  # the staged decode prefetch: its kernels' and the recall's GPU tests, then
      # the decode prefetch benchmark (staged and unfused, interleaved rounds)
      stage decode_stage 330 bash -c "python3 -m pytest -q -p no:cacheprovider \
        tests/test_kernel_decode_stage.py tests/test_kernel_recall.py \
        tests/test_kernel_indexer.py && python3 benchmark/kernels/decode_prefetch_bench.py --out /tmp/ds/decode_stage" ;;
    prefetch_tests)  # the CUDA tests of decode prefetch: lossless through the runtime's decode
      # graphs (off, the chunked design, auto; under eviction); 484 s on 60fdcee (a cold
      # machine, with the designs since removed), so a call of its own
      stage prefetch_tests 580 python3 -m pytest -q -m gpu -s -p no:cacheprovider tests/test_gpu.py \
        -k "lossless_cuda_graph_decode" ;;
    prefetch_profile)  # one graph replay of the unfused and the staged decode step under the
      # profiler at hit 1.0, 0.9 and 0.5: the kernels in start order, where the fixed cost lies
      stage prefetch_profile 150 python3 benchmark/kernels/decode_prefetch_bench.py --profile 1.0,0.9,0.5 ;;
    prefetch_study)  # the decode prefetch under its rule (auto, the default) end to end: echo_paper beside
      # echo_noprefetch (off) and no-offload at the paper's setting and the random-keys run
      stage prefetch_study 300 python3 benchmark/e2e_study.py --out /tmp/ds/prefetch_study \
        --decode-prefetch --only echo_paper,noff_paper,echo_noprefetch --locality-sweep "" --repeats 3 \
        --profile-steps 0 --skip-components --deadline-s 230 ;;
    prefetch)  # the prefetch benchmarks and the indexer (with top-k launch shapes) again
      stage prefetch 200 bash benchmark/gpu_checks.sh /tmp/ds/prefetch benches decode_prefetch \
        prefill_prefetch indexer ;;
    cuda_tests_graphs)  # the CUDA tests, first of three calls (then cuda_tests_rest and
      # kernel_tests; `tests` no longer fits one call): lossless through decode graphs and
      # the serving scheduler's GPU tests, start-up capture and its failure included
      stage cuda_tests_graphs 570 bash -c "python3 -m pytest -q -m gpu -s -p no:cacheprovider \
        --durations=10 tests/test_gpu.py -k 'lossless_cuda_graph_decode'; \
        python3 -m pytest -q -m gpu -s -p no:cacheprovider --durations=10 tests/test_serving_gpu.py \
        tests/test_speculative_gpu.py" ;;
    cuda_tests_rest)  # the other CUDA tests: oracle on CUDA, fp8 KV with graphs, the cache, sparse-MLA and top-k kernels on the GPU
      stage cuda_tests_rest 480 python3 -m pytest -q -m gpu -s -p no:cacheprovider --durations=15 \
        tests/test_gpu.py -k "not lossless_cuda_graph_decode" tests/test_fp8_kv.py tests/test_kernel_alloc.py \
        tests/test_kernel_sparse_mla.py tests/test_kernel_topk.py tests/repo/test_kernel_topk_pivot.py ;;
    capture_probe)  # which host events invalidate a CUDA-graph capture here (~30 s)
      stage capture_probe 150 python3 benchmark/capture_probe.py \
        --out /tmp/ds/capture_probe/capture_probe.json ;;
    graph_repeats)  # the start-up-capture, lossless decode-graph and MTP-round graph tests, each round all of
      # them in one process (the suite's pattern), ROUNDS rounds (default 5), PARALLEL of them at
      # once (default 5: one compiling round is ~255 s, a warm one ~85 s), within the limit
      stage graph_repeats 570 python3 benchmark/gpu_repeats.py --rounds "${ROUNDS:-5}" \
        --parallel "${PARALLEL:-5}" --round-timeout-s 540 \
        --deadline-s "${REPEATS_DEADLINE_S:-420}" --commit "${ECHO_COMMIT:-}" \
        --out /tmp/ds/graph_repeats/gpu_lossless_repeats.json \
        tests/test_serving_gpu.py::test_engines_one_after_another_capture_at_startup \
        tests/test_serving_gpu.py::test_scheduler_with_cuda_graphs_is_lossless \
        "tests/test_gpu.py::test_lossless_cuda_graph_decode[dtype1-True]" \
        tests/test_speculative_gpu.py::test_rounds_from_cuda_graphs_are_lossless_under_echo ;;
    served_vs_study)  # the in-process study at the paper's setting and the served Figure-12
      # sweep (rates 1 and inf, 96 prompts) in one call -> served_vs_study.json (~6 min); the
      # servers run their engine in a process of its own (ENGINE_PROCESS=0: in-process).
      # SERVED_RATES / SERVED_PROMPTS change the sweep (318 prompts at rate inf: ramp and
      # drain weigh less; ~5 min); its prompts take the study's lengths
      # (SERVED_INPUT_RANGE, default 100000,108000: the study's 17 fit the pool as they do there)
      local knobs="ENGINE_PROCESS=${ENGINE_PROCESS:-1} SERVED_RATES=${SERVED_RATES:-1,inf} SERVED_PROMPTS=${SERVED_PROMPTS:-96} SERVED_INPUT_RANGE=${SERVED_INPUT_RANGE:-100000,108000}"
      stage served_vs_study 580 bash -c "python3 benchmark/e2e_study.py \
        --out /tmp/ds/served_vs_study/study --only noff_paper,echo_paper --repeats 3 \
        --no-random-keys --locality-sweep '' --skip-components --skip-fixed --profile-steps 0 \
        --deadline-s 120; env ENGINE_PROCESS=${ENGINE_PROCESS:-1} POLL_COUNTERS_S=0.5 \
        INFINI_INPUT_RANGE=${SERVED_INPUT_RANGE:-100000,108000} \
        RATES=${SERVED_RATES:-1,inf} NUM_PROMPTS=${SERVED_PROMPTS:-96} \
        MAX_OUTPUT_LEN=128 WARMUP_REQUESTS=24 bash benchmark/e2e_sweep.sh /tmp/ds/served_vs_study/sweep; \
        python3 -m benchmark.served_vs_study --study /tmp/ds/served_vs_study/study \
        --sweep /tmp/ds/served_vs_study/sweep --commit '${ECHO_COMMIT:-}' \
        --out /tmp/ds/served_vs_study/served_vs_study.json \
        --command '$knobs bash benchmark/device_session.sh OUTDIR served_vs_study'" ;;
    served_equal)  # SGLANG_ECHO_BATCH_INVARIANT=1: the study worker's batch invariance through
      # decode graphs (its GPU test), then both servers at rate inf, where their batches
      # differ -> served_equal.json: equal tokens for every request (.whl carried; est. ~4 min)
      stage served_equal 540 bash -c "python3 -m pytest -q -m gpu -p no:cacheprovider \
        tests/repo/test_study_batch_invariant.py; export SGLANG_ECHO_BATCH_INVARIANT=1; \
        env ENGINE_PROCESS=${ENGINE_PROCESS:-1} RATES=inf NUM_PROMPTS=48 MAX_OUTPUT_LEN=64 \
        WARMUP_REQUESTS=8 bash benchmark/e2e_sweep.sh /tmp/ds/served_equal/sweep; \
        python3 -m benchmark.served_equal --sweep /tmp/ds/served_equal/sweep \
        --out /tmp/ds/served_equal/served_equal.json --commit '${ECHO_COMMIT:-}' \
        --command 'bash benchmark/device_session.sh OUTDIR served_equal'" ;;
    mtp_study)  # MTP rounds against plain decode (batch 1) and ECHO against no-offload with MTP
      # (the paper setting), forced acceptance p = 0.85, S = 1 (benchmark/mtp_study.py; est. ~6 min)
      stage mtp_study 540 python3 benchmark/mtp_study.py --out /tmp/ds/mtp_study \
        --commit "${ECHO_COMMIT:-}" --command "bash benchmark/device_session.sh OUTDIR mtp_study" ;;
    mtp_served)  # the e2e MTP sweep test on the GPU: both decode nodes (tiny checkpoint with a
      # NextN layer) serve MTP rounds through HTTP, ECHO's tokens equal no-offload's (.whl carried)
      stage mtp_served 300 bash -c 'export PYTHON=python3; source benchmark/web_stack.sh \
        && ensure_web_stack /tmp/mtp_served_web && python3 -m pytest -q -p no:cacheprovider -s \
        tests/repo/test_e2e_scripts.py::test_infini_sweep_with_mtp' ;;
    admission_probe)  # the decode node's engine without HTTP (benchmark/decode_node_probe.py):
      # where admission's engine-thread time goes at 100K tokens, with a cProfile of it (~2 min; est.)
      stage admission_probe 240 bash -c "python3 -m benchmark.study.worker_spec \
        --out /tmp/ds/admission_probe/model && python3 benchmark/decode_node_probe.py \
        --model /tmp/ds/admission_probe/model --backend echo --num-prompts 24 \
        --out /tmp/ds/admission_probe/clock.json --profile /tmp/ds/admission_probe/admit.prof" ;;
    arrival_probe)  # one decode-node arrival taken apart (benchmark/arrival_probe.py): its
      # start-to-arrival time alone, the writes' span on the transfer's stream, the writer's host
      # time, device time by kernel and copy, against a plain device-to-pinned copy (est. ~2 min)
      stage arrival_probe 200 python3 benchmark/arrival_probe.py --out /tmp/ds/arrival_probe \
        --commit "${ECHO_COMMIT:-}" --command "bash benchmark/device_session.sh OUTDIR arrival_probe" ;;
    step_trace)  # the decode node's engine without HTTP (benchmark/decode_node_probe.py), 64
      # prompts at once, 128 tokens each: its efficiency untraced, then a profiler trace of 100
      # decode steps of the steady state folded by benchmark/device_timeline.py (est. ~2 min)
      local d=/tmp/ds/step_trace
      stage step_trace 300 bash -c "python3 -m benchmark.study.worker_spec --out /tmp/step_trace_model \
        && python3 benchmark/decode_node_probe.py --model /tmp/step_trace_model --backend echo \
        --num-prompts 64 --output-len 128 --out $d/clock_untraced.json \
        && python3 benchmark/decode_node_probe.py --model /tmp/step_trace_model --backend echo \
        --num-prompts 64 --output-len 128 --out $d/clock.json --trace $d/window \
        --trace-after 200 --trace-steps 100; gzip -f $d/window/trace.json" ;;
    readback_ab)  # the decode node's engine without HTTP, 64 prompts at once: step results read
      # back by the engine's stores into pinned memory against torch's copy-engine copies,
      # interleaved, ROUNDS (default 2) of each -> readback_ab/*.json (est. ~3 min)
      local d=/tmp/ds/readback_ab
      stage readback_ab 330 bash -c "python3 -m benchmark.study.worker_spec --out /tmp/step_trace_model \
        && for r in \$(seq ${ROUNDS:-2}); do for arm in kernel torch; do \
        python3 benchmark/decode_node_probe.py --model /tmp/step_trace_model --backend echo \
        --num-prompts 64 --output-len 128 --readback \$arm --out $d/\${arm}_\$r.json \
        | grep -E 'efficiency|output_tok_per_s'; done; done" ;;
    itl_ab)  # the decode node's engine without HTTP at batch 1 (one prompt of the study's
      # lengths, 512 tokens), where nothing needs offloading: ECHO's and no-offload's wall and
      # device ms per decode step, interleaved, ROUNDS (default 2) of each -> itl_ab/*.json.
      # ECHO_ARMS="SGLANG_ECHO_PDL=0 SGLANG_ECHO_RESOLVE_OVERLAP=0": more ECHO arms in the
      # same rounds, each with its switch in the environment (~40 s an arm and round).
      # AB_BATCH=16 (AB_OUTPUT_LEN, default 512): that many prompts at once instead, with the
      # sweep's device cache, so a loaded step with misses is A/B'd the same way; AB_BASE
      # (default "echo no-offload"): the arms every round starts with
      local d=/tmp/ds/itl_ab
      stage itl_ab 560 bash -c "python3 -m benchmark.study.worker_spec --out /tmp/step_trace_model \
        && for r in \$(seq ${ROUNDS:-2}); do for arm in ${AB_BASE:-echo no-offload} ${ECHO_ARMS:-}; do \
        case \$arm in *=*) be=echo sw=\$arm tag=echo_\${arm//=/_} ;; *) be=\$arm sw= tag=\$arm ;; esac; \
        echo \"== \$tag round \$r\"; env \$sw python3 benchmark/decode_node_probe.py \
        --model /tmp/step_trace_model --backend \$be --num-prompts ${AB_BATCH:-1} --min-len 100000 \
        --max-len 108000 --output-len ${AB_OUTPUT_LEN:-512} --out $d/\${tag}_\$r.json | grep -E 'efficiency|ms_per_step'; done; done; \
        python3 benchmark/itl_ab_summary.py --runs $d --out $d/summary.json \
        --runs-commit '${ECHO_COMMIT:-}' --commit '${ECHO_COMMIT:-}' --measured-by \
        'ECHO_ARMS=\"${ECHO_ARMS:-}\" AB_BASE=\"${AB_BASE:-}\" AB_BATCH=${AB_BATCH:-1} AB_OUTPUT_LEN=${AB_OUTPUT_LEN:-512} ROUNDS=${ROUNDS:-2} bash benchmark/device_session.sh OUTDIR itl_ab' > /dev/null" ;;
    itl_trace)  # itl_ab's batch 1 with a profiler trace of 100 decode steps of each engine
      # (after 150): every kernel's count and device time in the window (ops_by_name of each
      # summary), so ECHO's extra work per step is read by name, and each ECHO arm laid beside
      # no-offload layer by layer (benchmark/trace_layers.py -> layers_ARM.json); ECHO_ARMS as
      # for itl_ab (~50 s an arm); the raw traces stay on the machine (/tmp/ds_traces: with
      # three arms or more the packed folder outgrew what a call brings back)
      local d=/tmp/ds/itl_trace
      stage itl_trace 420 bash -c "python3 -m benchmark.study.worker_spec --out /tmp/step_trace_model \
        && for arm in no-offload echo ${ECHO_ARMS:-}; do \
        case \$arm in *=*) be=echo sw=\$arm tag=echo_\${arm//=/_} ;; *) be=\$arm sw= tag=\$arm ;; esac; \
        echo \"== \$tag\"; env \$sw python3 benchmark/decode_node_probe.py --model /tmp/step_trace_model \
        --backend \$be --num-prompts 1 --min-len 100000 --max-len 108000 --output-len 300 \
        --out $d/\$tag.json --trace $d/\$tag --trace-after 150 --trace-steps 100 | grep -E 'ms_per_step'; \
        mkdir -p /tmp/ds_traces && gzip -c $d/\$tag/trace.json > /tmp/ds_traces/\$tag.json.gz \
        && rm $d/\$tag/trace.json; [ \$be = echo ] && python3 -m benchmark.trace_layers \
        /tmp/ds_traces/no-offload.json.gz /tmp/ds_traces/\$tag.json.gz --layers 8 --out $d/layers_\$tag.json > /dev/null; \
        done" ;;
    ingress_probe)  # the HTTP front alone (benchmark/ingress_probe.py, CPU only; .whl carried):
      # 96 prompts of 104,857 tokens sent at once, parsed on one thread against asyncio's pool
      stage ingress_probe 200 bash -c 'export PYTHON=python3; source benchmark/web_stack.sh \
        && ensure_web_stack /tmp/ingress_web && python3 benchmark/ingress_probe.py \
        --out /tmp/ds/ingress_probe --commit "${ECHO_COMMIT:-}" \
        --command "bash benchmark/device_session.sh OUTDIR ingress_probe"' ;;
    sweep)
      stage sweep 230 env RATES=4,inf NUM_PROMPTS=96 MAX_OUTPUT_LEN=128 WARMUP_REQUESTS=24 \
        bash benchmark/e2e_sweep.sh /tmp/ds/sweep/e2e_sweep ;;
    sweep_200k | sweep_110k)  # Figure 13: both pools at 200K / 110K tokens, finite rates too
      local pool=${1#sweep_}
      pool=${pool%k}000
      stage "$1" 280 env NO_OFFLOAD_TOKENS="$pool" DEV_CACHE="$pool" RATES=2,inf NUM_PROMPTS=48 \
        MAX_OUTPUT_LEN=128 WARMUP_REQUESTS=24 bash benchmark/e2e_sweep.sh "/tmp/ds/$1/e2e_sweep_$pool" ;;
    tasks)  # Figure 14: the four InfiniteBench task mixes (synthetic lengths) at rate inf
      stage tasks 240 env INFINI=0 TASKS=1 TASK_RATES=inf TASK_NUM_PROMPTS=32 MAX_OUTPUT_LEN=128 \
        WARMUP_REQUESTS=24 bash benchmark/e2e_sweep.sh /tmp/ds/tasks/e2e_sweep_tasks ;;
    tasks_repeats)  # Figure 14's tasks REPEATS times (default 3; ~115 s each), one server pair a
      # run, folded by benchmark/task_spread.py -> tasks_repeats/task_spread.json (each task's
      # ratio per run with its median and range, each run's first token per backend)
      local d=/tmp/ds/tasks_repeats runs=""
      for r in $(seq "${REPEATS:-3}"); do runs+=" $d/run_$r"; done
      stage tasks_repeats 570 bash -c "for r in $runs; do env INFINI=0 TASKS=1 TASK_RATES=inf \
        TASK_NUM_PROMPTS=32 MAX_OUTPUT_LEN=128 WARMUP_REQUESTS=24 bash benchmark/e2e_sweep.sh \$r; \
        done; python3 benchmark/task_spread.py --runs$runs --out $d/task_spread.json \
        --commit '${ECHO_COMMIT:-}' --command 'REPEATS=${REPEATS:-3} bash benchmark/device_session.sh OUTDIR tasks_repeats'" ;;
    sharegpt)  # Figure 15: ShareGPT-like chats on one prefill + decode server
      stage sharegpt 330 env INFINI=0 SHAREGPT=1 NUM_PROMPTS=48 RATES=1,4,inf \
        bash benchmark/e2e_sweep.sh /tmp/ds/sharegpt/e2e_sweep_sharegpt ;;
    # Five interleaved repeats per ratio (issue 29: the cost without pressure is smaller
    # than two repeats' spread): ~165 s on an H200.
    study) stage study 300 python3 benchmark/e2e_study.py --out /tmp/ds/study --repeats 5 --deadline-s 260 ;;
    study_fp8)
      stage study_fp8 130 python3 benchmark/e2e_study.py --out /tmp/ds/study_fp8 \
        --kv-cache-dtype fp8_e4m3 --repeats 2 --deadline-s 110 ;;
    harness)  # the plugin over sglang 0.5.23's pure-Python classes (the carried archive
      # .harness/sglang-py.tar.xz: python -m benchmark.harness.sglang_pack), then its CUDA test
      stage harness 240 bash -c "python3 benchmark/plugin_gpu_harness.py --out /tmp/ds/harness \
        --sglang-pack .harness/sglang-py.tar.xz; ECHO_SGLANG_PACK=.harness/sglang-py.tar.xz \
        ECHO_REQUIRE_SGLANG=1 PYTHONPATH=tests/sglang:\$PYTHONPATH python3 -m pytest -q \
        -p no:cacheprovider --confcutdir=tests/sglang tests/sglang/test_gpu_harness_loop.py" ;;
    *) echo "unknown stage $1; $usage" >&2; exit 2 ;;
  esac
}
case "$1" in
  checks) stages=(tests kernels) ;;
  e2e) stages=(sweep study study_fp8) ;;
  figures) stages=(sweep_110k tasks sharegpt) ;;
  *) stages=("$@") ;;
esac
for s in "${stages[@]}"; do
  case "$s" in arrival_probe|ingress_probe|step_trace|readback_ab|itl_ab|itl_trace|served_equal|mtp_served|mtp_study|admission_probe|cuda_tests_graphs|cuda_tests_rest|capture_probe|graph_repeats|served_vs_study|harness|tests|kernel_tests|kernels|release|decode_stage|prefetch_tests|prefetch_profile|prefetch_study|mla_profile|indexer_profile|cache|cache_bench|cache_profile|topk|topk_peer|prefetch|sweep|sweep_200k|sweep_110k|tasks|tasks_repeats|sharegpt|study|study_fp8) ;; *) echo "unknown stage $s; $usage" >&2; exit 2 ;; esac
done
for s in "${stages[@]}"; do run_stage "$s"; done
if [ "${PACK_TRITON_CACHE:-0}" = 1 ]; then  # for the next call: unpack into .triton_cache, carry it
  tar -czf "$out/triton_cache.tgz" -C "${TRITON_CACHE_DIR:-$HOME/.triton/cache}" . \
    && echo "[device_session] Triton cache packed: $(du -sh "$out/triton_cache.tgz" | cut -f1)"
fi
echo "[device_session] done in ${SECONDS}s"
ls -la "$out"
