"""The expert-count kernel (`safeserve.kernels.expert_count`) against its torch reference: on a
GPU, or on CPU in Triton's interpreter (TRITON_INTERPRET=1); the torch path alone otherwise."""

from __future__ import annotations

import os

import pytest
import torch
from seeds import seeded

from safeserve.kernels import expert_count as ec

HAS_CUDA = torch.cuda.is_available() and ec.HAS_TRITON
INTERPRET = ec.HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"


def _case(device: str, rows: int, k: int, slots: int, seed: int):  # type: ignore[no-untyped-def]
    gen = seeded(seed)
    ids = torch.randint(-1, slots, (rows, k), generator=gen)
    real = torch.rand(rows + 3, generator=gen) > 0.3  # longer than the rows, as a bucket's
    return ids.to(device), real.to(device)


def _want(ids: torch.Tensor, slots: int, real: torch.Tensor | None) -> torch.Tensor:
    out = torch.zeros(slots, dtype=torch.int64)
    for r, row in enumerate(ids.cpu().tolist()):
        if real is not None and not bool(real[r]):
            continue
        for e in row:
            if e >= 0:
                out[e] += 1
    return out


def test_torch_path_counts_routed_choices_of_real_rows() -> None:
    ids, real = _case("cpu", 37, 3, 12, 0)
    for mask in (None, real):
        out = torch.zeros(12, dtype=torch.int64)
        ec.count_experts_torch(ids, out, mask)
        assert torch.equal(out, _want(ids, 12, mask))


@pytest.mark.kernel
@pytest.mark.skipif(not (HAS_CUDA or INTERPRET), reason="needs Triton on a GPU or interpreted")
@pytest.mark.parametrize(("rows", "k", "slots"), [(1, 8, 144), (64, 8, 144), (3000, 2, 12)])
def test_interpreter_or_gpu_kernel_equals_the_reference(rows: int, k: int, slots: int) -> None:
    device = "cuda" if HAS_CUDA else "cpu"
    ids, real = _case(device, rows, k, slots, rows)
    for mask in (None, real):
        out = torch.full((slots,), 5, dtype=torch.int32, device=device)  # adds to what is there
        ec.count_experts(ids.contiguous(), out, mask)
        assert torch.equal(out.cpu().long() - 5, _want(ids, slots, mask))
