"""Counting a layer's routed choices per physical expert slot (EPLB's recorder), in one launch.

`count_experts(ids, out, real)` adds 1 to `out[e]` for every choice e >= 0 of `ids` [T, K]
(-1: not routed), skipping the rows where `real` [>= T] (bool) is False (a graph bucket's
padding). One relaxed atomic add per choice into the layer's int32 row (no fence: the counts are
read by later launches only; with the default acq_rel fences the counting cost a decode step of
Qwen3-30B-A3B's shapes at batch 64 on an H200 about 1 % more); no host sync, so a captured CUDA
graph holds it. The torch path (three to five launches) is the reference and the CPU path.
"""

from __future__ import annotations

import torch

from safeserve.kernels.common import HAS_TRITON, tl, triton, use_kernels

_BLOCK = 1024


def count_experts_torch(ids: torch.Tensor, out: torch.Tensor, real: torch.Tensor | None) -> None:
    if real is not None:
        ids = torch.where(real[: ids.shape[0], None], ids, -1)
    flat = ids.reshape(-1).to(torch.int64)
    out.scatter_add_(0, flat.clamp(min=0), (flat >= 0).to(out.dtype))


if HAS_TRITON:

    @triton.jit
    def _count_kernel(ids_ptr, real_ptr, out_ptr, n, K: tl.constexpr, HAS_REAL: tl.constexpr,
                      BLOCK: tl.constexpr):  # fmt: skip
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < n
        ids = tl.load(ids_ptr + offs, mask=inside, other=-1).to(tl.int32)
        if HAS_REAL:
            real = tl.load(real_ptr + offs // K, mask=inside, other=0)
            ids = tl.where(real != 0, ids, -1)
        counted = inside & (ids >= 0)
        tl.atomic_add(out_ptr + tl.where(counted, ids, 0), tl.full([BLOCK], 1, tl.int32),
                      mask=counted, sem="relaxed")  # fmt: skip


def count_experts(ids: torch.Tensor, out: torch.Tensor, real: torch.Tensor | None = None) -> None:
    """Adds `ids`' routed choices to `out` (one layer's counts per slot) in place."""
    if not (use_kernels(ids) and out.dtype == torch.int32 and ids.is_contiguous()):
        count_experts_torch(ids, out, real)
        return
    n = ids.numel()
    if n == 0:
        return
    k = ids.shape[-1] if ids.dim() > 1 else 1
    flags = real.view(torch.uint8) if real is not None else ids
    grid = (triton.cdiv(n, _BLOCK),)
    _count_kernel[grid](ids, flags, out, n, K=k, HAS_REAL=real is not None, BLOCK=_BLOCK)
