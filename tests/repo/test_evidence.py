"""The documents' measured numbers come from the records, and every record names the
committed command that wrote it (issue 13: evidence with provenance); the generated blocks
of README.md and docs/ equal benchmark/evidence/'s output; README stays short, and every
command and link it shows exists (issue 30)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from benchmark import evidence
from sglang_echo.bench.plot import main as plot_main

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmark" / "results"
README = ROOT / "README.md"
EVIDENCE = ROOT / "docs" / "EVIDENCE.md"


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
        elif i > 0 and words[i - 1] == "-m" and w.startswith(("benchmark.", "research.")):
            found.append(w.replace(".", "/") + ".py")  # run from the repository root
        elif i > 0 and words[i - 1].startswith("--"):
            continue  # an option's value (e.g. alloc_ab.py's --other FILE): an input, not run
        elif re.fullmatch(r"[\w./-]+\.(py|sh)", w) and not w.startswith("/"):
            found.append(w)
    return found


# Each document with generated blocks, and the blocks it holds.
GENERATED = {
    "README.md": ["results"],
    "docs/EVIDENCE.md": ["evidence"],
    "docs/ERRORS.md": ["errors"],
}


@pytest.mark.parametrize("doc", GENERATED)
def test_generated_blocks_match_the_generator(doc):
    text = (ROOT / doc).read_text()
    assert evidence.blocks_in(text) == GENERATED[doc]
    assert all(evidence.BLOCKS[name].doc == doc for name in GENERATED[doc])
    problems = evidence.differences(text, ROOT)
    assert problems == [], (
        "\n".join(problems) + f"\n(run make docs, or python -m benchmark.evidence --write {doc})"
    )


def test_every_error_row_is_refused_by_its_check():
    rows = evidence.error_rows()
    assert len(rows) >= 20
    for what, _where, check, message in rows:
        assert not message.startswith("NOT REFUSED"), (what, check)
        assert len(message) > 30, (what, message)
    used = {line.split(" | ")[2].split()[0] for line in evidence.ERRORS.strip().splitlines()}
    assert used == set(evidence.CHECKS)  # every check has a row
    assert not any("/tmp" in m for *_, m in rows)  # no temporary path leaks into the doc


def test_facts_name_fields_and_formats():
    """Every placeholder of every fact names a known format, and a derived value that
    exists; a missing field fails loudly, naming its path."""
    templates = [r.label for r in evidence.RESULTS] + [r.value for r in evidence.RESULTS]
    for row in evidence.EVIDENCE:
        templates += [f[1] if isinstance(f, tuple) else f for f in row.facts]
    for template in templates:
        for m in evidence.PLACEHOLDER.finditer(template):
            path, fmt = m.group(1), (m.group(2) or "")
            evidence.formatter(fmt)
            if path.startswith("@"):
                assert path[1:].split(".")[0] in evidence.DERIVED, path
    with pytest.raises(KeyError, match=r"metrics\.nothing"):
        evidence.fill("{metrics.nothing:us}", {"metrics": {}}, evidence.Records(ROOT))


README_SECTIONS = [
    "## Install",
    "## The two set-up commands",
    "## SGLang plugin: launch lines",
    "## Quick start: offline generation",
    "## Quick start: server and benchmark",
    "## End-to-end scripts",
    "## Results",
    "## Environment variables",
    "## Limitations",
    "## Documentation",
]


def test_readme_is_short_and_has_its_sections():
    """Issue 30: a README read in five minutes; everything else is in docs/."""
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move detail into docs/"
    assert [ln for ln in lines if ln.startswith("## ")] == README_SECTIONS


def _commands(text: str) -> list[list[str]]:
    """The command lines of a document's bash blocks, as words (continuations joined,
    ``&&`` splitting; environment assignments, ``&`` and comments dropped)."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                words = [w for w in shlex.split(part, comments=True) if w != "&"]
                while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
                    words.pop(0)
                if words:
                    found.append(words)
    return found


def _module_file(module: str) -> Path:
    base = ROOT / "python" if module.startswith("sglang_echo") else ROOT
    path = base / module.replace(".", "/")
    return path.with_suffix(".py") if path.with_suffix(".py").exists() else path / "__main__.py"


def _help(argv: list[str]) -> str:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'python'}"}
    proc = subprocess.run([*argv, "--help"], capture_output=True, text=True, cwd=ROOT, env=env)
    assert proc.returncode == 0, (argv, proc.stderr[-2000:])
    return proc.stdout


def test_readme_commands_exist():
    """Every command README shows runs something that exists: make targets, modules (and
    the flags it passes them, from their --help), scripts and repository paths."""
    text = README.read_text()
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    for words in _commands(text):
        prog, args = words[0], words[1:]
        if prog == "make":
            assert args[0] in targets, words
            continue
        if prog == "pip":
            continue
        if prog == "bash":
            script, flags = args[0], args[1:]
            assert (ROOT / script).is_file(), words
            shown = _help(["bash", script])
        else:
            assert prog in ("python", "python3", ".venv/bin/python") and args[0] == "-m", words
            module, flags = args[1], args[2:]
            if module.startswith("sglang."):  # SGLang's own launcher: not ours to check
                continue
            assert _module_file(module).is_file(), words
            shown = _help([sys.executable, "-m", module])
        for flag in (w.split("=")[0] for w in flags if w.startswith("--")):
            assert re.search(re.escape(flag) + r"(?![\w-])", shown), f"{flag}: not in {words[:3]}"
        for path in (w for w in flags if re.match(r"(models|scripts)/", w)):
            assert (ROOT / path).exists(), path
    # Paths, scripts and module:function specs named in the prose.
    for word in re.findall(r"`([^`\n]+)`", text):
        for path in re.findall(
            r"\b((?:python|benchmark|research|scripts|models|tests|docs)/[\w./-]*\w)", word
        ):
            assert (ROOT / path).exists(), path
        for script in re.findall(r"(?<![\w/])([\w-]+\.sh)\b", word):
            assert (ROOT / script).is_file(), script
        for module, func in re.findall(r"\b((?:benchmark|sglang_echo)\.[\w.]+):(\w+)", word):
            assert f"def {func}(" in _module_file(module).read_text(), (module, func)


def _slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lstrip("#").strip().lower())
    return text.replace(" ", "-")


@pytest.mark.parametrize(
    "doc",
    [README, *sorted((ROOT / "docs").glob("*.md"))],
    ids=lambda p: p.relative_to(ROOT).as_posix(),
)
def test_links_are_relative_and_resolve(doc):
    for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
        assert "://" not in target and not target.startswith("/"), f"{doc.name}: {target}"
        rel, _, anchor = target.partition("#")
        path = (doc.parent / rel).resolve() if rel else doc
        assert path.is_relative_to(ROOT) and path.exists(), f"{doc.name}: {target}"
        if anchor:
            headings = re.findall(r"^#+ .*$", path.read_text(), re.M)
            assert anchor in {_slug(h) for h in headings}, f"{doc.name}: {target}"


DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_prose_holds_no_measured_figure(doc):
    """Every measured number reaches README and docs through the generated block: the prose
    outside it names evidence rows and records, not figures (they drifted from the records
    when written by hand: top-k 125 vs 115 us, sparse MLA 1.2x vs 2.16x, two cache targets)."""
    found = evidence.prose_figures(doc.read_text())
    assert found == [], (
        f"{doc.name}: measured figures outside the evidence block (move them into a row of "
        "benchmark/evidence/ (its rows modules), or rephrase without them; design constants "
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
    text = README.read_text()
    readme.write_text(text.replace("## Limitations\n", "## Limitations\n\nIt took 125 us.\n", 1))
    assert evidence.main(["--check", str(readme), "--root", str(ROOT)]) == 1
    readme.write_text(text)
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
    # A day, or a day and a UTC time (datetime.isoformat) where a script records when.
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}(T\d{2}:\d{2}:\d{2}\+00:00)?", record["date"]), record[
        "date"
    ]
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
    good = EVIDENCE.read_text()
    bad = _altered(good, "decode prefetch")
    problems = evidence.differences(bad, ROOT)
    assert problems and all("decode prefetch" in p for p in problems), problems
    doc = tmp_path / "EVIDENCE.md"
    doc.write_text(bad)
    assert evidence.main(["--check", str(doc), "--root", str(ROOT)]) == 1
    assert evidence.main(["--write", str(doc), "--root", str(ROOT)]) == 0
    assert evidence.main(["--check", str(doc), "--root", str(ROOT)]) == 0
    assert doc.read_text() == good


def test_check_fails_on_an_altered_result_or_message():
    text = README.read_text()
    block = evidence.extract(text, "results")
    bad = text.replace(block, block.replace("| yes |", "| NO |", 1), 1)
    assert bad != text and evidence.differences(bad, ROOT)
    errors = (ROOT / "docs" / "ERRORS.md").read_text()
    bad = errors.replace("is not understood", "is wrong", 1)
    assert bad != errors and any(
        "same numbers, different text" in p for p in evidence.differences(bad, ROOT)
    )


def test_check_fails_without_block_or_with_extra_row(tmp_path):
    assert evidence.differences("# no block\n", ROOT)
    text = EVIDENCE.read_text()
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
