"""docs/EVIDENCE.md's rows of the end-to-end study, its request-rate sweeps and task
mixes (``END_TO_END_ROWS``, the table's first rows) and of the toy model's serving sweeps
(``TOY_SERVING_ROWS``, its last). Each fact names its fields: {metrics.x:us} is the
record's metrics.x in microseconds (FORMATS), {@name...} a value derived from the record
(DERIVED)."""

from __future__ import annotations

from .records import SERVING_HISTORY, STUDY, STUDY_FP8, rec
from .rows import Row

SAME_POOLS = (
    "the same decode node with both KV pools at the same size (no-offload pool, ECHO's "
    "NSA_DEV_CACHE_SIZE), {@knobs.NUM_PROMPTS} prompts"
)


def rate_latency(rate: str) -> str:
    runs = "{metrics.runs.%s." + rate + ".%s:ms}"
    return (
        f"at rate {rate}: median TTFT {runs % ('offload', 'median_ttft_ms')} vs "
        f"{runs % ('no-offload', 'median_ttft_ms')} ms, median E2E "
        f"{runs % ('offload', 'median_e2e_latency_ms')} vs "
        f"{runs % ('no-offload', 'median_e2e_latency_ms')} ms"
    )


def served_bound_row(prompts: int, record: str) -> Row:
    """A served run's bound (benchmark/served_bound.py), one row per served record."""
    facts = (
        "the rate-inf runs of `{source.record}` ({prompts} prompts) replayed on an ideal scheduler built from their own "
        "measurements (each prompt's KV arriving after the one before, in the run's mean transfer time: "
        "{metrics.with_ramp.engines.offload.arrival_ms:f1} ms ECHO, {metrics.with_ramp.engines.no-offload.arrival_ms:f1} ms "
        "no-offload; at most the requests the engine held at once, {metrics.with_ramp.engines.offload.held_at_most} / "
        "{metrics.with_ramp.engines.no-offload.held_at_most}; the run's device time per step by batch; no host time): "
        "ECHO / no-offload {metrics.with_ramp.ideal_ratio:x}, {metrics.with_ramp.bound_over_study:f2} of the study's "
        "(the most served over study can be on this workload; goal 0.90), served {metrics.served_ratio_inf:x} = "
        "{metrics.with_ramp.served_over_bound:f3} of it and {metrics.served_over_study:f2} of the study's",
        "each engine's served throughput over its ideal: ECHO {metrics.with_ramp.engines.offload.served_over_ideal:f2}, "
        "no-offload {metrics.with_ramp.engines.no-offload.served_over_ideal:f2}; mean decode batch of the ideal "
        "{metrics.with_ramp.engines.offload.mean_decode_batch:f1} (ECHO)",
        "with every KV in place at t=0 (the drain alone) the bound is {metrics.no_ramp.bound_over_study:f2} of the study's",
    )
    return Row(
        f"the served run's bound, {prompts} prompts (issue 49)",
        rec(f"served_bound/{record}.json"),
        tuple(f.replace("{prompts}", str(prompts)) for f in facts),
    )


END_TO_END_ROWS: tuple[Row, ...] = (
    Row(
        "end-to-end decode study (issue 14)",
        STUDY,
        (
            "{config.layers} layers at DeepSeek-V3.2's attention dims + one DP worker's routed MoE at equal bytes, bf16 KV, "
            "fake-transfer decode node, prompts {config.prompt_tokens.0:n}-{config.prompt_tokens.1:n} tokens, locality "
            "`{metrics.locality_source}` (real indexer + exact top-k), rate inf (closed batch)",
            "ECHO / no-offload output throughput at the paper settings ({@paper_pools}) {metrics.ratio_paper_all_hbm:x} "
            "(batch {metrics.details.paper_all_hbm.echo_batch} vs {metrics.details.paper_all_hbm.no_offload_batch})",
            "?range {metrics.spread.ratio_paper_all_hbm.ratio_min:f2}-{metrics.spread.ratio_paper_all_hbm.ratio_max:f2}x "
            "over {metrics.repeats} interleaved repeats of each side",
            "at pools of {@same_pools}",
            "at equal HBM ({@paper_pool:tok}) {metrics.ratio_equal_hbm_380k:x}",
            "random keys (pessimistic, hit {metrics.details.random_keys_paper_all_hbm.echo_hit_rate_mean:f2}) "
            "{metrics.details.random_keys_paper_all_hbm.ratio:x}",
            "ECHO hit rate per layer {metrics.hit_rate_per_layer:f3-}",
            "?ECHO's decode prefetch `{metrics.echo_decode_prefetch.mode}`: on in "
            "{metrics.echo_decode_prefetch.steps_on_all.full.0:n} of {metrics.echo_decode_prefetch.steps_on_all.full.1:n} "
            "decode steps at the paper's setting, {metrics.echo_decode_prefetch.steps_on_all.random.0:n} of "
            "{metrics.echo_decode_prefetch.steps_on_all.random.1:n} on random keys",
            "batch {metrics.low_load_cost.per_batch:keys} cost {metrics.low_load_cost.per_batch:f3/} "
            "(mean {metrics.low_load_cost.mean:f3}, project target 0.015)",
            "?medians of steps alternated with no-offload's; ECHO with decode tokens host-only and the "
            "resolve in line (`echo_inline`, in the same alternation) {metrics.low_load_cost.inline_per_batch:f3/}",
            "step {metrics.breakdown.no_offload.step_ms_device:ms} ms (no-offload, batch {metrics.breakdown.no_offload.batch}) "
            "vs {metrics.breakdown.echo.step_ms_device:ms} ms (ECHO, batch {metrics.breakdown.echo.batch})",
            "greedy outputs equal under eviction ({metrics.details.lossless_under_eviction.evictions_per_step:n} evictions per step, {metrics.details.lossless_under_eviction.tokens_compared} tokens{@compared}): {metrics.details.lossless_under_eviction.greedy_outputs_equal:yes}",
            "without pressure at batch {metrics.details.greedy_outputs_equal_at_low_load:keys}: "
            "{metrics.details.greedy_outputs_equal_at_low_load:yes/}",
            "without pressure at batch {metrics.breakdown_low_load.echo.batch}: step {metrics.breakdown_low_load.echo.step_ms_device:ms} vs {metrics.breakdown_low_load.no_offload.step_ms_device:ms} ms, ECHO minus no-offload by kernel category (profiler, ms per step): "
            "{@profile_difference}; kernels per step {metrics.breakdown_low_load.echo.profiler.kernels} vs {metrics.breakdown_low_load.no_offload.profiler.kernels}",
            "HiSparse-like under eviction ({metrics.details.lossless_under_eviction_hisparse.evictions_per_step:n} evictions per step): {metrics.details.lossless_under_eviction_hisparse.greedy_outputs_equal:yes}",
        ),
    ),
    Row(
        "end-to-end study at fp8 KV (issues 14, 15)",
        STUDY_FP8,
        (
            "the same study with `--kv-cache-dtype fp8_e4m3` ({config.kv_row_bytes}-byte rows in every pool): ECHO / "
            "no-offload at the paper settings {metrics.ratio_paper_all_hbm:x}",
            "at pools of {@same_pools}",
            "hit rate per layer {metrics.hit_rate_per_layer:f3-}",
            "batch {metrics.low_load_cost.per_batch:keys} cost {metrics.low_load_cost.per_batch:f3/}",
            "steps at fp8 vs bf16 KV: no-offload batch {metrics.breakdown.no_offload.batch} "
            "{metrics.breakdown.no_offload.step_ms_device:ms} vs {@bf16_steps.no_offload.step_ms_device:ms} ms, ECHO batch "
            "{metrics.breakdown.echo.batch} {metrics.breakdown.echo.step_ms_device:ms} vs "
            "{@bf16_steps.echo.step_ms_device:ms} ms (the fp8 sparse-MLA kernel: see its row)",
            "the equal-HBM engines are not run at fp8",
        ),
        also=(STUDY,),
    ),
    Row(
        "ECHO vs a HiSparse-like per-request buffer (issue 14)",
        STUDY,
        (
            "same run, equal HBM to a {@paper_pool:tok}-token no-offload pool: ECHO (one shared cache per layer) "
            "{@equal_hbm.echo.ratio:x} at batch {@equal_hbm.echo.echo_batch}, hit {@equal_hbm.echo.echo_hit_rate_mean:f3}",
            "HiSparse-like (private {metrics.hisparse_device_buffer_size:n}-row buffers per request and layer, LRU inside; "
            "cache management in torch ops, not a fused kernel) {@equal_hbm.hisparse.ratio:x} at batch "
            "{@equal_hbm.hisparse.echo_batch}, hit {@equal_hbm.hisparse.echo_hit_rate_mean:f3}",
            "steps {@equal_hbm.echo.echo_step_ms:ms} / {@equal_hbm.hisparse.echo_step_ms:ms} / "
            "{@equal_hbm.echo.no_offload_step_ms:ms} ms (ECHO / HiSparse-like / no-offload batch "
            "{@equal_hbm.echo.no_offload_batch})",
        ),
    ),
    Row(
        "request-rate sweep, decode node (issue 14, Figure 12)",
        rec("e2e_sweep/e2e_sweep.json"),
        (
            "the study's {@knobs.LAYERS}-layer worker through the HTTP server as a fake-transfer decode node, "
            "{@knobs.NUM_PROMPTS} InfiniteBench-like prompts (synthetic, {@infinitebench_prompts}): {@serving}",
        ),
    ),
    Row(
        "served against the engine, one device call (issue 49)",
        rec("served_vs_study/served_vs_study.json"),
        (
            "the in-process study at the paper's setting ({metrics.study_ratio:x}) and the served Figure-12 sweep "
            "(96 prompts, rates 1 and inf) in one call on commit `{commit}`: served ECHO / no-offload at rate inf "
            "{metrics.served_ratio_inf:x}, served over study {metrics.served_over_study:f2} (goal 0.90); over the "
            "steady window {metrics.steady_ratio_inf:x}",
            "decode device time over wall time at rate inf: ECHO {metrics.echo_served_efficiency:f2}, no-offload "
            "{metrics.no_offload_served_efficiency:f2} (goals 0.90 / 0.93); mean decode batch "
            "{metrics.mean_decode_batch_inf:f1/} (no-offload / ECHO)",
            "ECHO's median ITL over no-offload's at rate 1 {metrics.itl_p50_ratio_rate1:f3} (goal 1.02)",
            "hit rate served {metrics.served_hit_rate:f3}, in the study {metrics.study_hit_rate:f3}",
            "?in the study from admission on (its first {metrics.study_hit_rate_from_admission.decode_steps} "
            "decode steps, as a served request is seen) {metrics.study_hit_rate_from_admission.hit_rate:f3}",
            "?in the study at the served requests' own ages (each counted over as many steps as it "
            "decoded served) {metrics.study_hit_rate_at_served_ages.hit_rate:f3}",
            "?over the steady window (the servers' counters sampled during the runs): hit rate "
            "{metrics.served_hit_rate_steady:f3}, mean decode batch "
            "{metrics.mean_decode_batch_steady_inf:f1/} (no-offload / ECHO)",
            "admission (engine thread, per 100K-token request) p50 {metrics.admission_ms_p50:f1} ms, mean at rate inf "
            "{metrics.admission_ms_mean_inf:f1} ms (goal 2)",
            "?that mean by part (ms; the table row, then the transfer start's locations, their upload, the seed, "
            "ECHO's prompt slots, the submission) {metrics.admission_ms_parts_inf:}",
            "?the same parts on the engine thread's CPU clock (wall above CPU is waiting) "
            "{metrics.admission_cpu_ms_parts_inf:}",
            "?ECHO's served throughput over the study's, taken apart: decode batch "
            "{metrics.throughput_factors.offload.batch:f2} ({metrics.throughput_factors.offload.served_batch:f1} "
            "against {metrics.throughput_factors.offload.study_batch}), step time "
            "{metrics.throughput_factors.offload.step:f2}, efficiency "
            "{metrics.throughput_factors.offload.efficiency:f2}, product "
            "{metrics.throughput_factors.offload.product:f2} (measured "
            "{metrics.throughput_factors.offload.measured:f2}); no-offload's product "
            "{metrics.throughput_factors.no-offload.product:f2} (measured "
            "{metrics.throughput_factors.no-offload.measured:f2})",
            "?beside ECHO's decode steps on average: {metrics.throughput_factors.offload.served_running:f1} "
            "requests running (admitted), {metrics.throughput_factors.offload.served_arriving:f1} of them with "
            "their KV still arriving, {metrics.throughput_factors.offload.served_waiting:f1} waiting, "
            "{metrics.throughput_factors.offload.served_free_tokens:n} free token locations",
            "graph captures during the runs {metrics.graph_captures_during_run:n} (all at start-up)",
            "greedy tokens equal between the servers at every rate: {metrics.outputs_equal:yes}",
            "?per rate (equal, compared) {metrics.outputs_equal_by_rate:}",
            "?each server at its lowest rate against rate inf (equal, compared) "
            "{metrics.outputs_equal_across_rates:}",
        ),
    ),
    served_bound_row(96, "served_vs_study"),
    served_bound_row(318, "served_vs_study_318"),
    Row(
        "served outputs equal under batch invariance (issue 49)",
        rec("served_equal/served_equal.json"),
        (
            "both servers with SGLANG_ECHO_BATCH_INVARIANT=1 (batch-invariant: {metrics.batch_invariant:yes}) "
            "at rate inf on commit `{commit}`, mean decode batch {metrics.mean_decode_batch.no-offload.inf:f1} "
            "(no-offload) against {metrics.mean_decode_batch.offload.inf:f1} (ECHO)",
            "every request's greedy tokens equal between the servers: {metrics.outputs_equal:yes} "
            "(equal, compared: {metrics.outputs_equal_by_rate:})",
        ),
    ),
    Row(
        "the decode resolve in line or beside the query's GEMMs (issue 49)",
        rec("itl_ab/resolve_overlap_ab.json"),
        (
            "the decode node's engine without HTTP at batches 1, 4, 8 and 16 of the study's prompts, "
            "the resolve in line (`SGLANG_ECHO_RESOLVE_OVERLAP=0`) over beside (every step, the default "
            "then), device ms per step, medians of interleaved rounds",
            "batch 1: {metrics.by_batch.1.over_echo.echo_SGLANG_ECHO_RESOLVE_OVERLAP_0.device_ms_per_step:f3} (spreads beside {metrics.by_batch.1.arms.echo.device_ms_per_step.spread:f3}, in line {metrics.by_batch.1.arms.echo_SGLANG_ECHO_RESOLVE_OVERLAP_0.device_ms_per_step.spread:f3})",
            "batch 4: {metrics.by_batch.4.over_echo.echo_SGLANG_ECHO_RESOLVE_OVERLAP_0.device_ms_per_step:f3} (spreads beside {metrics.by_batch.4.arms.echo.device_ms_per_step.spread:f3}, in line {metrics.by_batch.4.arms.echo_SGLANG_ECHO_RESOLVE_OVERLAP_0.device_ms_per_step.spread:f3})",
            "batch 8: {metrics.by_batch.8.over_echo.echo_SGLANG_ECHO_RESOLVE_OVERLAP_0.device_ms_per_step:f3} (spreads beside {metrics.by_batch.8.arms.echo.device_ms_per_step.spread:f3}, in line {metrics.by_batch.8.arms.echo_SGLANG_ECHO_RESOLVE_OVERLAP_0.device_ms_per_step.spread:f3})",
            "batch 16: {metrics.by_batch.16.over_echo.echo_SGLANG_ECHO_RESOLVE_OVERLAP_0.device_ms_per_step:f3} (spreads beside {metrics.by_batch.16.arms.echo.device_ms_per_step.spread:f3}, in line {metrics.by_batch.16.arms.echo_SGLANG_ECHO_RESOLVE_OVERLAP_0.device_ms_per_step.spread:f3})",
            "no-offload at batch 1: {metrics.by_batch.1.over_echo.no-offload.device_ms_per_step:f3} of "
            "beside; the default since: in line below 16 tokens a step",
        ),
    ),
    Row(
        "MTP speculative decoding on the study's decode node (issue 52)",
        rec("mtp_study/mtp_study.json"),
        (
            "{config.layers} layers at DeepSeek-V3.2's dims with one NextN layer of the same dims, forced acceptance "
            "p = {config.accept_rate:g} per draft (a seeded coin, the same decisions on both backends), "
            "S = {config.spec_num_steps} draft step, every step a CUDA graph replay",
            "batch 1, rounds over plain decode steps: ECHO {metrics.mtp_speedup_batch1_echo.median:x} "
            "(range {metrics.mtp_speedup_batch1_echo.min:f2}-{metrics.mtp_speedup_batch1_echo.max:f2}x, goal 1.6x), "
            "no-offload {metrics.mtp_speedup_batch1_no_offload.median:x}",
            "the verify step over a plain decode step: ECHO {metrics.verify_over_decode_step_echo.median:f2}, "
            "no-offload {metrics.verify_over_decode_step_no_offload.median:f2}",
            "committed tokens equal between the backends: {metrics.outputs_equal_batch1:yes}",
            "?ECHO / no-offload with MTP at the paper's setting (batch {phases.paper.batch.echo} vs "
            "{phases.paper.batch.no-offload}) {metrics.echo_over_no_offload_mtp_paper.median:x} "
            "(range {metrics.echo_over_no_offload_mtp_paper.min:f2}-{metrics.echo_over_no_offload_mtp_paper.max:f2}x over "
            "{config.repeats} interleaved repeats, goal 3.3x)",
        ),
    ),
    Row(
        "MTP's batch-1 bound (issue 52)",
        rec("mtp_bound/mtp_study.json"),
        (
            "the batch-1 rounds of `{source.record}` taken apart in shares of a plain decode step "
            "(medians over {metrics.repeats} repeats): ECHO's round is the verify "
            "{metrics.backends.echo.verify_over_step:f2} plus the draft and the round's other work "
            "{metrics.backends.echo.draft_over_step:f2}, committing {metrics.backends.echo.tokens_per_round:f2} "
            "tokens: {metrics.backends.echo.speedup:x}",
            "with a draft that cost nothing: {metrics.backends.echo.free_draft_bound:x} (no-offload "
            "{metrics.backends.no-offload.free_draft_bound:x}); with a draft of one layer's share of the "
            "{metrics.layers}-layer step (estimate) {metrics.backends.echo.one_layer_draft_estimate:x}",
            "the goal ({metrics.goal:g}x) at this verify needs the draft at "
            "{metrics.backends.echo.draft_over_step_for_goal:f3} of a step, or at this draft the verify at "
            "{metrics.backends.echo.verify_over_step_for_goal:f2}",
        ),
    ),
    Row(
        "request-rate sweep at pools of 200K (issue 14, Figure 13)",
        rec("e2e_sweep_200k/e2e_sweep.json"),
        (SAME_POOLS + ": {@serving}",),
    ),
    Row(
        "request-rate sweep at pools of 110K (issue 14, Figure 13)",
        rec("e2e_sweep_110k/e2e_sweep.json"),
        (
            SAME_POOLS
            + " (no-offload refuses, with a 400 that says why, the prompts whose tokens and output exceed its "
            "pool): {@serving}",
            rate_latency("2"),
        ),
    ),
    Row(
        "ShareGPT-like latency sweep (issue 14, Figure 15)",
        rec("e2e_sweep_sharegpt/e2e_sweep.json"),
        (
            "the same worker on one server that prefills and decodes, {@knobs.NUM_PROMPTS} ShareGPT-like chats "
            "(synthetic): {@serving}",
            rate_latency("inf"),
            "?over each rate-inf run's steady window (its ramp, its drain and any stall at its start left out): "
            "ECHO {metrics.runs.offload.inf.steady_output_throughput:n} against no-offload "
            "{metrics.runs.no-offload.inf.steady_output_throughput:n} output tok/s",
        ),
    ),
    Row(
        "task mixes (issue 14, Figure 14)",
        rec("e2e_sweep_tasks/e2e_sweep.json"),
        (
            "Figure 14's task mixes on the decode node (synthetic at InfiniteBench's task lengths and output lengths, "
            "{@knobs.TASK_NUM_PROMPTS} prompts each, rate {@knobs.TASK_RATES}), ECHO / no-offload output throughput: "
            "{@task_ratios}",
        ),
    ),
    Row(
        "task mixes over repeated runs (issue 49, Figure 14's spread)",
        rec("task_spread/task_spread.json"),
        (
            "Figure 14's task sweep run {metrics.repeats} times, one server pair a run, ECHO / no-offload "
            "output throughput, median (min-max): {@task_spread_ratios}",
        ),
    ),
)


TOY_SERVING_ROWS: tuple[Row, ...] = (
    Row(
        "serving (toy model, issue 7)",
        rec("serving/h200/serving_sweep.json"),
        (
            "{@knobs.LAYERS}-layer random model, {@knobs.NUM_PROMPTS} InfiniteBench-like prompts (synthetic) at context "
            "{@knobs.CONTEXT:n}: {@serving}",
        ),
    ),
    Row(
        "serving, earlier runs (history)",
        SERVING_HISTORY[0],
        ("{@history_serving}",),
        kind="measured, superseded",
        also=SERVING_HISTORY[1:],
    ),
)
