"""One run of the study, in its order of work: the worker model on the device (the MoE
checked against its dense reference), the layer components, the plan's blocks of timed
decode steps, the step's fixed part, and the record rewritten after each of them."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmark.e2e import record
from benchmark.e2e.components import check_moe, measure_components, measure_fixed_part
from benchmark.e2e.measure import DecodeBench
from benchmark.e2e.plan import StudyPlan
from benchmark.e2e.timing import log
from benchmark.study.moe import bytes_table
from benchmark.study.worker import build_worker


class Study:
    """The run's plan (``setup``), its device, and what it has measured so far: ``runs``
    (one dict per measured phase), ``components`` and ``errors``."""

    def __init__(self, args: argparse.Namespace, argv: list[str]) -> None:
        self.args = args
        self.argv = argv
        self.setup = StudyPlan(args)
        self.device = torch.device(
            "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
        )
        self.cuda = self.device.type == "cuda"
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.runs: list[dict] = []
        self.components: dict = {}
        self.errors: list[str] = []

    def record(self, final: bool = False) -> dict:
        """Rewrite <out>/e2e_study.json with what the run holds now."""
        rec = record.assemble(
            self.setup, self.argv, self.cuda, self.runs, self.components, self.errors, final
        )
        record.write(self.out, rec)
        return rec

    def run(self) -> dict:
        p = self.setup.plan
        log(f"device {self.device}, torch {torch.__version__}, layers {p.layers}, "
            f"prompts {p.ctx_min}-{p.ctx_max}, stable fraction {self.args.locality}")  # fmt: skip
        self.model, self.directions = build_worker(self.setup.cfg, p.moe, p.dtype, self.device)
        if self.cuda:
            log(f"model built: {torch.cuda.memory_allocated() / 2**30:.1f} GiB on the GPU")
            with torch.inference_mode():
                check_moe(self.setup, self.model, self.device, self.components)
        # The model of issue 14's Build item 2: bytes per layer per step at batch 1..64.
        self.components["bytes_table"] = bytes_table(list(range(1, 65)))
        self.record()
        if not self.args.skip_components:
            with torch.inference_mode():
                measure_components(self.setup, self.model, self.device, self.components)
            self.record()
        bench = DecodeBench(
            self.setup, self.model, self.directions, self.device, self.runs, self.errors,
            self.record,
        )  # fmt: skip
        for steps in self.setup.schedule():
            bench.run_block(steps)
            self.record()
        if not self.args.skip_fixed:
            try:
                with torch.inference_mode():
                    fixed = measure_fixed_part(
                        self.setup, self.model, self.device, self.runs, self.components
                    )
                    if fixed:
                        self.record()
            except Exception as exc:
                msg = f"fixed part: {type(exc).__name__}: {exc}"
                log("ERROR " + msg)
                self.errors.append(msg)
        rec = self.record(final=True)
        log(
            "metrics: "
            + json.dumps({k: v for k, v in rec["metrics"].items() if k.startswith("ratio")})
        )
        return rec
