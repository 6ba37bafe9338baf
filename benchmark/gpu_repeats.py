"""Run the same GPU tests several times and record, per test, how many runs passed.

Why: a CUDA-graph test that fails one run in three is failing, and a failure that depends
on what ran before in the process shows only when the tests run together. Each round runs
every given test in one pytest process (the suite's pattern), ``--parallel`` rounds at a
time (each its own process on the same GPU: one device call holds five rounds only so, as
a round is ~85 s warm and ~255 s when it compiles), until ``--rounds`` or ``--deadline-s``;
the record (``--out``) has, per test, ``runs`` and ``passed``, and the failures' first lines.

    python3 benchmark/gpu_repeats.py --rounds 5 --parallel 5 --deadline-s 500 --out FILE \
        tests/test_serving_gpu.py::test_engines_one_after_another_capture_at_startup
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def run_round(tests: list[str], timeout_s: float) -> dict[str, str]:
    """One pytest process over ``tests`` -> test id -> "passed" or the failure's first line."""
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu or not gpu",
               f"--junitxml={xml}", *tests]  # fmt: skip
        try:
            subprocess.run(cmd, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            return {t: "timed out" for t in tests}
        if not xml.is_file():
            return {t: "no report (pytest did not run)" for t in tests}
        out: dict[str, str] = {}
        for case in ET.parse(xml).getroot().iter("testcase"):
            name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
            bad = case.find("failure")
            if bad is None:
                bad = case.find("error")
            skipped = case.find("skipped")
            if bad is not None:
                out[name] = (bad.get("message") or "failed").splitlines()[0][:300]
            elif skipped is not None:
                out[name] = "skipped"
            else:
                out[name] = "passed"
        return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("tests", nargs="+", help="pytest node ids (or files)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--parallel", type=int, default=1, help="rounds run at once (processes)")
    ap.add_argument("--deadline-s", type=float, default=0.0, help="start no round after this")
    ap.add_argument("--round-timeout-s", type=float, default=480.0)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--commit", default="", help="the sha the tests ran on, literally")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    per_test: dict[str, dict] = {}
    rounds = 0
    if args.rounds < 1 or args.parallel < 1:
        ap.error("--rounds and --parallel must be at least 1")
    while rounds < args.rounds:
        if args.deadline_s and time.perf_counter() - t0 > args.deadline_s:
            break
        wave = min(args.parallel, args.rounds - rounds)
        with ThreadPoolExecutor(wave) as pool:
            outcomes = list(
                pool.map(lambda _: run_round(args.tests, args.round_timeout_s), range(wave))
            )
        for result in outcomes:
            rounds += 1
            for test, outcome in result.items():
                entry = per_test.setdefault(test, {"runs": 0, "passed": 0, "failures": []})
                if outcome == "skipped":
                    continue
                entry["runs"] += 1
                if outcome == "passed":
                    entry["passed"] += 1
                else:
                    entry["failures"].append(outcome)
        print(
            f"[gpu_repeats] {rounds} round(s) done at {time.perf_counter() - t0:.0f} s", flush=True
        )
    record = {
        "name": "gpu_lossless_repeats",
        "commit": args.commit,
        "date": time.strftime("%Y-%m-%d"),
        "device": _device(),
        "command": " ".join(["python3", "benchmark/gpu_repeats.py", *(argv or sys.argv[1:])]),
        "rounds": rounds,
        "parallel": args.parallel,
        "tests": per_test,
        "all_passed": bool(per_test)
        and all(e["runs"] == rounds and e["passed"] == e["runs"] for e in per_test.values()),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    for test, e in per_test.items():
        print(f"{e['passed']}/{e['runs']}  {test}")
    return record


def _device() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


if __name__ == "__main__":
    main()
