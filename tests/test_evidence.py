"""README's measured numbers come from the records, and every record names the committed
command that wrote it (issue 13: evidence with provenance)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from sglang_echo.bench import evidence
from sglang_echo.bench.plot import main as plot_main

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmark" / "results"
README = ROOT / "README.md"


def _current_records() -> list[Path]:
    return sorted(
        p for p in RESULTS.rglob("*.json") if "history" not in p.relative_to(RESULTS).parts
    )


def _scripts(command: str) -> list[str]:
    """Repository paths of the scripts and modules a command line runs."""
    try:
        words = shlex.split(command)
    except ValueError:
        words = command.split()
    found = []
    for i, w in enumerate(words):
        w = w.strip(";,()")
        if i > 0 and words[i - 1] == "-m" and w.startswith("sglang_echo"):
            found.append("python/" + w.replace(".", "/") + ".py")
        elif re.fullmatch(r"[\w./-]+\.(py|sh)", w) and not w.startswith("/"):
            found.append(w)
    return found


def test_readme_block_matches_records():
    problems = evidence.differences(README.read_text(), ROOT)
    assert problems == [], (
        "\n".join(problems) + "\n(run python -m sglang_echo.bench.evidence --write README.md)"
    )


DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_prose_holds_no_measured_figure(doc):
    """Every measured number reaches README and docs through the generated block: the prose
    outside it names evidence rows and records, not figures (they drifted from the records
    when written by hand: top-k 125 vs 115 us, sparse MLA 1.2x vs 2.16x, two cache targets)."""
    found = evidence.prose_figures(doc.read_text())
    assert found == [], (
        f"{doc.name}: measured figures outside the evidence block (move them into a row of "
        "python/sglang_echo/bench/evidence.py, or rephrase without them; design constants "
        "go in evidence.ALLOWED_FIGURES):\n" + "\n".join(found)
    )


@pytest.mark.parametrize(
    "figure",
    [
        "the radix select takes 125 us",
        "it ran 1.2× faster",
        "ECHO gives 2.16x at rate inf",
        "a gather at 45.1 GB/s",
        "no-offload's step got 4% faster",
        "hit rates 0.79-0.96",
        "hit ~0.37",
        "4,625 evictions per step",
        "About 25 s on 2 CPU cores",
        "(10-15 minutes on 2 CPU cores)",
        "ECHO 708 tok/s",
        "at 254 registers",
    ],
)
def test_prose_check_flags_measured_figures(figure):
    assert evidence.prose_figures(f"Some prose:\n{figure}, and more.\n"), figure


def test_prose_check_spares_blocks_code_versions_and_design_constants():
    text = (
        "Top-k 2048 of 656 B rows, k=2048, 8 layers, batches 1-4, commit c4a2e78, torch 2.11,\n"
        "Python >= 3.11, CPython 3.10-3.13, `history/2026-12-01-x/` and `took 125 us`.\n"
        "```bash\nNSA_DEV_CACHE_SIZE=260_000 sleep 0.5 # 3.5 us\n```\n"
        f"{evidence.HEADER}\n| row | 125 us, 2.16x, 45.1 GB/s |\n{evidence.END}\n"
        "<!-- bad-inputs:begin -->\n| 0.5 ms |\n<!-- bad-inputs:end -->\n"
        "ECHO's published 2.15x / 3.10x /\n4.12x (8xH20), alpha 0.5.\n"
    )
    assert evidence.prose_figures(text) == []
    found = evidence.prose_figures(text + "But this took 3.5 us.\n")
    assert found and all(f.startswith("line 14: '3.5") for f in found), found


def test_check_fails_on_a_figure_in_the_prose(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(README.read_text().replace("## Tests\n", "## Tests\n\nIt took 125 us.\n", 1))
    assert evidence.main(["--check", str(readme), "--root", str(ROOT)]) == 1
    readme.write_text(README.read_text())
    assert evidence.main(["--check", str(readme), "--root", str(ROOT)]) == 0


def test_records_found():
    names = {p.relative_to(RESULTS).as_posix() for p in _current_records()}
    for name in (
        "indexer.json",
        "cache_ops.json",
        "gpu_checks.json",
        "serving/h200/serving_sweep.json",
    ):
        assert name in names


@pytest.mark.parametrize(
    "path", _current_records(), ids=lambda p: p.relative_to(RESULTS).as_posix()
)
def test_record_names_committed_command(path):
    record = json.loads(path.read_text())
    assert isinstance(record, dict), f"{path}: not a record"
    for field in ("command", "device", "date"):
        assert record.get(field), f"{path}: no {field!r}"
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", record["date"]), record["date"]
    commands = [record["command"], record.get("analyze_command"), *record.get("sweeps", [])]
    for command in filter(None, commands):
        scripts = _scripts(command)
        assert scripts, f"{path}: command names no script: {command!r}"
        for script in scripts:
            assert (ROOT / script).is_file(), (
                f"{path}: {script} (in {command!r}) is not in the repository"
            )


def _altered(text: str, claim: str) -> str:
    """``text`` with the first number after the claim cell of row ``claim`` changed."""
    block = evidence.extract(text)
    line = next(ln for ln in block.splitlines() if ln.startswith(f"| {claim} |"))
    head, rest = line.split(" | ", 1)
    m = evidence.NUMBER.search(rest)
    changed = (
        rest[: m.start()] + str(int(m.group().split(".")[0].replace(",", "")) + 7) + rest[m.end() :]
    )
    return text.replace(line, f"{head} | {changed}", 1)


def test_check_fails_on_altered_number(tmp_path):
    bad = _altered(README.read_text(), "decode prefetch")
    problems = evidence.differences(bad, ROOT)
    assert problems and all("decode prefetch" in p for p in problems), problems
    readme = tmp_path / "README.md"
    readme.write_text(bad)
    assert evidence.main(["--check", str(readme), "--root", str(ROOT)]) == 1
    assert evidence.main(["--write", str(readme), "--root", str(ROOT)]) == 0
    assert evidence.main(["--check", str(readme), "--root", str(ROOT)]) == 0
    assert readme.read_text() == README.read_text()


def test_check_fails_without_block_or_with_extra_row(tmp_path):
    assert evidence.differences("# no block\n", ROOT)
    text = README.read_text()
    extra = text.replace(evidence.END, "| made up | 1.00x | nowhere |\n" + evidence.END, 1)
    assert any("made up" in p for p in evidence.differences(extra, ROOT))


def _run(folder: Path, rates: dict[str, float]) -> None:
    folder.mkdir(parents=True)
    for rate, tput in rates.items():
        rec = {
            "output_throughput": tput,
            "median_itl_ms": 5.0,
            "p99_itl_ms": 50.0,
            "completed": 4,
        }
        (folder / f"req_rate_{rate}.jsonl").write_text(json.dumps(rec) + "\n")


def test_plot_record_merges_sweeps(tmp_path):
    root = tmp_path / "infini"
    _run(root / "no-offload", {"1": 100.0, "inf": 200.0})
    _run(root / "offload", {"1": 150.0, "inf": 180.0})
    cfg = tmp_path / "sweep_config.txt"
    cfg.write_text("model m: pools\nNVIDIA H200, 143771 MiB\ntorch 2.11\n")
    out, rec = tmp_path / "plots", tmp_path / "serving_sweep.json"
    argv = [str(root), "--out-dir", str(out), "--record", str(rec), "--config", str(cfg)]
    argv += [
        "--sweep-command",
        "RATES=1,inf bash benchmark/serving_sweep.sh /tmp/s",
        "--date",
        "2026-11-30",
    ]
    assert plot_main(argv) == 0
    record = json.loads(rec.read_text())
    assert record["device"] == "NVIDIA H200" and record["date"] == "2026-11-30"
    assert record["command"] == shlex.join(["python", "-m", "sglang_echo.bench.plot", *argv])
    assert record["sweeps"] == ["RATES=1,inf bash benchmark/serving_sweep.sh /tmp/s"]
    assert record["metrics"]["runs"]["offload"]["inf"]["p99_itl_ms"] == 50.0
    assert record["metrics"]["offload_over_no_offload_output_throughput"]["all"]["1"] == 1.5
    assert not (out / "summary.json").exists()  # the record holds it
    cfg.write_text("no GPU line\n")
    with pytest.raises(SystemExit):
        plot_main(argv)
