"""Analyses run here, on the CPU, over a committed device record (benchmark/served_bound.py,
benchmark/mtp_bound.py): one command line and one record shape for them, and the one writer
of these and the served records.

Why: such a record's numbers come from the device's runs, its command and commit from this
machine; both are kept, so a reader can tell which machine measured and which code
analysed, and rerun the analysis from the record alone."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path


def analysis_args(
    description: str, record_file: str, record_help: str, argv: list[str] | None
) -> tuple[argparse.ArgumentParser, argparse.Namespace, dict]:
    """``--record FOLDER --out FILE --commit SHA``; the folder's ``record_file`` loaded (a
    folder without it is refused with the parser's error)."""
    ap = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument("--record", required=True, type=Path, help=record_help)
    ap.add_argument("--out", required=True, type=Path, help="the file to write (JSON)")
    ap.add_argument("--commit", default="", help="the sha this analysis ran on, literally")
    args = ap.parse_args(argv)
    source_file = args.record / record_file
    if not source_file.is_file():
        ap.error(
            f"{source_file} does not exist; --record names the folder that holds {record_file}"
        )
    return ap, args, json.loads(source_file.read_text())


def command_line(script: str, argv: list[str] | None) -> str:
    """``python3 SCRIPT ARGS`` quoted for a shell, so a record's command reruns as written
    (an argument with spaces, such as a device command, stays one argument)."""
    return shlex.join(["python3", script, *(argv if argv is not None else sys.argv[1:])])


def analysis_record(
    name: str,
    script: str,
    argv: list[str] | None,
    args: argparse.Namespace,
    source: dict,
    metrics: dict,
) -> dict:
    """The record: the runs' device and the source record's provenance beside this
    analysis's own command and commit."""
    return {
        "name": name,
        "commit": args.commit,
        "device": f"{source.get('device')} (the runs); this analysis on the CPU",
        "date": time.strftime("%Y-%m-%d"),
        "command": command_line(script, argv),
        "source": {k: source.get(k) for k in ("commit", "device", "date", "command")}
        | {"record": str(args.record)},
        "metrics": metrics,
    }


def write_record(out: Path, record: dict, shown: dict) -> dict:
    """Write ``record`` to ``out`` as JSON and print ``shown``: the one way out of the
    served records (served_vs_study, served_equal) and of these analyses."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(shown, indent=1))
    return record
