"""FP8 (e4m3) activation quantization in Triton, shared by the block-FP8 kernels.

`token_group_quant` quantizes activations per token and 128 columns (`scale = max|x| / 448`),
the `dynamic` scheme of DeepSeek-V3's and Qwen3-FP8's checkpoints. `common.round_e4m3` rounds a
float32 to the nearest e4m3 value (ties to even, saturating at 448) in float32 arithmetic, so the
conversion that follows is exact: results equal the torch quantizer's
(`fp8_reference.token_group_quantize`) on a GPU and under Triton's CPU interpreter, whose own
float-to-FP8 conversion truncates.
"""

from __future__ import annotations

import torch

from safeserve.kernels.common import (
    HAS_TRITON,
    next_power_of_2,
    pdl_supported,
    tl,
    triton,
    use_kernels,
)
from safeserve.kernels.fp8_reference import FP8, MIN_AMAX

GROUP = 128  # the scale block: 128 x 128 weight tiles, 128-column activation groups

if HAS_TRITON:
    from safeserve.kernels.common import pdl_wait, round_e4m3

    @triton.jit(do_not_specialize=["num_rows"])
    def _token_group_quant_kernel(
        x_ptr,
        q_ptr,
        s_ptr,
        num_rows,
        K,
        stride_x,
        stride_q,
        stride_s,
        GROUP_K: tl.constexpr,
        MIN_SCALE_AMAX: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        """q[t, g*G:(g+1)*G], s[t, g] of one (token, column group)."""
        pdl_wait(USE_PDL)
        t = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1)
        offs = g * GROUP_K + tl.arange(0, GROUP_K)
        ok = offs < K
        x = tl.load(x_ptr + t * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(x), axis=0), MIN_SCALE_AMAX)
        # IEEE-rounded divisions: a GPU's default float32 `/` is approximate, and a quotient one
        # ulp off flips an e4m3 rounding that the torch reference makes the other way
        scale = tl.div_rn(amax, 448.0)
        q = round_e4m3(tl.div_rn(x, scale))
        tl.store(q_ptr + t * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=ok)
        tl.store(s_ptr + t * stride_s + g, scale)


def token_group_quant(x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn x, float32 scale [T, ceil(K / group)]) of `x` [T, K]: per token and
    `group` columns `scale = max|x| / 448` (`fp8_reference.token_group_quantize`'s values)."""
    if not use_kernels(x) or x.dim() != 2 or group != next_power_of_2(group):
        from safeserve.kernels.fp8_reference import token_group_quantize

        return token_group_quantize(x, group)
    rows, k = x.shape
    x = x if x.stride(1) == 1 else x.contiguous()
    groups = triton.cdiv(k, group)
    q = torch.empty(rows, k, dtype=FP8, device=x.device)
    s = torch.empty(rows, groups, dtype=torch.float32, device=x.device)
    if rows == 0:
        return q, s
    pdl = pdl_supported(x.device)
    _token_group_quant_kernel[(rows, groups)](
        x,
        q,
        s,
        rows,
        k,
        x.stride(0),
        q.stride(0),
        s.stride(0),
        GROUP_K=group,
        MIN_SCALE_AMAX=MIN_AMAX,
        USE_PDL=pdl,
        num_warps=4 if group >= 512 else 1,
        launch_pdl=pdl,
    )
    return q, s
