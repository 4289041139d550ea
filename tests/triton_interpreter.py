"""Triton's interpreter (TRITON_INTERPRET=1) for the kernel tests on CPU, with two of its bf16 bugs fixed.

Triton 3.9's interpreter keeps bf16 values as their raw uint16 bits, and
* `tl.dot` on bf16 operands multiplies those integers (numpy matmul of uint16: garbage);
* a float32 -> bf16 cast truncates (`tensor.to(tl.bfloat16)` on the GPU rounds to nearest even), and its
  rounding option carries a full mantissa into the exponent with `|` instead of `+`.
`fix_bf16()` upcasts bf16 dot operands to float32 (exact: bf16 products accumulate in float32, as on the
GPU's tensor cores) and rounds float32 -> bf16 to nearest even, on the interpreter's builder only. The
kernels run unchanged; tests/test_ovr_triton.py::test_interpreter_bf16_fix checks both against torch.
"""
from __future__ import annotations

import os

INTERPRET_ENV = "TRITON_INTERPRET"


def fix_bf16() -> None:
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_causal_adapter_bf16_fix", False):
        return
    dot, cast = builder.create_dot, builder.cast_impl

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a, b = (cast(self, x, tl.float32) if x.dtype.scalar == tl.bfloat16 else x for x in (a, b))
        return dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32).astype(np.uint64)
            rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # to nearest even
            return interpreter.TensorHandle(rounded, dst_type.scalar)
        return cast(self, src, dst_type)

    builder.create_dot, builder.cast_impl = create_dot, cast_impl
    builder._causal_adapter_bf16_fix = True


def interpreted_ovr_triton():
    """causal_adapter.modeling.ovr_triton with its kernels interpreted (the variable must be set before the
    module is first imported: triton.jit decides at decoration), bf16 fixed; None without triton."""
    os.environ[INTERPRET_ENV] = "1"
    try:
        import triton  # noqa: F401
    except ImportError:
        return None
    from causal_adapter.modeling import ovr_triton

    if not ovr_triton.INTERPRETED:
        raise RuntimeError("causal_adapter.modeling.ovr_triton was imported before TRITON_INTERPRET=1 was set")
    fix_bf16()
    return ovr_triton
