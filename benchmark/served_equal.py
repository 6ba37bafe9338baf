"""Served ECHO and served no-offload give every request the same greedy tokens, at rate inf
where they decode different batches, when the model is batch invariant.

Why a record of its own: ``served_vs_study`` times the default GEMMs (cuBLAS), which round
a row by its batch's size, so at rate inf (ECHO ~14 requests a step, no-offload ~3) their
tokens part after the first near-tie although each backend is exact at equal batches.
Under SGLANG_ECHO_BATCH_INVARIANT=1 every matmul, norm and MoE sum of the forward ignores
the batch, so equality at rate inf is the lossless promise through the whole server.

Reads an e2e sweep's runs (``infini/{no-offload,offload}/req_rate_R.jsonl``) and writes
``served_equal.json``: ``metrics`` holds ``outputs_equal`` (every request of every rate),
``outputs_equal_by_rate`` (rate -> [equal, compared]), ``mean_decode_batch`` (engine ->
rate -> mean requests per decode step: the batches really differed), ``batch_invariant``
(the setting the servers inherited) and each engine's ``output_throughput`` (tokens/s,
the invariant mode's, not the product's), and the ECHO server's admission at rate inf
(``admission_ms_p50``, ``admission_ms_parts_inf``: engine-thread ms per admission by
part), plus ``commit``, ``device``, ``date``, ``command``.

    python3 benchmark/served_equal.py --sweep DIR --out FILE --commit SHA --command CMD
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from benchmark.analysis_record import write_record
from benchmark.served_vs_study import ENGINES, admission_parts, device_name, equal_by_rate, runs_of
from sglang_echo.config import load_settings


def combine(runs: dict[str, dict[str, dict]], batch_invariant: bool) -> dict:
    by_rate = equal_by_rate(runs)
    inf_e = runs["offload"].get("inf", {})
    return {
        "outputs_equal": None if by_rate is None else all(eq == n for eq, n in by_rate.values()),
        "outputs_equal_by_rate": by_rate,
        "mean_decode_batch": {
            eng: {rate: r.get("mean_decode_batch") for rate, r in runs[eng].items()}
            for eng in ENGINES
        },
        "batch_invariant": batch_invariant,
        "output_throughput": {
            eng: {rate: r.get("output_throughput") for rate, r in runs[eng].items()}
            for eng in ENGINES
        },
        # the ECHO server's admissions at rate inf: engine-thread ms, p50 and by part (the
        # admission path does not depend on the GEMMs, so this is the product's)
        "admission_ms_p50": inf_e.get("admission_ms_p50"),
        "admission_ms_parts_inf": admission_parts(inf_e.get("server_engine") or {}),
        "admission_cpu_ms_parts_inf": admission_parts(
            inf_e.get("server_engine") or {}, "cpu_seconds"
        ),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sweep", required=True, type=Path, help="the e2e sweep's OUTDIR")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--commit", default="", help="the sha the runs were made on, literally")
    ap.add_argument("--command", default="", help="the command that made the runs")
    args = ap.parse_args(argv)
    runs = {eng: runs_of(args.sweep, eng) for eng in ENGINES}
    if not all(runs.values()):
        missing = [eng for eng, r in runs.items() if not r]
        print(f"missing runs under {args.sweep}: {missing}", file=sys.stderr)
    invariant = load_settings().batch_invariant  # what the servers inherited
    record = {
        "name": "served_equal",
        "commit": args.commit,
        "device": device_name(),
        "date": time.strftime("%Y-%m-%d"),
        "command": args.command or " ".join(sys.argv),
        "metrics": combine(runs, invariant),
    }
    return write_record(args.out, record, record["metrics"])


if __name__ == "__main__":
    main()
