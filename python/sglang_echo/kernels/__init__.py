"""Triton kernels of the offload path; each file holds a kernel, its launcher, and the
plain-torch reference it must match. CPU tests run them with TRITON_INTERPRET=1, under which
the interpreter's bfloat16 is first made to round and multiply as the GPU's does
(kernels/interpreter.py)."""

import os

if os.environ.get("TRITON_INTERPRET") == "1":
    from sglang_echo.kernels.interpreter import fix_interpreter_bf16

    fix_interpreter_bf16()
