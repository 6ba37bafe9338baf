"""Write a random tiny DeepSeek-V3.2 checkpoint; see ``--help``.

The generator is ``research.tiny_checkpoint`` (outside the wheel); this script puts the
repository root on the path, so it runs from anywhere: ``python scripts/make_tiny_checkpoint.py``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # research/

from research.tiny_checkpoint import main

if __name__ == "__main__":
    main()
