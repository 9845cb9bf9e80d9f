"""The attention block's q|k|v projection with the q/k RMSNorm, RoPE and KV-cache store folded in
(`qkv_norm_rope_store`), for decode-sized batches.

It is `linear.skinny_linear` with column tiles one head wide (BLOCK_N = head_dim): each program
reads its one weight tile before its dependent-launch wait, stores a float32 partial, and the last
program of a head to arrive sums the partials in a fixed order, so it holds the whole head. That
program then does what `norm_rope.qk_norm_rope_store` does for the head (q/k RMSNorm and RoPE into
q; k and v into the paged cache at the token's slot) instead of storing q|k|v. One launch instead
of two per layer; on an H200 the decode step at concurrency 1 went from 3.23-3.24 to 3.16-3.18 ms
(kernels/RESULTS.md, tenth session). v equals the two launches' bit for bit; q and k may differ
from them by one bf16 rounding step, rarely (the norm's sum of squares is reduced over a tile of
all the rows here, one row there).
"""

from __future__ import annotations

import torch

from safeserve.kernels import norm_rope as nr
from safeserve.kernels.common import (
    HAS_TRITON,
    batch_invariant,
    pdl_supported,
    tl,
    triton,
    use_kernels,
    zeroed_counters,
)
from safeserve.kernels.linear import (
    _BLOCK_M,
    _TILE_BYTES,
    SKINNY_MAX_ROWS,
    _sm_count,
    linear,
    skinny_plan,
)


def qkv_norm_rope_store(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    num_heads: int,
    num_kv_heads: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """`norm_rope.qk_norm_rope_store(linear(x, w, bias), ...)`: q [T, Hq, D]; k and v written to
    the caches at `slot_mapping` (-1 = skip). Up to `SKINNY_MAX_ROWS` rows on the kernel path,
    with a power-of-two head_dim of at least 16, it is one launch (the module docstring); any
    other call runs the two steps."""
    d = q_weight.shape[0]
    m, k = x.shape if x.dim() == 2 else (0, 0)
    if (
        not use_kernels(x)
        or batch_invariant()  # the two steps, as every batch size takes them
        or x.dim() != 2
        or not 0 < m <= SKINNY_MAX_ROWS
        or w.stride(1) != 1
        or w.shape != (d * (num_heads + 2 * num_kv_heads), k)
        or d < 16
        or d & (d - 1)
    ):
        qkv = linear(x, w, bias)
        return nr.qk_norm_rope_store(
            qkv, q_weight, k_weight, cos, sin, eps, num_heads, num_kv_heads, k_cache, v_cache,
            slot_mapping,
        )  # fmt: skip
    x = x if x.stride(1) == 1 else x.contiguous()
    cos = cos if cos.stride(1) == 1 else cos.contiguous()
    sin = sin if sin.stride(1) == 1 else sin.contiguous()
    n = w.shape[0]
    elt = min(x.element_size(), w.element_size())
    block_k = skinny_plan(n, k, _sm_count(x.device), elt)[1]
    block_k = max(16, min(block_k, _TILE_BYTES // (d * elt)))  # one head-wide tile per program
    split = triton.cdiv(k, block_k)
    heads = num_heads + 2 * num_kv_heads
    q = torch.empty(m, num_heads, d, dtype=x.dtype, device=x.device)
    part = torch.empty(m, split, n, dtype=torch.float32, device=x.device)
    sync = zeroed_counters(x.device, heads, "skinny_linear")
    pdl = pdl_supported(x.device)
    _skinny_qkv_kernel[(heads * split,)](
        x,
        w,
        bias if bias is not None else q,
        part,
        sync,
        q_weight,
        k_weight,
        cos,
        sin,
        q,
        k_cache,
        v_cache,
        slot_mapping,
        m,
        n,
        k,
        block_k,
        x.stride(0),
        w.stride(0),
        num_heads,
        num_kv_heads,
        cos.stride(0),
        sin.stride(0),
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        eps,
        HAS_BIAS=bias is not None,
        BLOCK_M=_BLOCK_M,
        HALF=d // 2,
        BLOCK_K=block_k,
        SPLIT_K=split,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        USE_PDL=pdl,
        num_warps=4,
        num_stages=4,
        launch_pdl=pdl,
    )
    return q


if HAS_TRITON:
    from safeserve.kernels.linear import _arrive, _skinny_partial
    from safeserve.kernels.norm_rope import _qk_norm_rope_store_head

    @triton.jit(do_not_specialize=["m"])
    def _skinny_qkv_kernel(
        x_ptr,
        w_ptr,
        b_ptr,
        part_ptr,
        sync_ptr,
        qw_ptr,
        kw_ptr,
        cos_ptr,
        sin_ptr,
        q_ptr,
        kc_ptr,
        vc_ptr,
        slot_ptr,
        m,
        N,
        K,
        k_per,
        stride_xm,
        stride_wn,
        num_heads,
        num_kv_heads,
        stride_cos,
        stride_sin,
        stride_qt,
        stride_qh,
        stride_cs,
        stride_ch,
        eps,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        HALF: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SPLIT_K: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        """`_skinny_linear_kernel` with one head per column tile (BLOCK_N = head_dim = 2 HALF,
        one K tile per program): the last program of a head sums its partials (and bias) into
        the q|k|v values as the GEMM would store them, in two halves, and hands the head to
        `norm_rope._qk_norm_rope_store_head` instead of storing it."""
        pid = tl.program_id(0)
        head = pid // SPLIT_K
        kb = pid % SPLIT_K
        acc = _skinny_partial(
            x_ptr, w_ptr, m, N, K, k_per, stride_xm, stride_wn, head, kb,
            BLOCK_M, 2 * HALF, BLOCK_K, True, DOT_PRECISION, USE_PDL,
        )  # fmt: skip
        rows = tl.arange(0, BLOCK_M)
        row_ok = rows < m
        cols = head * 2 * HALF + tl.arange(0, 2 * HALF)
        p_rows = part_ptr + rows[:, None].to(tl.int64) * (SPLIT_K * N)
        if _arrive(acc, p_rows + cols[None, :], row_ok[:, None], kb, N, sync_ptr + head, SPLIT_K):
            half = tl.arange(0, HALF)
            c1 = head * 2 * HALF + half
            t1 = tl.zeros([BLOCK_M, HALF], dtype=tl.float32)
            t2 = tl.zeros([BLOCK_M, HALF], dtype=tl.float32)
            for j in tl.static_range(SPLIT_K):  # fixed order: deterministic
                p = p_rows + j * N + c1[None, :]
                t1 += tl.load(p, mask=row_ok[:, None], other=0.0, cache_modifier=".cg")
                t2 += tl.load(p + HALF, mask=row_ok[:, None], other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                t1 += tl.load(b_ptr + c1).to(tl.float32)[None, :]
                t2 += tl.load(b_ptr + HALF + c1).to(tl.float32)[None, :]
            dtype = q_ptr.dtype.element_ty
            _qk_norm_rope_store_head(
                t1.to(dtype), t2.to(dtype), rows.to(tl.int64), row_ok, head, half, half < HALF,
                qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_ptr, kc_ptr, vc_ptr, slot_ptr, num_heads,
                num_kv_heads, 2 * HALF, HALF, stride_cos, stride_sin, stride_qt, stride_qh,
                stride_cs, stride_ch, eps,
            )  # fmt: skip
            tl.atomic_xchg(sync_ptr + head, 0)


else:  # pragma: no cover - exercised where Triton is missing
    _skinny_qkv_kernel = None
