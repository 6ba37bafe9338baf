"""Research code outside the wheel (docs/DEVELOPMENT.md: Layout): ``research.topk`` (decode-time top-k
traces and cache simulations), ``research.train`` (training the small DSA model) and
``research.tiny_checkpoint`` (random tiny DeepSeek-V3.2 checkpoints for tests, the demo and
the benchmarks). They import ``sglang_echo``; nothing in ``sglang_echo`` imports them
(tests/test_import_direction.py). Importable with the repository root on the path, as
``benchmark`` is: ``python -m research.tiny_checkpoint --help`` from the root.
"""
