"""``python -m sglang_echo.bench_serving``: see ``sglang_echo.bench.serving``."""

import sys

from sglang_echo.bench.serving import main

if __name__ == "__main__":
    sys.exit(main())
