"""The plugin harness counts ECHO's launches by kernel name: the names come from the
kernels package itself, so a renamed or added kernel is never left out of the count."""

from __future__ import annotations

import re
from pathlib import Path

from benchmark.harness.decode_loop import echo_kernel_names

KERNELS = Path(__file__).resolve().parents[2] / "python" / "sglang_echo" / "kernels"


def test_every_kernel_defined_in_the_package_is_counted():
    defined = {
        name
        for path in KERNELS.glob("*.py")
        for name in re.findall(r"^def (_\w+_kernel)\(", path.read_text(), flags=re.M)
    }
    names = echo_kernel_names()
    assert set(names) == defined
    # the multi-launch resolve's allocation kernels (kernels/alloc_lookback.py)
    lookback = re.findall(
        r"^def (_\w+_kernel)\(", (KERNELS / "alloc_lookback.py").read_text(), re.M
    )
    assert lookback and set(lookback) <= set(names)


def test_a_name_that_is_the_prefix_of_another_is_tried_after_it():
    names = echo_kernel_names()
    for i, short in enumerate(names):
        for longer in names[i + 1 :]:
            assert not longer.startswith(short), (short, longer)
