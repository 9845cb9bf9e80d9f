"""The element-wise work of a multi-head latent attention layer around its GEMMs (Triton), with
torch references.

Per token the paged cache keeps one vector `[latent ‖ k_pe]`: the RMS-normed compressed KV and
the rotated decoupled key. The query the latent-space attention reads is `[q_latent ‖ q_pe]`:
the absorbed nope query (`q_nope @ W_UK`, a batched GEMM) and the rotated rope query. Unfused,
building them is about 25 small launches per layer on CUDA (the norm's float32 casts, the RoPE
slices, products and `cat`s, the slot arithmetic of a store without a host sync), which at a
decode batch of one cost more than the layer's GEMMs. Two kernels replace them:

* `store_latent_entry(kv, ...)`: one program per token (per 8 tokens in prefill-sized steps):
  the latent normed, the rope key rotated, both written to the cache at the token's slot
  (slot -1: nothing written, the padding rows of a CUDA-graph batch).
* `latent_query(q_latent, q_pe, ...)`: one program per (token, block of heads): the absorbed
  query copied and the rope query rotated into one contiguous `[T, heads, lat + rope]`.

RoPE comes in two layouts: DeepSeek-V3's interleaved pairs `(x0, x1), (x2, x3), ...` (the output
de-interleaved: rotated evens, then rotated odds, as transformers' `apply_rotary_pos_emb_interleave`
returns it) or rotate-half. The kernels round where the torch references round (the norm's
output, every RoPE product and sum in the hidden dtype), so bf16 matches them to its rounding and
float32 to float32 accuracy. The references are the CPU path and the GPU tests' oracles.
"""

from __future__ import annotations

import torch

from safeserve.kernels.common import (
    HAS_TRITON,
    next_power_of_2,
    pdl_supported,
    pdl_wait,
    tl,
    triton,
    use_kernels,
)
from safeserve.kernels.norm_rope import apply_rope, rms_norm_torch

# Tokens per program of `store_latent_entry` from this many tokens on (else one).
LATENT_BLOCK_TOKENS = 8
LATENT_BLOCK_MIN_TOKENS = 128
# Heads per program of `latent_query` (at most).
QUERY_BLOCK_HEADS = 16

# ---------------------------------------------------------------------------------------------
# Torch references.
# ---------------------------------------------------------------------------------------------


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] whose rotary pairs are interleaved (x0, x1), (x2, x3), ...; cos/sin
    [T, D] in the rotate-half layout (each frequency twice). The output is de-interleaved (the
    rotated evens, then the rotated odds), as transformers' `apply_rotary_pos_emb_interleave`
    returns it: queries and cached keys share the layout, so their products are the same."""
    half = cos.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """x [T, heads, D] rotated in the given layout."""
    return apply_rope_interleaved(x, cos, sin) if interleave else apply_rope(x, cos, sin)


def latent_entry_torch(
    kv: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleave: bool,
) -> torch.Tensor:
    """kv [T, lat + rope] (kv_a's output) -> the cache entries [T, lat + rope]."""
    lat = norm_weight.shape[0]
    latent = rms_norm_torch(kv[:, :lat], norm_weight, eps)[0]
    k_pe = rotate(kv[:, None, lat:], cos, sin, interleave)[:, 0]
    return torch.cat([latent, k_pe], dim=-1)


def latent_query_torch(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleave: bool,
) -> torch.Tensor:
    """q_latent [T, heads, lat], q_pe [T, heads, rope] -> [T, heads, lat + rope]."""
    return torch.cat([q_latent, rotate(q_pe, cos, sin, interleave)], dim=-1)


def store_rows(entry: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """entry [T, D] into cache [slots, 1, D] at `slots` [T] (-1: nowhere; int32 as the decode
    graphs' static inputs hold them, or int64). On CUDA without a host synchronisation."""
    if entry.shape[0] == 0:
        return
    slots = slots.long()  # index_copy_ takes int64 indices only
    entry = entry.to(cache.dtype)[:, None, :]
    if cache.is_cuda:
        store_rows_no_sync(entry, cache, slots)
        return
    rows = (slots >= 0).nonzero().squeeze(1)
    cache.index_copy_(0, slots[rows], entry[rows])


def store_rows_no_sync(entry: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
    """`store_rows` without a host synchronisation (any device): entry [T, 1, D], int64 slots.
    Rows with slot -1 write, to the largest slot of the step, the value its own row writes there
    (so duplicate writes agree); with no valid row at all, slot 0 gets its own content back."""
    valid = slots >= 0
    top, row = slots.max(0)
    target = torch.where(valid, slots, top.clamp(min=0))
    fill = torch.where(top >= 0, entry.index_select(0, row.view(1)), cache[0:1])
    cache.index_copy_(0, target, torch.where(valid[:, None, None], entry, fill))


# ---------------------------------------------------------------------------------------------
# Entry points.
# ---------------------------------------------------------------------------------------------


def store_latent_entry(
    kv: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleave: bool,
    cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """The cache entries of kv [T, lat + rope] (normed latent ‖ rotated rope key) written to
    cache [slots, 1, lat + rope] at `slots` [T] (-1: skipped; int32 or int64). cos/sin [T, rope]
    in the hidden dtype, rotate-half layout."""
    num_tokens, width = kv.shape
    if num_tokens == 0:
        return
    if not use_kernels(kv):
        store_rows(latent_entry_torch(kv, norm_weight, eps, cos, sin, interleave), cache, slots)
        return
    lat = norm_weight.shape[0]
    half = (width - lat) // 2
    if width - lat != 2 * half:
        raise ValueError(f"RoPE needs an even rope dimension, got {width - lat}")
    if kv.stride(1) != 1:
        kv = kv.contiguous()
    cos = cos if cos.stride(1) == 1 else cos.contiguous()
    sin = sin if sin.stride(1) == 1 else sin.contiguous()
    block_t = LATENT_BLOCK_TOKENS if num_tokens >= LATENT_BLOCK_MIN_TOKENS else 1
    lat_pad = next_power_of_2(lat)
    pdl = pdl_supported(kv.device)
    _latent_store_kernel[(triton.cdiv(num_tokens, block_t),)](
        kv,
        norm_weight,
        cos,
        sin,
        cache,
        slots,
        num_tokens,
        lat,
        half,
        kv.stride(0),
        cos.stride(0),
        sin.stride(0),
        cache.stride(0),
        eps,
        INTERLEAVE=interleave,
        LAT_PAD=lat_pad,
        HALF_PAD=next_power_of_2(half),
        BLOCK_T=block_t,
        USE_PDL=pdl,
        num_warps=max(1, min(8, block_t * lat_pad // 256)),
        launch_pdl=pdl,
    )


def latent_query(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleave: bool,
) -> torch.Tensor:
    """[q_latent ‖ rotated q_pe] [T, heads, lat + rope] from q_latent [T, heads, lat] and q_pe
    [T, heads, rope] (any strides with a unit last one, e.g. transposed GEMM outputs and views of
    the q projection)."""
    if not use_kernels(q_latent):
        return latent_query_torch(q_latent, q_pe, cos, sin, interleave)
    num_tokens, heads, lat = q_latent.shape
    rope = q_pe.shape[-1]
    if rope % 2:
        raise ValueError(f"RoPE needs an even rope dimension, got {rope}")
    out = torch.empty(num_tokens, heads, lat + rope, dtype=q_latent.dtype, device=q_latent.device)
    if num_tokens == 0:
        return out
    if q_latent.stride(2) != 1:
        q_latent = q_latent.contiguous()
    if q_pe.stride(2) != 1:
        q_pe = q_pe.contiguous()
    cos = cos if cos.stride(1) == 1 else cos.contiguous()
    sin = sin if sin.stride(1) == 1 else sin.contiguous()
    block_h = min(QUERY_BLOCK_HEADS, next_power_of_2(heads))
    lat_pad = next_power_of_2(lat)
    pdl = pdl_supported(q_latent.device)
    _latent_query_kernel[(num_tokens, triton.cdiv(heads, block_h))](
        q_latent,
        q_pe,
        cos,
        sin,
        out,
        heads,
        lat,
        rope // 2,
        q_latent.stride(0),
        q_latent.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        cos.stride(0),
        sin.stride(0),
        out.stride(0),
        out.stride(1),
        INTERLEAVE=interleave,
        LAT_PAD=lat_pad,
        HALF_PAD=next_power_of_2(rope // 2),
        BLOCK_H=block_h,
        USE_PDL=pdl,
        num_warps=max(1, min(8, block_h * lat_pad // 1024)),
        launch_pdl=pdl,
    )
    return out


# ---------------------------------------------------------------------------------------------
# Triton kernels.
# ---------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _rope_pair(x1, x2, c1, s1, c2, s2):
        """The two rotated halves of a rope vector given as its two parts x1, x2 (the evens and
        the odds, or the first and second half), each product and sum rounded to x1's dtype as
        the torch references round."""
        dtype = x1.dtype
        h1 = x1.to(tl.float32)
        h2 = x2.to(tl.float32)
        a1 = (h1 * c1).to(dtype).to(tl.float32)
        b1 = (-h2 * s1).to(dtype).to(tl.float32)
        a2 = (h2 * c2).to(dtype).to(tl.float32)
        b2 = (h1 * s2).to(dtype).to(tl.float32)
        return (a1 + b1).to(dtype), (a2 + b2).to(dtype)

    @triton.jit
    def _rope_parts(src, cols, m, half, INTERLEAVE: tl.constexpr):
        """The two parts of the rope vectors at `src` [R, 1] + columns: evens and odds
        (interleaved pairs) or first and second half."""
        if INTERLEAVE:
            x1 = tl.load(src + 2 * cols[None, :], mask=m, other=0.0)
            x2 = tl.load(src + 2 * cols[None, :] + 1, mask=m, other=0.0)
        else:
            x1 = tl.load(src + cols[None, :], mask=m, other=0.0)
            x2 = tl.load(src + half + cols[None, :], mask=m, other=0.0)
        return x1, x2

    @triton.jit
    def _cos_sin(cos_ptr, sin_ptr, t, stride_cos, stride_sin, cols, m, half,
                 INTERLEAVE: tl.constexpr):  # fmt: skip
        """cos/sin of tokens t [R] for the two parts: the interleaved layout uses the first half
        (each frequency once) for both, rotate-half its two halves."""
        c_rows = cos_ptr + t[:, None] * stride_cos + cols[None, :]
        s_rows = sin_ptr + t[:, None] * stride_sin + cols[None, :]
        c1 = tl.load(c_rows, mask=m, other=0.0).to(tl.float32)
        s1 = tl.load(s_rows, mask=m, other=0.0).to(tl.float32)
        if INTERLEAVE:
            c2 = c1
            s2 = s1
        else:
            c2 = tl.load(c_rows + half, mask=m, other=0.0).to(tl.float32)
            s2 = tl.load(s_rows + half, mask=m, other=0.0).to(tl.float32)
        return c1, s1, c2, s2

    @triton.jit(do_not_specialize=["num_tokens"])
    def _latent_store_kernel(
        kv_ptr,
        w_ptr,
        cos_ptr,
        sin_ptr,
        cache_ptr,
        slot_ptr,
        num_tokens,
        lat,
        half,
        stride_kv,
        stride_cos,
        stride_sin,
        stride_cs,
        eps,
        INTERLEAVE: tl.constexpr,
        LAT_PAD: tl.constexpr,
        HALF_PAD: tl.constexpr,
        BLOCK_T: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        t_ok = t < num_tokens
        cols = tl.arange(0, LAT_PAD)
        ok = cols < lat
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)  # a weight: before the wait
        pdl_wait(USE_PDL)
        slot = tl.load(slot_ptr + t, mask=t_ok, other=-1).to(tl.int64)
        write = t_ok & (slot >= 0)
        rows = kv_ptr + t[:, None] * stride_kv
        m = t_ok[:, None] & ok[None, :]
        x = tl.load(rows + cols[None, :], mask=m, other=0.0)
        dtype = x.dtype
        h = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=1) / lat + eps)
        y = (h * rstd[:, None]).to(dtype).to(tl.float32) * w[None, :]
        dst = cache_ptr + slot[:, None] * stride_cs
        out_ty = cache_ptr.dtype.element_ty
        tl.store(dst + cols[None, :], y.to(dtype).to(out_ty), mask=write[:, None] & ok[None, :])
        rc = tl.arange(0, HALF_PAD)
        rm = t_ok[:, None] & (rc < half)[None, :]
        x1, x2 = _rope_parts(rows + lat, rc, rm, half, INTERLEAVE)
        c1, s1, c2, s2 = _cos_sin(cos_ptr, sin_ptr, t, stride_cos, stride_sin, rc, rm, half,
                                  INTERLEAVE)  # fmt: skip
        y1, y2 = _rope_pair(x1, x2, c1, s1, c2, s2)
        wm = write[:, None] & (rc < half)[None, :]
        tl.store(dst + lat + rc[None, :], y1.to(out_ty), mask=wm)
        tl.store(dst + lat + half + rc[None, :], y2.to(out_ty), mask=wm)

    @triton.jit
    def _latent_query_kernel(
        ql_ptr,
        qpe_ptr,
        cos_ptr,
        sin_ptr,
        out_ptr,
        heads,
        lat,
        half,
        stride_lt,
        stride_lh,
        stride_pt,
        stride_ph,
        stride_cos,
        stride_sin,
        stride_ot,
        stride_oh,
        INTERLEAVE: tl.constexpr,
        LAT_PAD: tl.constexpr,
        HALF_PAD: tl.constexpr,
        BLOCK_H: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        h_ok = h < heads
        cols = tl.arange(0, LAT_PAD)
        m = h_ok[:, None] & (cols < lat)[None, :]
        pdl_wait(USE_PDL)
        x = tl.load(ql_ptr + t * stride_lt + h[:, None] * stride_lh + cols[None, :], mask=m)
        dst = out_ptr + t * stride_ot + h[:, None] * stride_oh
        tl.store(dst + cols[None, :], x, mask=m)
        rc = tl.arange(0, HALF_PAD)
        rm = h_ok[:, None] & (rc < half)[None, :]
        x1, x2 = _rope_parts(qpe_ptr + t * stride_pt + h[:, None] * stride_ph, rc, rm, half,
                             INTERLEAVE)  # fmt: skip
        # one token: its cos/sin rows broadcast over the heads
        tt = t + tl.zeros([BLOCK_H], dtype=tl.int64)
        c1, s1, c2, s2 = _cos_sin(cos_ptr, sin_ptr, tt, stride_cos, stride_sin, rc, rm, half,
                                  INTERLEAVE)  # fmt: skip
        y1, y2 = _rope_pair(x1, x2, c1, s1, c2, s2)
        tl.store(dst + lat + rc[None, :], y1, mask=rm)
        tl.store(dst + lat + half + rc[None, :], y2, mask=rm)
