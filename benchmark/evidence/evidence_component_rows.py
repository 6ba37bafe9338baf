"""docs/EVIDENCE.md's rows of the components, each measured on its own: the model
against transformers, the indexer, top-k, cache management, release, the plugin harness,
the prefetches, recall, sparse MLA, the victim policies and the trained model
(``COMPONENT_ROWS``, between the end-to-end rows and the toy serving rows)."""

from __future__ import annotations

from .derived_components import BEFORE_ISSUE_15, KERNEL_RECORDS
from .records import INDEXER, rec
from .rows import Row

COMPONENT_ROWS: tuple[Row, ...] = (
    Row(
        "model = transformers on the GPU",
        rec("gpu_checks.json"),
        (
            "float32 ({@oracle.n} configs): max abs logit difference at most {@oracle.max_abs:sci}, rel. L2 at most "
            "{@oracle.max_rel_l2:sci}, top-k mismatches {@oracle.topk_mismatches:n-}",
            "bfloat16 logits' rel. L2 to the float32 reference ({@oracle.configs}): ours {@oracle.ours:f2/}, "
            "transformers' {@oracle.transformers:f2/}",
        ),
    ),
    Row(
        "fp8 indexer logits (decode)",
        INDEXER,
        (
            "batch {metrics.batch} x {metrics.context:n} keys x {metrics.heads} heads x {metrics.dim} dims: logits "
            "{metrics.logits_us:us} us replayed ({metrics.eager_us.logits:us} us eager)",
            "roofline {metrics.roofline_us:us} us (estimate: keys read once at the {metrics.hbm_GBps:n} GB/s measured in "
            "the run) -> {metrics.logits_over_roofline:x}",
            "per-request `_scaled_mm` loop {metrics.torch_loop_us:us} us (the kernel {metrics.speedup_vs_torch_loop:x} "
            "faster)",
            "top-k sets equal to float64: {metrics.topk_sets_equal_vs_float64:yes}",
            "packed 132-byte rows {metrics.logits_packed_rows_us:us} us eager, 144-byte rows "
            "{metrics.graph_replayed_us.logits_padded_rows_144:us} us replayed "
            "({metrics.eager_us.logits_padded_rows_144:us} us eager)",
        ),
    ),
    Row(
        "top-k (decode)",
        INDEXER,
        (
            "radix-select kernel (the default) {metrics.graph_replayed_us.topk:us} us, `torch.topk` "
            "{metrics.graph_replayed_us.torch_topk:us} us ({@topk_over_torch:x}), tie-stable sort "
            "{metrics.graph_replayed_us.stable_sort_topk:us} us (replayed; eager {metrics.eager_us.topk:us} / "
            "{metrics.eager_us.torch_topk:us} / {metrics.eager_us.stable_sort_topk:us} us)",
            "kernel's sets equal the reference: {metrics.topk_kernel_sets_equal_reference:yes}",
            "?keys kept as candidates after the first digit {metrics.topk_candidate_share:f3} of all",
            "?pivot top-k (opt-in, `SGLANG_ECHO_TOPK_PIVOT=1`) {metrics.topk_pivot.steady_us:us} us settled, "
            "{metrics.topk_pivot.drift_us:us} us on a drifted query's pivots ({metrics.topk_pivot.drift_rows_served} of "
            "{metrics.topk_pivot.rows} rows served), {metrics.topk_pivot.one_new_row_us:us} us with one new row, "
            "{metrics.topk_pivot.all_new_us:us} us with none served; batch 1: {metrics.topk_pivot.steady_b1_us:us} / "
            "{metrics.topk_pivot.all_new_b1_us:us} us; the same tensor as the radix select in every state: "
            "{@pivot_equal:yes}",
        ),
    ),
    Row(
        "top-k peer (FlashInfer, issue 15)",
        rec("topk_peers.json"),
        (
            "{metrics.batch} x {metrics.context:n} keys, k {metrics.topk}, graph-replayed: radix select "
            "{metrics.ours.us:us} us (batch 1: {metrics.ours.us_b1:us}); FlashInfer alone, in any order: "
            "{@flashinfer_modes}",
            # The adapter's facts: records made while it was in the package (it lost).
            "?{@adapters}",
            "?the contract's sort {metrics.serving_adapter.finish_us:us} us ({metrics.serving_adapter.finish_us_b1:us}), "
            "the plain form's mask {metrics.serving_adapter.mask_us:us} us",
            "?{@adapter_wins}",
        ),
    ),
    Row(
        "cache-management kernels",
        rec("cache_ops.json"),
        (
            "batch {metrics.batch} x top-k {metrics.topk}, {metrics.slots:n} slots, {metrics.evictions_per_step:n} "
            "evictions per step, hit rate {metrics.hit_rate:f3}: {metrics.us_per_layer_step:us} us per layer-step "
            "replayed ({metrics.us_per_layer_step_with_recall:us} us with recall), project target {metrics.target_us:us} us",
            "?the resolve's four look-back launches against the five-launch pipeline in the same run: "
            "{metrics.us_per_layer_step:us} vs {metrics.us_per_layer_step_pipeline:us} us "
            "({metrics.speedup_over_pipeline:f2}x)",
            "?{metrics.layer_steps_per_replay} layer-steps per graph replay, as a decode graph holds one per layer "
            "(one per replay, the earlier records' definition: {metrics.us_per_layer_step_single_replay:us} us; a "
            "replay of a one-kernel graph alone {metrics.graph_replay_floor_us:us} us); the floor of the launches: "
            "{metrics.launch_floor_us.1:us} us for one no-op launch per layer-step, {metrics.launch_floor_us.5:us} "
            "us for five chained",
            "?batch 1 with every selection resident (a decode node's placed prompt at low load): "
            "{metrics.us_per_layer_step_batch_1_resident:us} us per layer-step "
            "({metrics.us_per_layer_step_batch_1_resident_with_recall:us} us with the write and the recall), "
            "target {metrics.target_us_batch_1_no_eviction:us} us",
            "torch reference {metrics.torch_reference_us_per_layer_step:us} us; one sort of all priorities "
            "{metrics.exact_lru_sort_us:us} us; stages {@stages} us",
            "a decode step's management is the resolve's (its new tokens go to the host pool); with the append's "
            "allocation as before {metrics.us_per_layer_step_with_append:us} us",
            "eviction reserve {metrics.eviction_reserve:n} slots (the default)",
            "?batch 1 with nothing evicted (the default path: one program up to {metrics.one_program_lanes:n} lanes): "
            "{metrics.us_per_layer_step_batch_1_no_eviction:us} us per layer-step, target "
            "{metrics.target_us_batch_1_no_eviction:us} us; the resolve in one program against the launches past it: "
            "{metrics.one_program_study.batch_1.one_program_no_pressure_us:us} vs "
            "{metrics.one_program_study.batch_1.pipeline_no_pressure_us:us} us at batch 1, "
            "{metrics.one_program_study.batch_2.one_program_no_pressure_us:us} vs "
            "{metrics.one_program_study.batch_2.pipeline_no_pressure_us:us} us at batch 2, "
            "{metrics.one_program_study.batch_8.one_program_no_pressure_us:us} vs "
            "{metrics.one_program_study.batch_8.pipeline_no_pressure_us:us} us at batch 8",
            "?at batch 1 without pressure, append + resolve: {metrics.launch_chaining.unchained_acq_rel.batch_1_no_pressure_management_us:us}"
            " us with plain launches and ordered atomics, {metrics.launch_chaining.unchained_relaxed.batch_1_no_pressure_management_us:us}"
            " us relaxed, {metrics.launch_chaining.chained_relaxed.batch_1_no_pressure_management_us:us} us chained and relaxed (the "
            "default); the decode path {metrics.launch_chaining.chained_relaxed.batch_1_no_pressure_resolve_us:us} us ({metrics.launch_chaining.chained_relaxed.batch_1_no_pressure_decode_step_us:us} us with writes and recall, against {metrics.launch_chaining.unchained_acq_rel.batch_1_no_pressure_step_us:us} us before)",
            "?the look-back resolve's launch shapes (cache_ops_bench.py --sweep, one run): {@launch_shapes}",
            "?requests selecting in pairs (every id twice: the look-back's two-wait path): "
            "{metrics.us_per_layer_step_repeats:us} vs {metrics.us_per_layer_step_repeats_pipeline:us} us through the pipeline",
        ),
    ),
    Row(
        "batched release (issue 30)",
        rec("release.json"),
        (
            "a finished request's {details.config.tokens:n} tokens leave {details.config.layers} layers "
            "({details.config.slots:n} slots, {details.config.host:n} host tokens, {details.config.resident:n} resident "
            "per layer): one launch for all layers {metrics.batched_kernel_us:us} us, layer by layer in torch "
            "{metrics.per_layer_torch_us:us} us in {metrics.per_layer_torch_launches:n} launches "
            "({metrics.speedup_kernel_vs_per_layer:x} faster), a batched torch reference "
            "{metrics.batched_reference_us:us} us in {metrics.batched_reference_launches:n} launches",
            "the kernel {metrics.kernel_over_floor:x} its {metrics.floor_us:us} us floor (estimate)",
        ),
    ),
    Row(
        "plugin on the GPU without sglang's server (issue 31)",
        rec("plugin_gpu_harness.json"),
        (
            "sglang 0.5.23's pool, allocator and host-pool classes with the EchoCoordinator in sglang's decode "
            "choreography ({metrics.configs}): greedy tokens and logits bit-identical to the plain DSA pool's: "
            "{metrics.all_equal:yes} ({metrics.tokens_compared:n} tokens of {metrics.requests:n} requests)",
            "?{metrics.requests_aborted:n} of the requests aborted by their client mid-decode (released at once, "
            "outside result processing, while a step still decoding them may run)",
            "{metrics.steps:n} steps, all graph replays ({metrics.graph_replays:n}), {metrics.idle_steps:n} IDLE; "
            "{metrics.evictions_total:n} evictions in {metrics.steps_with_evictions:n} steps (at most "
            "{metrics.evictions_per_step_max:n} in one)",
            "ECHO launches per decode layer-step {metrics.launches_per_layer_step_total:n} "
            "({metrics.launches_per_layer_step:keys}); left clean: {metrics.left_clean:yes}",
            "?at the real shape (fp8-pd-wide: top-k 2048, three requests, past the one-program "
            "allocation's lanes: the multi-launch resolve) {metrics.wide_launches_per_layer_step_total:n} "
            "launches per layer-step ({metrics.wide_launches_per_layer_step:keys}); its step time with "
            "the decode prefetch over without {metrics.prefetch_step_ratio:x}",
            "?with the decode prefetch on ({@harness_prefetch.config}): {@harness_prefetch.prefetched_rows:n} rows "
            "staged from the indexer's logits, {@harness_prefetch.prefetch_hits:n} of them served misses, sglang's own "
            "indexer method hooked on that machine: {@harness_prefetch.indexer_hook_applied:yes}",
        ),
    ),
    Row(
        "allocation A/B (issue 29)",
        rec("alloc_ab.json"),
        (
            "current alloc.py against 617151e's, five interleaved rounds on one H200: batch 1 without eviction "
            "{metrics.cases.batch_1_no_eviction.current.median_us:us} vs "
            "{metrics.cases.batch_1_no_eviction.617151e.median_us:us} us, through the pipeline "
            "{metrics.cases.batch_1_no_eviction_pipeline.current.median_us:us} vs "
            "{metrics.cases.batch_1_no_eviction_pipeline.617151e.median_us:us} us, batch 48 full "
            "{metrics.cases.batch_48_full.current.median_us:us} vs {metrics.cases.batch_48_full.617151e.median_us:us} us",
        ),
    ),
    Row(
        "victim policies",
        rec("victim_policy.json"),
        ("mean hit rate over layers on the trained model's decode traces at {@victim_policies}",),
        kind="simulated on measured traces",
    ),
    Row(
        "prefill prefetch",
        rec("prefill_prefetch.json"),
        (
            "{@cases.n} cases ({@cases.history_K:/} history, {@cases.queries_set:/} queries, hit {@cases.hit_rate_set:g/}): "
            "prefetch on a side stream over the serial baseline {metrics.speedup:f2-}x replayed, pipelined "
            "{metrics.pipelined_speedup:f2-}x",
            "the recall it can hide {@cases.recall_ms:ms-} ms of a {@cases.baseline_graph_ms:ms-} ms baseline chunk",
            "all correct: {metrics.all_correct:yes}, wasted rows {metrics.total_wasted:n}",
        ),
    ),
    Row(
        "decode prefetch",
        rec("decode_prefetch.json"),
        (
            "batch {metrics.batch} x {metrics.context:n} context, {metrics.row_bytes}-byte rows: the staged prefetch "
            "in the default design ({metrics.default_design}: {metrics.stage_chunks} logits chunks, {metrics.stage_cap:n} "
            "staged rows per request) over none {@decode_prefetch.speedup} (ranges over {metrics.rounds} interleaved "
            "rounds {@decode_prefetch.ranges}), slowdown {@decode_prefetch.slowdown} (replayed)",
            "?the in-kernel design (the logits kernel stages and copies, {metrics.stage_block_n} keys a program), same "
            "run: {@decode_prefetch.in_kernel}; the allocating design: {@decode_prefetch.alloc}",
            "Figure 18's definition (logits + recall of every miss, top-k and cache management left out), the "
            "in-kernel design as ECHO's: {@decode_prefetch.fig18}; the chunked design: {@decode_prefetch.fig18_chunked}",
            "step at hit {@decode_prefetch.case.hit_rate:g}: logits {@decode_prefetch.case.logits_ms:ms} ms, top-k "
            "{@decode_prefetch.case.topk_ms:ms} ms, recall {@decode_prefetch.case.recall_ms:ms} ms of "
            "{@decode_prefetch.case.unfused_graph_ms:ms} ms; {@decode_prefetch.case.staged_rows:n} rows staged, "
            "{@decode_prefetch.case.staged_used:n} of them selected, {@decode_prefetch.case.staged_remaining:n} "
            "misses still recalled over PCIe",
            "all correct: {metrics.all_correct:yes}",
        ),
    ),
    Row(
        "decode prefetch end to end (auto)",
        rec("e2e_prefetch/e2e_study.json"),
        (
            "ECHO with SGLANG_NSA_FUSE_LOGITS_RECALL_DECODE=auto over ECHO without it, phases interleaved: "
            "{metrics.decode_prefetch_auto.full.ratio:x} at the paper's setting (hit "
            "{metrics.decode_prefetch_auto.full.hit_rate_mean:f3}, range {metrics.decode_prefetch_auto.full.ratio_min:f3}-"
            "{metrics.decode_prefetch_auto.full.ratio_max:f3}, {metrics.decode_prefetch_auto.full.repeats} repeats)",
            "{metrics.decode_prefetch_auto.random.ratio:x} on random keys (hit "
            "{metrics.decode_prefetch_auto.random.hit_rate_mean:f3}, range {metrics.decode_prefetch_auto.random.ratio_min:f3}-"
            "{metrics.decode_prefetch_auto.random.ratio_max:f3}, {metrics.decode_prefetch_auto.random.repeats} repeats; the "
            "rule ran the prefetch there: {metrics.decode_prefetch_auto.random.phase_staged_used:n} of "
            "{metrics.decode_prefetch_auto.random.phase_staged_rows:n} staged rows selected, "
            "{metrics.decode_prefetch_auto.random.phase_precision:f3})",
            "greedy outputs equal to ECHO without it: {metrics.decode_prefetch_auto.full.outputs_equal:yes} / "
            "{metrics.decode_prefetch_auto.random.outputs_equal:yes}",
        ),
    ),
    Row(
        "recall bandwidth",
        rec("recall.json"),
        (
            "{@recall_widths}",
            "pinned H2D copy {metrics.h2d_GBps:f1} GB/s in the same run",
            "?the default launch on 656 B rows {metrics.default_GBps_656:f1} GB/s packed, "
            "{metrics.default_GBps_656_on_768_byte_strides:f1} GB/s with every row starting a 128-byte line (768-byte "
            "strides)",
        ),
    ),
    Row(
        "sparse MLA kernel",
        rec("sparse_mla.json"),
        (
            "decode {metrics.sizes.batch} queries x {metrics.sizes.heads} heads x {metrics.sizes.topk} rows: "
            "{metrics.decode_us:us} us vs torch {metrics.decode_torch_us:us} us ({@mla.decode_speedup:x} faster), "
            "{@mla.decode_over_roofline:x} its {metrics.decode_roofline_us:us} us roofline (estimate)",
            "prefill {metrics.sizes.prefill_queries} queries: {metrics.prefill_us:us} us vs {metrics.prefill_torch_us:us} "
            "us ({@mla.prefill_speedup:x}), {@mla.prefill_over_roofline:x} its {metrics.prefill_roofline_us:us} us "
            "roofline (estimate)",
            "best of {@mla.configs} launch configs; bf16 rel. error to float64 {metrics.max_rel_err:sci} vs torch's bf16 "
            "{metrics.torch_bf16_rel_err:sci}; all correct: {metrics.all_correct:yes}",
            "fp8 KV rows (656 bytes, dequantized in registers): decode {metrics.decode_fp8_us:us} us, "
            "{@mla.fp8_over_bf16:x} the bf16 default's {metrics.decode_default_us:us} us, rel. error "
            "{metrics.fp8_rel_err:sci}",
            "graph-replayed decode, us (ours by config, peers by name): {@mla_batch_sweep}",
        ),
    ),
    Row(
        "per-request decode cost per layer (issue 15)",
        INDEXER,
        (
            "us per request per layer at batch {@per_request.batch} (each op's batch time / {@per_request.batch}; sparse "
            "MLA graph-replayed where the record's batch sweep has it; recall = cache management with recall minus "
            "without): {@per_request.ops}",
            "total {@per_request.total:us} (was {@per_request.was:us}, the records of a0f072b)",
        ),
        also=(
            rec("sparse_mla.json"),
            rec("cache_ops.json"),
            *(rec(f"{BEFORE_ISSUE_15}/{n}.json") for n in KERNEL_RECORDS),
        ),
    ),
    Row(
        "sparse MLA kernel resources (issue 15)",
        rec("sm90_resources.json"),
        (
            "{@sm90.configs} launch configs compiled for {metrics.target} as the JIT specializes the decode launch "
            "(compile only): the default ({metrics.default.block_h} heads x {metrics.default.block_k} rows, "
            "{metrics.default.num_warps} warps, {metrics.default.splits} splits) uses {metrics.default.registers} "
            "registers, spills {metrics.default.spill_store_bytes} B per thread, {metrics.default.shared_bytes:n} B of "
            "shared memory, {metrics.default.wgmma} wgmma",
            "{@sm90.spill_free} configs are spill-free, {@sm90.spill_free_wgmma} of them with wgmma",
            "KV-row tile loads in the default: {metrics.default.row_loads_async} asynchronous copies, "
            "{metrics.default.row_loads_sync} plain",
            "at fp8 KV the default stores its dequantized tiles to shared memory {@sm90.fp8_stores}, in "
            "{metrics.fp8_default.shared_bytes:n} B of shared memory",
            "the split merge ({@sm90.merge.block_h} heads x {@sm90.merge.block_c} columns, {@sm90.merge.num_warps} warps) "
            "at {@sm90.merge_splits} splits: {@sm90.merge_registers:-} registers, spills {@sm90.merge_spills} B per "
            "thread at most",
        ),
    ),
    Row(
        "trained model (issue 6)",
        rec("topk_traces.json"),
        (
            (
                rec("topk_train.json"),
                "{parameters.total:M} parameters, {checkpoint_bytes:MB}, trained in "
                "{metrics.train_seconds:f0} s ({metrics.steps_done} steps)",
            ),
            "trained vs untrained: held-out prefill loss {@trained.heldout_prefill_nll} nats/byte, consecutive-step top-k "
            "overlap {@trained.consecutive_overlap}, recall of attention's top-{setup.index_topk} "
            "{@trained.recall_of_attention_topk}, ECHO shared-cache hit rate at {@trained.mults} x batch x k "
            "{@trained.hits_trained} (untrained {@trained.hits_untrained}), per-request 2k LRU "
            "{@trained.hisparse_2k_hit_rate}, EMA k-th score error median {@trained.ema_rel_error_median}",
            "256-bin threshold bin (fp16 key) {metrics.side_by_side.bin_fp16_raw_median.trained:f1} keys raw vs "
            "{metrics.side_by_side.bin_fp16_offset_median.trained:f1} with the offset",
        ),
        also=(rec("topk_train.json"),),
    ),
)
