"""The rows of the generated tables: ``Row`` (a claim of docs/EVIDENCE.md, its facts
and the records they come from) and ``Result`` (a headline number of README.md); each
renders to its table's three cells."""

from __future__ import annotations

from dataclasses import dataclass

from .records import Records
from .template import Fact, fill, render_fact


def source(d: dict, rel: str, kind: str = "measured") -> str:
    return f"`{rel}` ({kind}; {d['device']}, {d['date']})"


@dataclass(frozen=True)
class Row:
    """A claim of docs/EVIDENCE.md: its facts, joined by "; ", read from ``record`` (and
    ``also``, named beside it in the record column)."""

    claim: str
    record: str
    facts: tuple[Fact, ...]
    kind: str = "measured"
    also: tuple[str, ...] = ()

    def render(self, r: Records) -> tuple[str, str, str]:
        d = r(self.record)
        text = "; ".join(t for f in self.facts if (t := render_fact(f, d, r)) is not None)
        srcs = ", ".join(source(r(rel), rel, self.kind) for rel in (self.record, *self.also))
        return self.claim, text, srcs


@dataclass(frozen=True)
class Result:
    """A row of README's results table: one value of one record."""

    label: str
    record: str
    value: str  # a fact's template

    def render(self, r: Records) -> tuple[str, str, str]:
        d = r(self.record)
        return fill(self.label, d, r), fill(self.value, d, r), f"`{self.record}` ({d['date']})"
