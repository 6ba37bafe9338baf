"""Serving benchmark (``python -m sglang_echo.bench_serving``), its datasets, and plots."""
