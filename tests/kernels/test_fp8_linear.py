"""The block-FP8 linear (`safeserve.kernels.fp8_linear`, W8A8) against the torch reference that
dequantizes (`fp8_reference.fp8_linear` with activations quantized): on a GPU, or on CPU under
Triton's interpreter (TRITON_INTERPRET=1). Both quantize the activations to the same values
(`fp8_quant`), so they differ only in how the products are summed: in float32 within 1e-4
relative (norm of the error over norm of the result) under the interpreter, within
`GPU_FP8_DOT_TOL` on a GPU (its tensor cores' FP8 sums, below); with bf16 activations and result,
within 1e-2 (the result's rounding)."""

from __future__ import annotations

import os

import pytest
import torch
from seeds import seeded

from safeserve.kernels import fp8_linear as fl
from safeserve.kernels.fp8_reference import block_quantize, fp8_linear

HAS_CUDA = torch.cuda.is_available() and fl.HAS_TRITON
INTERPRET = fl.HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"
interp = pytest.mark.skipif(not INTERPRET, reason="needs Triton and TRITON_INTERPRET=1")
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and Triton")

# rows, in, out, bias: one row; in and out not multiples of 128 (partial scale tiles); more
# rows than one tile; a leading batch dimension
CASES = [(1, 256, 128, False), (5, 200, 130, True), (70, 384, 256, False), ((2, 9), 128, 64, True)]


def _check(device: str, dtype: torch.dtype, tol: float, cases) -> None:  # type: ignore[no-untyped-def]
    for i, (rows, k, n, with_bias) in enumerate(cases):
        gen = seeded(100 + i)
        shape = rows if isinstance(rows, tuple) else (rows,)
        w, s = block_quantize(torch.randn(n, k, generator=gen) * 0.05)
        x = torch.randn(*shape, k, generator=gen) * torch.exp(torch.randn(*shape, 1, generator=gen))
        bias = torch.randn(n, generator=gen) if with_bias else None
        x, w, s = x.to(dtype).to(device), w.to(device), s.to(device)
        if bias is not None:
            bias = bias.to(dtype).to(device)
        got = fl.fp8_linear_w8a8(x, w, s, bias)
        want = fp8_linear(
            x.float(), w, s, None if bias is None else bias.float(), quantize_input=True
        )
        assert got.dtype == dtype and got.shape == (*shape, n)
        err = (got.float() - want).norm() / want.norm()
        assert err <= tol, (rows, k, n, with_bias, float(err))


@interp
def test_interpreter_fp8_linear_matches_reference() -> None:
    _check("cpu", torch.float32, 1e-4, CASES)


# A Hopper tensor core sums an FP8 product's terms with about 14 mantissa bits, not float32's 24
# (DeepSeek-V3's report, section 3.3.2; the kernels, as its, take each 128-column block's product
# out to float32 before adding the next), so on a GPU float32 results differ from the exact
# reference by up to 2^-13 relative per block: 6e-5 to 1.3e-4 measured on an H200 where the
# interpreter's exact sums are within 1e-6.
GPU_FP8_DOT_TOL = 5e-4


@needs_cuda
@pytest.mark.gpu
def test_gpu_fp8_linear_matches_reference() -> None:
    _check("cuda", torch.float32, GPU_FP8_DOT_TOL, CASES)
    # Qwen3-30B-A3B's q|k|v and o_proj at decode and prefill sizes
    shapes = [(r, 2048, 5120, False) for r in (1, 7, 300)] + [(64, 4096, 2048, False)]
    _check("cuda", torch.bfloat16, 1e-2, CASES + shapes)


def _check_skinny_plans(device: str, tol: float) -> None:
    """The split-K kernel (decode-sized calls) under every column width and K slice it can be
    given, against the reference: rows across its 16- and 64-row tiles, K with a partial last
    128-column block and slices that run past K."""
    gen = seeded(200)
    for rows in (1, 17, 64):
        for k, n, with_bias in ((200, 130, True), (640, 384, False)):
            w, s = block_quantize(torch.randn(n, k, generator=gen) * 0.05)
            x = torch.randn(rows, k, generator=gen)
            bias = torch.randn(n, generator=gen) if with_bias else None
            want = fp8_linear(x, w, s, bias, quantize_input=True)
            x, w, s = x.to(device), w.to(device), s.to(device)
            bias = bias.to(device) if bias is not None else None
            for kb_per in (None, 2):
                for block_n in (None, 32):
                    out = torch.empty(rows, n, device=device)
                    fl._skinny(x, w, s, bias, out, block_n, kb_per)
                    err = float((out.cpu() - want).norm() / want.norm())
                    assert err <= tol, (rows, k, n, kb_per, block_n, err)


@interp
def test_interpreter_fp8_skinny_plans_match_reference() -> None:
    _check_skinny_plans("cpu", 1e-5)


@needs_cuda
@pytest.mark.gpu
def test_gpu_fp8_skinny_plans_match_reference() -> None:
    _check_skinny_plans("cuda", GPU_FP8_DOT_TOL)
