"""``python -m benchmark.evidence``: runs ``cli.main`` (its docstring tells the options)."""

from __future__ import annotations

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
