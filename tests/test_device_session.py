"""benchmark/device_session.sh parses and refuses an unknown part before running anything."""

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmark" / "device_session.sh"


def test_script_parses_and_names_its_parts(tmp_path):
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    done = subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path), "everything"], capture_output=True, text=True
    )
    assert done.returncode == 2 and "checks or e2e" in done.stderr
    assert not list(tmp_path.iterdir())  # nothing ran, nothing written
