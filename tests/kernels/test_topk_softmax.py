"""The router's top-k softmax (`safeserve.kernels.topk_softmax`): the Triton kernel on a GPU
(or, on CPU, in Triton's interpreter when TRITON_INTERPRET=1) against the torch reference."""

from __future__ import annotations

import os

import pytest
import torch

from safeserve.kernels import topk_softmax as tk

HAS_CUDA = torch.cuda.is_available() and tk.HAS_TRITON
INTERPRET = tk.HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"

needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and Triton")
interp = pytest.mark.skipif(not INTERPRET, reason="needs Triton and TRITON_INTERPRET=1")


def _check_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> None:
    """Ids equal as sets per row (up to exact ties at the k-th place); weights to 1e-5."""
    w, i = tk.fused_topk_softmax(logits, top_k, renormalize)
    rw, ri = tk.topk_softmax_torch(logits, top_k, renormalize)
    assert w.dtype == torch.float32 and i.dtype == torch.int32 and i.shape == ri.shape
    probs = torch.softmax(logits.float(), dim=-1).cpu()
    for row, (a, b) in enumerate(zip(i.cpu(), ri.cpu(), strict=True)):
        if set(a.tolist()) != set(b.tolist()):
            # only acceptable if the differing experts tie exactly with the reference's choice
            got = probs[row, a.long()].sort().values
            want = probs[row, b.long()].sort().values
            assert torch.equal(got, want), f"row {row}: {a.tolist()} vs {b.tolist()}"
    torch.testing.assert_close(w.sort(dim=1).values, rw.sort(dim=1).values, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Triton interpreter on CPU (TRITON_INTERPRET=1): small shapes, float32/float16
# ---------------------------------------------------------------------------------------------


@interp
def test_interpreter_topk_softmax() -> None:
    _check_topk(torch.randn(37, 60), 8, False)
    _check_topk(torch.randn(5, 8), 2, True)


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "tokens,experts,top_k,renormalize,dtype",
    [
        (1, 128, 8, True, torch.bfloat16),
        (333, 60, 4, False, torch.float32),
        (4096, 128, 8, True, torch.float16),
        (17, 256, 8, False, torch.bfloat16),
        (5, 8, 2, True, torch.float32),
    ],
)
def test_gpu_topk_softmax_matches_torch(tokens, experts, top_k, renormalize, dtype) -> None:
    _check_topk(torch.randn(tokens, experts, device="cuda").to(dtype), top_k, renormalize)
