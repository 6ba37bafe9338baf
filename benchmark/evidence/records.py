"""The records under ``benchmark/results/``: loading them (cached, relative to the
repository root), naming them, reading a field by its dotted path, and the records several
tables read (named once here, so a moved record is renamed in one place)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RESULTS_DIR = "benchmark/results"


class Records:
    """Loads records relative to the repository root (cached)."""

    def __init__(self, root: Path):
        self.root = root
        self.cache: dict[str, dict] = {}

    def __call__(self, rel: str) -> dict:
        if rel not in self.cache:
            self.cache[rel] = json.loads((self.root / rel).read_text())
        return self.cache[rel]


def rec(name: str) -> str:
    """A record's path from the repository root, by its path under benchmark/results/."""
    return f"{RESULTS_DIR}/{name}"


def field(d: Any, path: str) -> Any:
    """The value at a dotted path of a record (``metrics.runs.offload.inf``); a number
    indexes a list. A missing key raises KeyError naming the whole path."""
    value = d
    for key in path.split("."):
        try:
            value = value[int(key)] if isinstance(value, list) else value[key]
        except (KeyError, IndexError, ValueError, TypeError):
            raise KeyError(f"no field {path!r} (stopped at {key!r})") from None
    return value


# ---- the records read by several rows --------------------------------------------------

STUDY = rec("e2e_study.json")
STUDY_FP8 = rec("e2e_study_fp8.json")
SWEEP = rec("e2e_sweep/e2e_sweep.json")
INDEXER = rec("indexer.json")
SERVING_HISTORY = (
    rec("history/serving/h200-2026-11-29/serving_sweep.json"),
    rec("history/serving/h200-before-prefill-fix/serving_sweep.json"),
)
