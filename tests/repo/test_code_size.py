"""benchmark/code_size.py: what counts as a code line, and the package's sum."""

from __future__ import annotations

import json

import pytest

from benchmark.code_size import PACKAGE, code_lines, main, package_sizes, raw_lines, summary


def test_blanks_comments_and_docstrings_do_not_count():
    source = (
        '"""Module docstring,\nover two lines."""\n'
        "\n"
        "# a comment\n"
        "import os  # a trailing comment\n"
        "\n"
        "class A:\n"
        '    """Class docstring."""\n'
        "\n"
        "    def f(self, x):\n"
        "        '''Function docstring.'''\n"
        "        return (x +\n"
        "                1)\n"
        "\n"
        'TEXT = """not a docstring:\n'
        'a value"""\n'
    )
    # import, class, def, the return's two lines, and the assigned string's two
    assert code_lines(source) == 7


def test_a_string_that_is_not_first_in_its_body_counts():
    assert code_lines("def f():\n    x = 1\n    'not a docstring'\n") == 3


def test_the_summary_adds_up(tmp_path, capsys):
    (tmp_path / "sub").mkdir()
    (tmp_path / "top.py").write_text("x = 1\ny = 2\n")
    (tmp_path / "sub" / "a.py").write_text('"""doc"""\nz = 3\n')
    sizes = package_sizes(tmp_path)
    assert sizes == {"sub/a.py": 1, "top.py": 2}
    got = summary(sizes, largest=1)
    assert got == {"total": 3, "units": {"root": 2, "sub": 1}, "largest": {"top.py": 2}}
    real = summary(package_sizes())
    assert real["total"] == sum(real["units"].values()) > 0
    assert main(["--largest", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{PACKAGE}: {real['total']:,} code lines")
    assert raw_lines(tmp_path) == 4 and raw_lines() > real["total"]
    assert main(["--root", str(tmp_path), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert (got["total"], got["raw_lines"]) == (3, 4)


def test_a_root_that_is_not_a_folder_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--root", str(tmp_path / "missing")])
    assert "is not a folder" in capsys.readouterr().err
