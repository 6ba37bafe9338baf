"""The generated blocks of README.md and docs/ (``python -m benchmark.evidence``; cli.py's
docstring tells the blocks, the fact templates and both modes), from the records under
``benchmark/results/`` and the code's checks.

One job per module, from the records to the documents:

- ``records``: loading records, reading a field by path, the records several rows read.
- ``formats``: the number formats (``{...:us}``, ``{...:x}``, ...).
- ``template``: the fact templates (``{metrics.x:us}``, ``{@derived}``, "?" facts) and
  ``DERIVED``, filled by ``derived_study``, ``derived_components`` and ``derived_serving``.
- ``rows``: the row types, ``Row`` (docs/EVIDENCE.md) and ``Result`` (README.md).
- ``evidence_end_to_end_rows``, ``evidence_component_rows``: docs/EVIDENCE.md's rows;
  ``evidence_rows`` puts them in the document's order (``EVIDENCE``).
- ``readme_rows``: README.md's results (``RESULTS``).
- ``error_checks``, ``error_rows``: docs/ERRORS.md's checks (``CHECKS``) and rows
  (``ERRORS``, ``error_rows``).
- ``blocks``: the blocks' tables and markers, finding and splicing them (``--write``).
- ``block_check``: a document's blocks against the generator's (``--check``).
- ``prose``: no measured figure in the prose outside the blocks.
- ``cli``: the command line (``__main__`` runs it).

Everything the tests and tools use is importable from the package itself
(``from benchmark import evidence``; ``evidence.differences``, ``evidence.EVIDENCE``, ...).
Importing the package imports every ``derived_*`` module, so ``DERIVED`` is complete.
"""

from __future__ import annotations

from . import derived_components, derived_serving, derived_study
from .block_check import NUMBER, block_differences, differences
from .blocks import (
    BEGIN,
    BLOCKS,
    END,
    HEADER,
    Block,
    begin,
    blocks_in,
    end,
    extract,
    render,
    render_errors,
    render_evidence,
    render_results,
    write,
)
from .cli import main
from .error_checks import CHECKS, SGLANG_ARGS
from .error_rows import ERRORS, error_rows
from .evidence_rows import EVIDENCE
from .formats import FORMATS, count, f2, f3, formatter, ms, ratio, slashed, span, tokens, us, yes
from .prose import ALLOWED_FIGURES, FIGURE_RULES, _blank, prose_figures
from .readme_rows import RESULTS
from .records import (
    INDEXER,
    RESULTS_DIR,
    SERVING_HISTORY,
    STUDY,
    STUDY_FP8,
    SWEEP,
    Records,
    field,
    rec,
)
from .rows import Result, Row, source
from .template import DERIVED, PLACEHOLDER, Fact, derived, fill, render_fact

__all__ = [
    "ALLOWED_FIGURES",
    "BEGIN",
    "BLOCKS",
    "CHECKS",
    "DERIVED",
    "END",
    "ERRORS",
    "EVIDENCE",
    "FIGURE_RULES",
    "FORMATS",
    "HEADER",
    "INDEXER",
    "NUMBER",
    "PLACEHOLDER",
    "RESULTS",
    "RESULTS_DIR",
    "SERVING_HISTORY",
    "SGLANG_ARGS",
    "STUDY",
    "STUDY_FP8",
    "SWEEP",
    "Block",
    "Fact",
    "Records",
    "Result",
    "Row",
    "_blank",
    "begin",
    "block_differences",
    "blocks_in",
    "count",
    "derived",
    "derived_components",
    "derived_serving",
    "derived_study",
    "differences",
    "end",
    "error_rows",
    "extract",
    "f2",
    "f3",
    "field",
    "fill",
    "formatter",
    "main",
    "ms",
    "prose_figures",
    "ratio",
    "rec",
    "render",
    "render_errors",
    "render_evidence",
    "render_fact",
    "render_results",
    "slashed",
    "source",
    "span",
    "tokens",
    "us",
    "write",
    "yes",
]
