"""Every model family on CUDA (its kernels where it has them, CUDA graphs where they apply)
against the same checkpoint on the CPU float32 engine: float32 logits within 1e-4 through
prefill, decode and mixed steps (`family_trace`). bf16 against float32 is
`test_families_bf16.py`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from family_trace import FAMILIES, trace, write_family
from model_checks import small_runner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    return write_family(request.param, tmp_path_factory.mktemp(request.param))


@pytest.mark.parametrize("graphs", [False, True])
def test_family_on_cuda_matches_cpu_float32(checkpoint: Path, graphs: bool) -> None:
    ref, _ = trace(small_runner(checkpoint, "cpu", "float32", False))
    cuda = small_runner(checkpoint, "cuda", "float32", graphs)
    # every family's steps run as CUDA graphs where they are on (none ran eagerly instead)
    assert (cuda.cuda_graphs is not None) == graphs
    assert (cuda.piecewise is not None) == graphs
    got, _ = trace(cuda)
    for a, b in zip(got, ref, strict=True):
        assert not a.isnan().any()
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
