"""Where Triton's CPU interpreter (TRITON_INTERPRET=1) computes differently from any GPU, for the
interpreter runs of the kernel tests (`conftest.py` applies it in those runs only).

`tl.dot`: the interpreter computes a tile's product with one `np.matmul`, and NumPy's BLAS
(OpenBLAS) picks its micro-kernel by a row's position in the tile on some CPUs: on an AMD EPYC,
rows 6-15 of a 16-row tile were summed in another order than rows 0-5, so a row's bits depended
on the rows beside it, which no GPU's matrix unit does (a batch-invariant kernel then failed its
bit-for-bit check under the interpreter only). Here each row of the tile is its own product:
the same operation on every row, whatever its neighbours."""

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

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # type: ignore[no-untyped-def]
        a_data, b_data = a.data, b.data
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
    return True
