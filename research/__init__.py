"""Research code outside the wheel (docs/DEVELOPMENT.md: Layout): ``research.topk`` (decode-time top-k
traces and cache simulations), ``research.train`` (training the small DSA model) and
``research.topk_pivot`` (a top-k design that lost). They import ``sglang_echo`` and the
tiny-checkpoint maker ``scripts.make_tiny_checkpoint``; nothing in ``sglang_echo`` imports
them (tests/test_import_direction.py), nor does a product test (tests/repo/test_layout.py).
Importable with the repository root on the path, as ``benchmark`` is (``scripts/`` and the
tests put it there: ``python scripts/train_tiny_dsa.py --help``).
"""
