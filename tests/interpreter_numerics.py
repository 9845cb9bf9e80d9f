"""Where Triton's CPU interpreter (TRITON_INTERPRET=1) computes differently from any GPU, for the
interpreter runs of the kernel tests (`conftest.py` applies it in those runs only).

`tl.dot`: the interpreter computes a tile's product with one `np.matmul`, and NumPy's BLAS
(OpenBLAS) picks its micro-kernel by a row's position in the tile on some CPUs: on an AMD EPYC,
rows 6-15 of a 16-row tile were summed in another order than rows 0-5, so a row's bits depended
on the rows beside it, which no GPU's matrix unit does (a batch-invariant kernel then failed its
bit-for-bit check under the interpreter only). Here each row of the tile is its own product:
the same operation on every row, whatever its neighbours.

bfloat16: the interpreter keeps bf16 values as their 16 bits in uint16 arrays. It converted
float32 to bf16 by cutting the low 16 bits (a GPU rounds to nearest, ties to even), and `tl.dot`
multiplied the uint16 bit patterns as integers. Here a float32 -> bf16 cast rounds to nearest
even (NaN stays NaN) and a bf16 operand of a dot is widened to float32 exactly first (a GPU sums
bf16 products in float32), so bf16 kernels can be checked against torch under the interpreter."""

from __future__ import annotations

import os


def apply() -> bool:
    """Patches the interpreter when TRITON_INTERPRET=1 and Triton is importable; whether it did."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import numpy as np
        from triton.runtime import interpreter as ti
    except ImportError:
        return False

    tl = ti.tl

    def bf16_to_f32(bits):  # type: ignore[no-untyped-def]
        return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)

    def f32_to_bf16(x):  # type: ignore[no-untyped-def]
        u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
        rounded = ((u + (((u >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)
        quiet_nan = ((u >> 16) | 0x40).astype(np.uint16)
        return np.where(np.isnan(x), quiet_nan, rounded)

    cast_impl = ti.InterpreterBuilder.cast_impl

    def cast(self, src, dst_type):  # type: ignore[no-untyped-def]
        s, t = src.dtype.scalar, dst_type.scalar
        if s == tl.float32 and t == tl.bfloat16:
            return ti.TensorHandle(f32_to_bf16(src.data), t)
        if s == tl.bfloat16 and t == tl.float32:
            return ti.TensorHandle(bf16_to_f32(src.data), t)
        return cast_impl(self, src, dst_type)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # type: ignore[no-untyped-def]
        a_data, b_data = a.data, b.data
        if a.dtype.scalar == tl.bfloat16:
            a_data = bf16_to_f32(a_data)
        if b.dtype.scalar == tl.bfloat16:
            b_data = bf16_to_f32(b_data)
        if (a.dtype.primitive_bitwidth == 8 and a.dtype.is_floating()) or (
            b.dtype.primitive_bitwidth == 8 and b.dtype.is_floating()
        ):  # FP8 operands as the interpreter takes them: exactly, through float16
            a_data = ti._convert_float(a_data, a.dtype, ti.tl.float16, None).view(np.float16)
            b_data = ti._convert_float(b_data, b.dtype, ti.tl.float16, None).view(np.float16)
        dtype = d.data.dtype
        rows = [
            np.matmul(a_data[..., i : i + 1, :], b_data, dtype=dtype)
            for i in range(a_data.shape[-2])
        ]
        return ti.TensorHandle(np.concatenate(rows, axis=-2) + d.data, d.dtype.scalar)

    ti.InterpreterBuilder.create_dot = create_dot
    ti.InterpreterBuilder.cast_impl = cast  # every float cast of the builder goes through it
    return True
