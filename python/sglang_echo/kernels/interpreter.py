"""The Triton interpreter's bfloat16, made to behave as the GPU's.

Why a module of its own: the fix must be in place before the first interpreted kernel of a
process runs (any kernel: a float32 -> bf16 cast anywhere rounds differently otherwise), so
``kernels/__init__.py`` applies it on import when TRITON_INTERPRET=1; launchers call it
again (idempotent) for a process that sets the variable later.
"""

from __future__ import annotations

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
