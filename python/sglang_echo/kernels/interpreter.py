"""The Triton interpreter's bfloat16, made to behave as the GPU's.

Why a module of its own: the fix must be in place before the first interpreted kernel of a
process runs (any kernel: a float32 -> bf16 cast anywhere rounds differently otherwise), so
``kernels/__init__.py`` applies it on import when TRITON_INTERPRET=1; launchers call it
again (idempotent) for a process that sets the variable later.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import triton.language as tl


def fix_interpreter_bf16() -> None:
    """Make the Triton interpreter's bfloat16 behave as the GPU's: ``tl.dot`` of bfloat16
    operands computes in float32, and float32 -> bfloat16 rounds to nearest even.

    Triton 3.6's interpreter keeps bf16 values as their uint16 bit patterns and feeds them
    to ``np.matmul`` as integers (a nonsense result, orders of magnitude off). Widening a bf16 operand to
    float32 is exact, and bf16 x bf16 products are exact in float32, so this is the GPU's
    bf16 MMA with float32 accumulation. Patched here, not in the kernel, so the interpreted
    kernel is the very one compiled for the GPU (tests/test_zz_compile_sm90.py). Only runs
    under TRITON_INTERPRET=1; idempotent.
    """
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_echo_bf16_dot", False):
        return
    original = builder.create_dot

    def widen(x):
        if x.dtype != tl.bfloat16:
            return x
        data = (x.data.astype(np.uint32) << 16).view(np.float32)
        return interpreter.TensorHandle(data, tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    def round_to_bf16(self, src, dst_type):
        # Triton's interpreter truncates float32 -> bfloat16; the GPU (cvt.rn.bf16.f32), and
        # torch, round to nearest even. Rounded here as the GPU does, so that a value the
        # kernel converts (fp8 rows dequantized in registers, the output) has the bits the
        # torch path gives it.
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = src.data.astype(np.float32).view(np.uint32).astype(np.uint64)
            rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
            nan = np.isnan(src.data)
            rounded[nan] = 0x7FC0
            return interpreter.TensorHandle(rounded, tl.bfloat16)
        return original_cast(self, src, dst_type)

    original_cast = builder.cast_impl
    builder.create_dot = create_dot
    builder.cast_impl = round_to_bf16
    builder.create_fp_trunc = lambda self, src, dst_type: self.cast_impl(src, dst_type)
    builder._echo_bf16_dot = True


_ROW_WISE = threading.local()  # per thread: a launch in another thread keeps its own dots


@contextmanager
def row_independent_dots() -> Iterator[None]:
    """Within this block (this thread only), the interpreter's ``tl.dot`` computes each row
    of its left operand on its own, so a row's bits do not depend on where it sits in the
    tile.

    Why: the interpreter hands a dot to ``np.matmul``, and OpenBLAS sums a row's products
    in an order that depends on the row's position in the block (on this machine rows 6 to
    15 of a 16-row tile round differently from row 0). A GPU's MMA computes every row of a
    tile with the same instructions, which is what the batch-invariant GEMM
    (kernels/invariant_matmul.py) relies on; its launcher runs under this block so that the
    interpreted kernel is batch invariant too. Other kernels keep the one-call dot."""
    _install_row_wise_dot()
    before = getattr(_ROW_WISE, "on", False)
    _ROW_WISE.on = True
    try:
        yield
    finally:
        _ROW_WISE.on = before


def _install_row_wise_dot() -> None:
    """Wrap the interpreter's dot (whatever wraps it already, e.g. the bf16 fix) once."""
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_echo_row_dot", False):
        return
    current = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if not getattr(_ROW_WISE, "on", False) or a.data.ndim != 2:
            return current(self, a, b, d, input_precision, max_num_imprecise_acc)
        rows = [
            current(
                self,
                interpreter.TensorHandle(a.data[i : i + 1], a.dtype),
                b,
                interpreter.TensorHandle(d.data[i : i + 1], d.dtype),
                input_precision,
                max_num_imprecise_acc,
            )
            for i in range(a.data.shape[0])
        ]
        return interpreter.TensorHandle(np.concatenate([r.data for r in rows]), rows[0].dtype)

    builder.create_dot = create_dot
    builder._echo_row_dot = True
