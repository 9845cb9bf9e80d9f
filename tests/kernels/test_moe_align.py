"""The MoE align (`safeserve.kernels.moe_align`): the torch layout and its bound on CPU; the
Triton kernel on a GPU (or, on CPU, in Triton's interpreter when TRITON_INTERPRET=1) against
the torch reference."""

from __future__ import annotations

import os

import pytest
import torch
from counters import assert_counters_zero
from seeds import seeded

from safeserve.kernels import moe_align as ma

HAS_CUDA = torch.cuda.is_available() and ma.HAS_TRITON
INTERPRET = ma.HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"

needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and Triton")
interp = pytest.mark.skipif(not INTERPRET, reason="needs Triton and TRITON_INTERPRET=1")


def _check_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> None:
    got = ma.moe_align(topk_ids, num_experts, block_m)
    want = ma.moe_align_torch(topk_ids.cpu(), num_experts, block_m)
    sorted_ids, block_expert, npost = (t.cpu() for t in got)
    assert sorted_ids.shape == want[0].shape and block_expert.shape == want[1].shape
    assert torch.equal(npost, want[2])
    assert torch.equal(block_expert, want[1])
    rows = int(want[2])
    row_expert = want[1].repeat_interleave(block_m)[:rows]
    for e in range(num_experts):
        seg = row_expert == e
        # Within an expert the order is the atomic counters'; as a multiset it must agree.
        assert torch.equal(sorted_ids[:rows][seg].sort().values, want[0][:rows][seg].sort().values)


# ---------------------------------------------------------------------------------------------
# CPU: pure python (no Triton needed)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_align_torch_layout(seed: int) -> None:
    gen = seeded(seed)
    num_experts = int(torch.randint(1, 70, (1,), generator=gen))
    block_m = [16, 32, 64][seed % 3]
    pairs = int(torch.randint(1, 600, (1,), generator=gen))
    ids = torch.randint(-1, num_experts, (pairs, 1), generator=gen)
    sorted_ids, block_expert, npost = ma.moe_align_torch(ids, num_experts, block_m)
    max_blocks = ma.max_padded_blocks(pairs, num_experts, block_m)
    assert sorted_ids.numel() == max_blocks * block_m and block_expert.numel() == max_blocks
    rows = int(npost)
    assert rows % block_m == 0 and rows <= sorted_ids.numel()
    flat = ids.reshape(-1)
    real = sorted_ids[:rows][sorted_ids[:rows] < pairs]
    # every valid pair appears exactly once, no dropped (-1) pair appears
    assert torch.equal(real.sort().values.long(), torch.nonzero(flat >= 0).squeeze(1))
    for b in range(rows // block_m):
        tile = sorted_ids[b * block_m : (b + 1) * block_m]
        members = tile[tile < pairs].long()
        assert members.numel() > 0
        assert torch.all(flat[members] == block_expert[b])
    assert torch.all(block_expert[rows // block_m :] == -1)
    assert torch.all(sorted_ids[rows:] == pairs)


def test_max_padded_blocks_is_tight_for_one_token() -> None:
    assert ma.max_padded_blocks(8, 128, 16) == 8
    assert ma.max_padded_blocks(0, 128, 16) == 0
    # worst case: every expert gets one pair more than a multiple of the tile
    assert ma.max_padded_blocks(128 * 17, 128, 16) == 128 * 2


# ---------------------------------------------------------------------------------------------
# Triton interpreter on CPU (TRITON_INTERPRET=1): small shapes, float32/float16
# ---------------------------------------------------------------------------------------------


@interp
@pytest.mark.parametrize(
    "pairs,experts,block_m", [(8, 8, 16), (100, 60, 16), (3000, 37, 32), (5000, 128, 64)]
)
def test_interpreter_align(pairs: int, experts: int, block_m: int) -> None:
    """Above 2,048 pairs: several programs, the last one lays out the experts and resets the
    counters, so back-to-back calls (as in a graph replay) start from zero."""
    gen = seeded(pairs)
    for _ in range(2):
        _check_align(torch.randint(-1, experts, (pairs, 1), generator=gen), experts, block_m)
        assert_counters_zero()


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "pairs,experts,block_m",
    [(8, 128, 16), (1, 3, 16), (500, 60, 16), (2048, 128, 32), (2049, 37, 64), (32768, 128, 128)],
)
def test_gpu_align_matches_torch(pairs: int, experts: int, block_m: int) -> None:
    ids = torch.randint(-1, experts, (pairs, 1), device="cuda")
    _check_align(ids, experts, block_m)
