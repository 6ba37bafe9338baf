"""Compile recorded Triton launches for an H100/H200 (sm_90) without a GPU.

The CPU interpreter runs kernels as Python, so it accepts code that Triton's compiler
rejects (a variable whose type differs between the branches of an ``if``, a constexpr
reassigned in ``static_range``...), and such errors used to surface only on the GPU
machine. tests/conftest.py records every interpreted launch of our kernels (kernel, the
argument types, the constexpr values); this script, run in a process *without*
TRITON_INTERPRET, compiles each one to PTX and cubin with the ptxas that ships in the
triton wheel. Usage: ``python tests/sm90_compile.py launches.json``.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def compile_all(launches: list[dict]) -> list[str]:
    """Returns one error message per launch that does not compile (empty: all compiled)."""
    target = GPUTarget("cuda", 90, 32)
    errors = []
    for launch in launches:
        kernel = getattr(importlib.import_module(launch["module"]), launch["kernel"])
        for constexprs, options in _variants(launch["constexprs"]):
            src = ASTSource(fn=kernel, signature=launch["signature"], constexprs=constexprs)
            try:
                triton.compile(src, target=target, options=options)
            except Exception as exc:  # report every failing launch
                errors.append(f"{launch['module']}.{launch['kernel']} {options}: {exc}")
    return errors


def _variants(constexprs: dict) -> list[tuple[dict, dict]]:
    """The launch as recorded, and for a kernel that can chain (kernels/pdl.py) also the
    chained launch the GPU runs: the interpreter only ever runs it unchained."""
    variants = [(constexprs, {})]
    if "PDL" in constexprs:
        variants.append(({**constexprs, "PDL": True}, {"launch_pdl": True}))
    return variants


if __name__ == "__main__":
    launches = json.loads(Path(sys.argv[1]).read_text())
    errors = compile_all(launches)
    for e in errors:
        print(e, file=sys.stderr)
    print(f"compiled {len(launches) - len(errors)} of {len(launches)} launches for sm_90")
    sys.exit(1 if errors else 0)
