"""RMSNorm (+ residual add) and q/k RMSNorm + RoPE + KV store (Triton), with torch references.

A decode step of a small batch is launch-bound: the unfused attention block runs ~40 tiny kernels
per layer (float32 casts, pow, mean, rsqrt, the `cat` of rotate-half, ...). These two kernels
replace them with two launches per layer:

* `rms_norm(x, weight, eps, residual)`: one program per row; with `residual` it first forms
  `x + residual` (rounded to the hidden dtype, as the unfused model adds) and returns it too, so
  the residual add of the previous block costs no launch of its own.
* `qk_norm_rope_store(qkv, ...)`: one program per (token, head) of the fused q|k|v projection
  output (per 16 tokens and head in prefill-sized steps): q heads are RMS-normed and rotated
  into a fresh q; k heads are normed, rotated and written straight into the paged cache at the
  token's slot; v heads are copied there (slot -1: nothing written, the padding rows of a
  CUDA-graph batch).

The kernels round where the unfused model rounds (the norm's output and every RoPE product and
sum in the hidden dtype), so bf16 results match the torch path to its rounding and float32 to
float32 accuracy. The torch references (`rms_norm_torch`, `qk_norm_rope_torch`) are the CPU path
of the model and the oracles of the GPU tests.
"""

from __future__ import annotations

import torch

from safeserve.kernels.common import (
    HAS_TRITON,
    batch_invariant,
    next_power_of_2,
    pdl_supported,
    pdl_wait,
    tl,
    triton,
    use_kernels,
)
from safeserve.kernels.kv_quant import to_cache

# Tokens per program of `qk_norm_rope_store` from this many tokens on (else one).
QK_BLOCK_TOKENS = 16
QK_BLOCK_MIN_TOKENS = 128

# ---------------------------------------------------------------------------------------------
# Torch references (the model's CPU path; transformers' numerics).
# ---------------------------------------------------------------------------------------------


def rms_norm_torch(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * normed(s), s) with s = x (+ residual), normalized in float32 over the last dim."""
    s = x if residual is None else x + residual
    dtype = s.dtype
    h = s.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype), s


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, D]."""
    return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]


def qk_norm_rope_torch(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    num_heads: int,
    num_kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [T, (Hq + 2 Hkv) D] -> q [T, Hq, D], k [T, Hkv, D] (normed, rotated), v [T, Hkv, D]."""
    t = qkv.shape[0]
    d = q_weight.shape[0]
    q, k, v = qkv.split([num_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
    q = rms_norm_torch(q.reshape(t, num_heads, d), q_weight, eps)[0]
    k = rms_norm_torch(k.reshape(t, num_kv_heads, d), k_weight, eps)[0]
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v.reshape(t, num_kv_heads, d)


# ---------------------------------------------------------------------------------------------
# Entry points.
# ---------------------------------------------------------------------------------------------


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] (and residual [T, H]): returns (normed, x + residual) (or (normed, x))."""
    if not use_kernels(x) or x.dim() != 2:
        return rms_norm_torch(x, weight, eps, residual)
    num_rows, hidden = x.shape
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty_like(x)
    if residual is None:
        summed, res = x, x
    else:
        res = residual if residual.stride(1) == 1 else residual.contiguous()
        summed = torch.empty_like(x)
    if num_rows == 0:
        return out, summed
    block = next_power_of_2(hidden)
    pdl = pdl_supported(x.device)
    _rms_norm_kernel[(num_rows,)](
        x,
        res,
        weight,
        out,
        summed,
        hidden,
        x.stride(0),
        res.stride(0),
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        USE_PDL=pdl,
        num_warps=max(1, min(8, block // 256)),
        launch_pdl=pdl,
    )
    return out, summed


def qk_norm_rope_store(
    qkv: torch.Tensor,
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
    """Normed, rotated q [T, Hq, D]; k (normed, rotated) and v written to the caches at
    `slot_mapping` [T] (-1 = skip). cos/sin [T, D] in the hidden dtype."""
    if not use_kernels(qkv):
        q, k, v = qk_norm_rope_torch(
            qkv, q_weight, k_weight, cos, sin, eps, num_heads, num_kv_heads
        )
        ok = slot_mapping >= 0
        slots = slot_mapping[ok]
        k_cache[slots] = to_cache(k[ok], k_cache.dtype)
        v_cache[slots] = to_cache(v[ok], v_cache.dtype)
        return q
    num_tokens = qkv.shape[0]
    head_dim = q_weight.shape[0]
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    q = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return q
    qkv = qkv if qkv.stride(1) == 1 else qkv.contiguous()
    cos = cos if cos.stride(1) == 1 else cos.contiguous()
    sin = sin if sin.stride(1) == 1 else sin.contiguous()
    half = head_dim // 2
    pdl = pdl_supported(qkv.device)
    # Prefill-sized steps: a program per (16 tokens, head), not per (token, head): 2,048 tokens
    # of 40 heads were 81,920 programs of 256 bytes each. Two variants only (both compiled by
    # the start-up captures), so no step of a new size waits for a compile.
    # (one variant in batch-invariant mode: a token's reductions then have one layout)
    block_t = QK_BLOCK_TOKENS if num_tokens >= QK_BLOCK_MIN_TOKENS and not batch_invariant() else 1
    _qk_norm_rope_store_kernel[(triton.cdiv(num_tokens, block_t), num_heads + 2 * num_kv_heads)](
        qkv,
        q_weight,
        k_weight,
        cos,
        sin,
        q,
        k_cache,
        v_cache,
        slot_mapping,
        num_heads,
        num_kv_heads,
        head_dim,
        half,
        qkv.stride(0),
        cos.stride(0),
        sin.stride(0),
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        eps,
        num_tokens,
        HALF_PAD=next_power_of_2(half),
        BLOCK_T=block_t,
        USE_PDL=pdl,
        num_warps=(1 if head_dim <= 128 else 2) * (4 if block_t > 1 else 1),
        launch_pdl=pdl,
    )
    return q


# ---------------------------------------------------------------------------------------------
# Triton kernels.
# ---------------------------------------------------------------------------------------------

if HAS_TRITON:
    from safeserve.kernels.kv_quant import store_value

    @triton.jit
    def _rms_norm_kernel(
        x_ptr,
        res_ptr,
        w_ptr,
        out_ptr,
        sum_ptr,
        hidden,
        stride_x,
        stride_r,
        eps,
        HAS_RESIDUAL: tl.constexpr,
        BLOCK: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < hidden
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)  # a weight: before the wait
        pdl_wait(USE_PDL)
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
        dtype = x.dtype
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)  # rounded as the model adds
            tl.store(sum_ptr + row * hidden + cols, x, mask=ok)
        h = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / hidden + eps)
        y = (h * rstd).to(dtype).to(tl.float32) * w
        tl.store(out_ptr + row * hidden + cols, y.to(dtype), mask=ok)

    @triton.jit
    def _qk_norm_rope_store_head(
        x1,
        x2,
        t,
        t_ok,
        head,
        cols,
        ok,
        qw_ptr,
        kw_ptr,
        cos_ptr,
        sin_ptr,
        q_ptr,
        kc_ptr,
        vc_ptr,
        slot_ptr,
        num_heads,
        num_kv_heads,
        head_dim,
        half,
        stride_cos,
        stride_sin,
        stride_qt,
        stride_qh,
        stride_cs,
        stride_ch,
        eps,
    ):
        """Head `head` of the q|k|v rows of tokens t [R] (t_ok: real rows), given as its two
        halves x1, x2 [R, HALF_PAD] (columns `cols`, valid where `ok`) in the hidden dtype: a q
        head is normed and rotated into q, a k head normed, rotated and written to the cache at
        the token's slot, a v head copied there (slot -1: nothing written). Every product and sum
        is rounded where the unfused model rounds."""
        dtype = x1.dtype
        m = t_ok[:, None] & ok[None, :]
        if head >= num_heads + num_kv_heads:  # v: a plain copy into the cache
            slot = tl.load(slot_ptr + t, mask=t_ok, other=-1).to(tl.int64)
            v_row = (
                vc_ptr + slot[:, None] * stride_cs + (head - num_heads - num_kv_heads) * stride_ch
            )
            v_ok = m & (slot >= 0)[:, None]
            tl.store(v_row + cols[None, :], store_value(x1, vc_ptr), mask=v_ok)
            tl.store(v_row + half + cols[None, :], store_value(x2, vc_ptr), mask=v_ok)
        else:
            is_q = head < num_heads
            if is_q:
                w1 = tl.load(qw_ptr + cols, mask=ok, other=0.0).to(tl.float32)
                w2 = tl.load(qw_ptr + half + cols, mask=ok, other=0.0).to(tl.float32)
            else:
                w1 = tl.load(kw_ptr + cols, mask=ok, other=0.0).to(tl.float32)
                w2 = tl.load(kw_ptr + half + cols, mask=ok, other=0.0).to(tl.float32)
            h1 = x1.to(tl.float32)
            h2 = x2.to(tl.float32)
            sq = tl.sum(h1 * h1, axis=1) + tl.sum(h2 * h2, axis=1)
            rstd = (1.0 / tl.sqrt(sq / head_dim + eps))[:, None]
            n1 = ((h1 * rstd).to(dtype).to(tl.float32) * w1[None, :]).to(dtype).to(tl.float32)
            n2 = ((h2 * rstd).to(dtype).to(tl.float32) * w2[None, :]).to(dtype).to(tl.float32)
            cos_rows = cos_ptr + t[:, None] * stride_cos + cols[None, :]
            sin_rows = sin_ptr + t[:, None] * stride_sin + cols[None, :]
            c1 = tl.load(cos_rows, mask=m, other=0.0).to(tl.float32)
            c2 = tl.load(cos_rows + half, mask=m, other=0.0).to(tl.float32)
            s1 = tl.load(sin_rows, mask=m, other=0.0).to(tl.float32)
            s2 = tl.load(sin_rows + half, mask=m, other=0.0).to(tl.float32)
            # x * cos + rotate_half(x) * sin, each product and the sum rounded like the model's.
            a1 = (n1 * c1).to(dtype).to(tl.float32)
            b1 = (-n2 * s1).to(dtype).to(tl.float32)
            a2 = (n2 * c2).to(dtype).to(tl.float32)
            b2 = (n1 * s2).to(dtype).to(tl.float32)
            y1 = (a1 + b1).to(dtype)
            y2 = (a2 + b2).to(dtype)
            if is_q:
                q_dst = q_ptr + t[:, None] * stride_qt + head * stride_qh + cols[None, :]
                tl.store(q_dst, y1, mask=m)
                tl.store(q_dst + half, y2, mask=m)
            else:
                k_slot = tl.load(slot_ptr + t, mask=t_ok, other=-1).to(tl.int64)
                k_row = kc_ptr + k_slot[:, None] * stride_cs + (head - num_heads) * stride_ch
                k_ok = m & (k_slot >= 0)[:, None]
                tl.store(k_row + cols[None, :], store_value(y1, kc_ptr), mask=k_ok)
                tl.store(k_row + half + cols[None, :], store_value(y2, kc_ptr), mask=k_ok)

    @triton.jit
    def _qk_norm_rope_store_kernel(
        qkv_ptr,
        qw_ptr,
        kw_ptr,
        cos_ptr,
        sin_ptr,
        q_ptr,
        kc_ptr,
        vc_ptr,
        slot_ptr,
        num_heads,
        num_kv_heads,
        head_dim,
        half,
        stride_t,
        stride_cos,
        stride_sin,
        stride_qt,
        stride_qh,
        stride_cs,
        stride_ch,
        eps,
        num_tokens,
        HALF_PAD: tl.constexpr,
        BLOCK_T: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # its tokens
        t_ok = t < num_tokens
        head = tl.program_id(1)
        cols = tl.arange(0, HALF_PAD)
        ok = cols < half
        pdl_wait(USE_PDL)
        src = qkv_ptr + t[:, None] * stride_t + head * head_dim + cols[None, :]
        x1 = tl.load(src, mask=t_ok[:, None] & ok[None, :], other=0.0)
        x2 = tl.load(src + half, mask=t_ok[:, None] & ok[None, :], other=0.0)
        _qk_norm_rope_store_head(
            x1, x2, t, t_ok, head, cols, ok, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_ptr, kc_ptr,
            vc_ptr, slot_ptr, num_heads, num_kv_heads, head_dim, half, stride_cos, stride_sin,
            stride_qt, stride_qh, stride_cs, stride_ch, eps,
        )  # fmt: skip
