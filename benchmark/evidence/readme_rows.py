"""``RESULTS``: README.md's results table, the headline numbers, each one field (or
derived value) of one record, so README's figures cannot drift from the records."""

from __future__ import annotations

from .records import INDEXER, STUDY, STUDY_FP8, rec
from .rows import Result

RESULTS: tuple[Result, ...] = (
    Result(
        "decode throughput, ECHO / no-offload, at the paper's pool sizes ({@paper_pools})",
        STUDY,
        "{metrics.ratio_paper_all_hbm:x}",
    ),
    Result(
        "the same at equal HBM (every byte of KV state counted)",
        STUDY,
        "{metrics.ratio_equal_hbm_380k:x}",
    ),
    Result("the same with fp8 KV rows", STUDY_FP8, "{metrics.ratio_paper_all_hbm:x}"),
    Result("ECHO's device-cache hit rate per layer", STUDY, "{metrics.hit_rate_per_layer:f3-}"),
    Result(
        "greedy outputs equal to no-offload's while every step evicts",
        STUDY,
        "{metrics.details.lossless_under_eviction.greedy_outputs_equal:yes}",
    ),
    Result(
        "ECHO's extra step time without memory pressure, batch 1 (fraction)",
        STUDY,
        "{metrics.low_load_cost.per_batch.1:f3}",
    ),
    Result(
        "through the HTTP server as a decode node, ECHO / no-offload output throughput at rate inf: "
        "whole run; steady window (the in-process study in the same device call, on the GPU named)",
        rec("served_vs_study/served_vs_study.json"),
        "{metrics.served_ratio_inf:x}; {metrics.steady_ratio_inf:x} ({metrics.study_ratio:x}; {device})",
    ),
    Result(
        "MTP (one draft step, acceptance forced at 0.85): tokens/s over plain decode at batch 1 under ECHO; "
        "ECHO / no-offload with MTP at the paper's setting",
        rec("mtp_study/mtp_study.json"),
        "{metrics.mtp_speedup_batch1_echo.median:x}; {metrics.echo_over_no_offload_mtp_paper.median:x}",
    ),
    Result(
        "decode cost per request and layer at batch {@per_request.batch}, all of ECHO's kernels, us",
        INDEXER,
        "{@per_request.total:us}",
    ),
)
