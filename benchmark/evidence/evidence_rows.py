"""``EVIDENCE``: the table of docs/EVIDENCE.md, every claim, fact by fact, in the
document's order (the rows themselves live in the two modules imported here)."""

from __future__ import annotations

from .evidence_component_rows import COMPONENT_ROWS
from .evidence_end_to_end_rows import END_TO_END_ROWS, TOY_SERVING_ROWS
from .rows import Row

EVIDENCE: tuple[Row, ...] = (*END_TO_END_ROWS, *COMPONENT_ROWS, *TOY_SERVING_ROWS)
