"""The facts' mini-language: a template whose placeholders name a record's field and
its format (``{metrics.logits_us:us}``) or a derived value (``{@name.field:format}``), and
the optional fact (a leading "?", left out where the record lacks the field).

``DERIVED`` is filled by the ``derived_*`` modules as they are imported; the package's
``__init__`` imports them all, so any import of ``benchmark.evidence`` sees every name."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from .formats import formatter
from .records import Records, field

# Values derived from a record (ratios, ranges, loops over its entries, another record's
# field beside it): ``{@name}`` in a fact calls DERIVED[name](record, records).
DERIVED: dict[str, Callable[[dict, Records], Any]] = {}


def derived(fn: Callable[[dict, Records], Any]) -> Callable[[dict, Records], Any]:
    DERIVED[fn.__name__] = fn
    return fn


PLACEHOLDER = re.compile(r"\{([^{}:]+)(?::([^{}]*))?\}")


def fill(template: str, d: dict, r: Records) -> str:
    """``template`` with each ``{field.path:format}`` (or ``{@derived:format}``) replaced by
    the record's value, written in that format (none: as it is)."""

    def value(m: re.Match) -> str:
        path, fmt = m.group(1), m.group(2) or ""
        if path.startswith("@"):  # {@name.sub.path}: a field of the derived value
            name, _, sub = path[1:].partition(".")
            v = DERIVED[name](d, r)
            v = field(v, sub) if sub else v
        else:
            v = field(d, path)
        return formatter(fmt)(v)

    return PLACEHOLDER.sub(value, template)


# A fact: a template read from the row's record, or (record, template) for another record.
# A template starting with "?" is left out when one of its fields is missing or None (fields
# that only some runs write).
Fact = str | tuple[str, str]


def render_fact(fact: Fact, d: dict, r: Records) -> str | None:
    rel, template = fact if isinstance(fact, tuple) else (None, fact)
    d = r(rel) if rel else d
    if not template.startswith("?"):
        return fill(template, d, r)
    try:
        return fill(template[1:], d, r)
    except (KeyError, TypeError):
        return None
