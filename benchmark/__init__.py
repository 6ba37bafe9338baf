"""Benchmark harnesses and record tooling, outside the wheel (docs/DEVELOPMENT.md: Layout).

``benchmark.e2e`` (the e2e study, run by benchmark/e2e_study.py), ``benchmark.study`` (the
study's DP-worker emulation and the server's benchmark model
loader), ``benchmark.evidence`` (README figures from the records), ``benchmark.make_tasks``
(synthetic InfiniteBench task files). They import ``sglang_echo``; nothing in
``sglang_echo`` imports them (tests/test_import_direction.py). Run them from the
repository root, which puts this package on the path: ``python -m benchmark.evidence``;
scripts run by path add the root themselves, and tests/conftest.py adds it for the tests.
"""
