"""Train the small DeepSeek-V3.2 (DSA) model used by the top-k studies; see ``--help``.

On the H200, from the repository root (about 6.5 minutes):
    PYTHONPATH=python python scripts/train_tiny_dsa.py --time-budget-s 390

The trainer is ``research.train`` (outside the wheel); this script puts the repository
root on the path.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # research/

from research.train.cli import main

if __name__ == "__main__":
    main()
