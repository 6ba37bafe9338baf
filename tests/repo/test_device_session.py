"""benchmark/device_session.sh parses and refuses an unknown part or stage before running
anything, even when valid stages come first."""

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmark" / "device_session.sh"


@pytest.mark.parametrize("args", [["everything"], ["tests", "study", "everything"], []])
def test_script_parses_and_names_its_stages(tmp_path, args):
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    done = subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path), *args], capture_output=True, text=True
    )
    assert done.returncode == 2
    assert "checks|e2e|figures" in done.stderr and "sweep_110k" in done.stderr
    assert not list(tmp_path.iterdir())  # nothing ran, nothing written


def test_every_stage_the_usage_names_is_accepted():
    """The usage line, the stage check and the stages run must agree: a stage named in the
    usage but missing from the check refused a device call before anything ran."""
    text = SCRIPT.read_text()
    named = text.split("(stages: ", 1)[1].split(")", 1)[0].split()
    check = text.split('case "$s" in ', 1)[1].split(")", 1)[0].split("|")
    assert sorted(named) == sorted(check)
    for stage in named:
        assert f"    {stage})" in text or f"{stage} |" in text or f"| {stage})" in text, stage
