"""The FP8 KV cache's quantization: what a store writes and a load reads back.

A cache of `float8_e4m3fn` (`--kv-cache-dtype fp8_e4m3`) holds keys and values with a static
scale of 1 for every layer (as peer servers use when a checkpoint gives no `k_scale`/`v_scale`):
a value is clamped to the e4m3 range (+-448) and rounded to nearest even, and read back as it
is. Within the range the loss is the rounding to 3 mantissa bits (a relative error of at most
2^-4); a model whose keys or values go beyond +-448 loses more (they are clamped), and would
need the per-layer scales this cache does not take yet. A cache of any other dtype is a plain
cast, as before.

`to_cache` is the torch form (the CPU path and the kernels' oracle); `store_value` and
`load_value` are the Triton forms every store and attention kernel applies.
"""

from __future__ import annotations

import torch

from safeserve.kernels.common import HAS_TRITON, tl, triton

KV_FP8 = torch.float8_e4m3fn
KV_FP8_MAX = 448.0  # largest finite float8_e4m3fn


def to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` as the cache of `dtype` stores it: clamped and rounded for FP8 (torch's cast is
    round-to-nearest-even but turns values beyond the range into NaN), else cast."""
    if dtype == KV_FP8:
        return x.float().clamp(-KV_FP8_MAX, KV_FP8_MAX).to(KV_FP8)
    return x.to(dtype)


if HAS_TRITON:
    from safeserve.kernels.common import round_e4m3

    @triton.jit
    def store_value(x, ptr):
        """x converted to the element type of the cache pointer `ptr` (quantized for FP8)."""
        # one return, after the branch: the compiler checks every return of a function against
        # the others, even one a constexpr condition leaves out
        if ptr.dtype.element_ty == tl.float8e4nv:
            y = round_e4m3(x.to(tl.float32)).to(tl.float8e4nv)
        else:
            y = x.to(ptr.dtype.element_ty)
        return y

    @triton.jit
    def load_value(x, like):
        """A loaded cache tile x in the dtype of `like` (the query) where the cache is FP8 (its
        scale is 1: the dequantized value is the value); else x as loaded."""
        if x.dtype == tl.float8e4nv:
            y = x.to(like.dtype)
        else:
            y = x
        return y
