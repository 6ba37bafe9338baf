"""The repository's scripts (outside the wheel): CLIs run as ``python scripts/NAME.py``, and
``scripts.make_tiny_checkpoint``, the tiny-checkpoint maker that ``make demo``, the tests
and ``research/`` share, importable with the repository root on the path."""
