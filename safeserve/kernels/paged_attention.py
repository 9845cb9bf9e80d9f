"""Paged-attention decode and KV-cache store (Triton), with torch reference paths.

The cache of one layer is `[num_blocks * block_size, kv_heads, head_dim]`; token `p` of a
sequence lives in slot `block_tables[b, p // block_size] * block_size + p % block_size`.

* `store_kv` writes this step's keys/values into their slots in one launch; a slot of -1 is
  skipped (the padding rows of a CUDA-graph batch write nowhere).
* `paged_decode` attends one query token per sequence over its whole context, read straight
  through the block table (flash-decoding): programs are (sequence, kv head, split of the
  context); each holds all query heads of its kv head as one row tile (GQA) and keeps an online
  softmax; a second kernel merges the splits. A sequence with context 0 gets zeros. Every grid
  and buffer depends on shapes only, so a decode step can be captured in a CUDA graph.

The torch references (`store_kv_torch`, `paged_decode_torch`) are the oracles of the GPU tests;
CPU runs never reach the kernels (unless TRITON_INTERPRET=1).
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

# Tokens one program loads per iteration, and the programs a decode launch aims for (about four
# per multiprocessor on an H100/H200), which sets how finely a short batch splits its contexts.
_BLOCK_N = 64
_TARGET_PROGRAMS = 512
# Splits the merge kernel reads per pass (a loop takes more). Fixed, as one split or many is a
# runtime branch of the decode kernel (num_splits is not specialized): eager decode steps of any
# batch and context, and every graph bucket, use one compiled variant of each kernel, so a step
# of a new shape never stops to compile one.
_MERGE_BLOCK = 64


# ---------------------------------------------------------------------------------------------
# Torch references.
# ---------------------------------------------------------------------------------------------


def store_kv_torch(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    ok = slot_mapping >= 0
    slots = slot_mapping[ok]
    k_cache[slots] = k[ok].to(k_cache.dtype)
    v_cache[slots] = v[ok].to(v_cache.dtype)


def paged_decode_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """q [B, Hq, D]; one query per sequence at its last position. Returns [B, Hq, D]."""
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(q)
    for b, ctx in enumerate(context_lens.tolist()):
        if ctx <= 0:
            continue
        n_blocks = (ctx + block_size - 1) // block_size
        blocks = block_tables[b, :n_blocks].to(torch.int64)
        pos = torch.arange(block_size, device=q.device)
        slots = (blocks[:, None] * block_size + pos[None, :]).reshape(-1)[:ctx]
        ks = k_cache[slots].float().repeat_interleave(group, dim=1)  # [ctx, Hq, D]
        vs = v_cache[slots].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,thd->ht", q[b].float(), ks) * scale
        probs = torch.softmax(scores, dim=-1)
        out[b] = torch.einsum("ht,thd->hd", probs, vs).to(q.dtype)
    return out


# ---------------------------------------------------------------------------------------------
# Entry points.
# ---------------------------------------------------------------------------------------------


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k/v [T, Hkv, D] into the caches at `slot_mapping` [T] (-1 = skip)."""
    if not use_kernels(k):
        store_kv_torch(k, v, k_cache, v_cache, slot_mapping)
        return
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k = k if k.stride(2) == 1 else k.contiguous()
    v = v if v.stride(2) == 1 else v.contiguous()
    width = num_kv_heads * head_dim
    block = min(1024, next_power_of_2(width))
    pdl = pdl_supported(k.device)
    _store_kv_kernel[(num_tokens, triton.cdiv(width, block))](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        head_dim,
        width,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        BLOCK=block,
        USE_PDL=pdl,
        launch_pdl=pdl,
    )


def decode_splits(batch: int, num_kv_heads: int, max_context: int) -> int:
    """Splits of each context: enough programs to fill the GPU, at least `_BLOCK_N` tokens each."""
    most = max(1, triton.cdiv(max_context, _BLOCK_N) if HAS_TRITON else 1)
    want = max(1, -(-_TARGET_PROGRAMS // max(1, batch * num_kv_heads)))
    return min(most, want)


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention over the paged cache: q [B, Hq, D] -> [B, Hq, D].

    block_tables [B, W] int32 (W * block_size bounds every context); context_lens [B] int32,
    the tokens in the cache including this step's. No host synchronisation.
    """
    if not use_kernels(q):
        return paged_decode_torch(
            q, k_cache, v_cache, block_tables, context_lens, block_size, scale
        )
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    q = q if q.stride(2) == 1 else q.contiguous()
    max_context = block_tables.shape[1] * block_size
    splits = decode_splits(batch, num_kv_heads, max_context)
    split_len = triton.cdiv(triton.cdiv(max_context, splits), _BLOCK_N) * _BLOCK_N
    splits = triton.cdiv(max_context, split_len)
    d_pad = next_power_of_2(head_dim)
    g_pad = max(16, next_power_of_2(group))
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    pdl = pdl_supported(q.device)
    common = dict(
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        GROUP=group,
        G_PAD=g_pad,
        BLOCK_N=_BLOCK_N,
        PAGE=block_size,
        DOT_PRECISION=precision,
        WHILE_LOOP=not q.is_cuda,
        USE_PDL=pdl,
        num_warps=4,
        num_stages=2,
        launch_pdl=pdl,
    )
    if splits == 1:
        _decode_kernel[(batch, num_kv_heads, 1)](
            q,
            k_cache,
            v_cache,
            block_tables,
            context_lens,
            out,
            out,
            out,
            scale,
            split_len,
            q.stride(0),
            q.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            block_tables.stride(0),
            out.stride(0),
            out.stride(1),
            1,
            **common,
        )
        return out
    acc = torch.empty(batch, num_heads, splits, d_pad, dtype=torch.float32, device=q.device)
    stats = torch.empty(batch, num_heads, splits, 2, dtype=torch.float32, device=q.device)
    _decode_kernel[(batch, num_kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        acc,
        stats,
        scale,
        split_len,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        splits,
        **common,
    )
    _merge_kernel[(batch, num_heads)](
        acc,
        stats,
        context_lens,
        out,
        split_len,
        splits,
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        S_BLOCK=_MERGE_BLOCK,
        USE_PDL=pdl,
        num_warps=4,
        launch_pdl=pdl,
    )
    return out


# ---------------------------------------------------------------------------------------------
# Triton kernels.
# ---------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _store_kv_kernel(
        k_ptr,
        v_ptr,
        kc_ptr,
        vc_ptr,
        slot_ptr,
        head_dim,
        width,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_cs,
        stride_ch,
        BLOCK: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        pdl_wait(USE_PDL)
        t = tl.program_id(0)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot < 0:
            return
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < width
        h = offs // head_dim
        d = offs % head_dim
        kv = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=ok)
        vv = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=ok)
        dst = slot * stride_cs + h * stride_ch + d
        tl.store(kc_ptr + dst, kv.to(kc_ptr.dtype.element_ty), mask=ok)
        tl.store(vc_ptr + dst, vv.to(vc_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _decode_tile(
        q,
        kc_ptr,
        vc_ptr,
        bt_ptr,
        b,
        kvh,
        start,
        hi,
        pos_q,
        m_i,
        l_i,
        acc,
        qk_scale,
        stride_cs,
        stride_ch,
        stride_bt,
        D_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PAGE: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        CAUSAL: tl.constexpr,
    ):
        """One tile of BLOCK_N context tokens, gathered through the block table: online softmax.

        With CAUSAL (prefill, `safeserve.kernels.paged_prefill`) row r sees positions up to
        pos_q[r] only; position 0 is visible to every row, so no row's max stays -inf. Without
        it (decode) pos_q is not read."""
        d = tl.arange(0, D_PAD)
        pos = start + tl.arange(0, BLOCK_N)
        ok = pos < hi
        block = tl.load(bt_ptr + b * stride_bt + pos // PAGE, mask=ok, other=0).to(tl.int64)
        slot = block * PAGE + pos % PAGE
        kv_off = slot[:, None] * stride_cs + kvh * stride_ch + d[None, :]
        kv_mask = ok[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(kc_ptr + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(vc_ptr + kv_off, mask=kv_mask, other=0.0)
        qk = tl.dot(q.to(k.dtype), tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if CAUSAL:
            qk = tl.where(ok[None, :] & (pos[None, :] <= pos_q[:, None]), qk, float("-inf"))
        else:
            qk = tl.where(ok[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        return m_new, l_i, acc

    # Values that change from step to step are not specialized (Triton would compile a variant
    # per divisibility by 16, or for 1), so a step of a new shape never waits for a compile:
    # the block tables' width (stride_bt) follows the step's longest context.
    @triton.jit(do_not_specialize=["scale", "split_len", "stride_bt", "num_splits"])
    def _decode_kernel(
        q_ptr,
        kc_ptr,
        vc_ptr,
        bt_ptr,
        ctx_ptr,
        out_ptr,
        acc_ptr,
        stats_ptr,
        scale,
        split_len,
        stride_qb,
        stride_qh,
        stride_cs,
        stride_ch,
        stride_bt,
        stride_ob,
        stride_oh,
        num_splits,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        GROUP: tl.constexpr,
        G_PAD: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PAGE: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        WHILE_LOOP: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        pdl_wait(USE_PDL)
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        s = tl.program_id(2)
        ctx = tl.load(ctx_ptr + b)
        lo = s * split_len
        hi = tl.minimum(lo + split_len, ctx)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D_PAD)
        g_ok = g < GROUP
        d_ok = d < HEAD_DIM
        heads = kvh * GROUP + g
        if lo >= hi:
            if num_splits == 1:  # context 0: zeros, so padding rows of a graph batch stay finite
                o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :]
                zero = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
                tl.store(o_ptrs, zero.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok)
            return
        q = tl.load(
            q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
            mask=g_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([G_PAD], dtype=tl.float32)
        acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
        qk_scale = scale * 1.4426950408889634  # exp2 instead of exp
        if WHILE_LOOP:  # Triton's interpreter cannot take loaded values as range() bounds
            start = lo
            while start < hi:
                m_i, l_i, acc = _decode_tile(
                    q,
                    kc_ptr,
                    vc_ptr,
                    bt_ptr,
                    b,
                    kvh,
                    start,
                    hi,
                    hi,
                    m_i,
                    l_i,
                    acc,
                    qk_scale,
                    stride_cs,
                    stride_ch,
                    stride_bt,
                    D_PAD,
                    HEAD_DIM,
                    BLOCK_N,
                    PAGE,
                    DOT_PRECISION,
                    False,
                )
                start += BLOCK_N
        else:
            for start in range(lo, hi, BLOCK_N):
                m_i, l_i, acc = _decode_tile(
                    q,
                    kc_ptr,
                    vc_ptr,
                    bt_ptr,
                    b,
                    kvh,
                    start,
                    hi,
                    hi,
                    m_i,
                    l_i,
                    acc,
                    qk_scale,
                    stride_cs,
                    stride_ch,
                    stride_bt,
                    D_PAD,
                    HEAD_DIM,
                    BLOCK_N,
                    PAGE,
                    DOT_PRECISION,
                    False,
                )
        if num_splits == 1:  # one split: the result itself, no merge
            o = acc / l_i[:, None]
            o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :]
            tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
        else:
            row = (b * GROUP * tl.num_programs(1) + heads) * num_splits + s
            tl.store(acc_ptr + row[:, None] * D_PAD + d[None, :], acc, mask=g_ok[:, None])
            tl.store(stats_ptr + row * 2, m_i, mask=g_ok)
            tl.store(stats_ptr + row * 2 + 1, l_i, mask=g_ok)

    @triton.jit(do_not_specialize=["split_len", "num_splits"])
    def _merge_kernel(
        acc_ptr,
        stats_ptr,
        ctx_ptr,
        out_ptr,
        split_len,
        num_splits,
        stride_ob,
        stride_oh,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        S_BLOCK: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        pdl_wait(USE_PDL)
        b = tl.program_id(0)
        h = tl.program_id(1)
        ctx = tl.load(ctx_ptr + b)
        used = tl.minimum((ctx + split_len - 1) // split_len, num_splits)
        d = tl.arange(0, D_PAD)
        base = (b * tl.num_programs(1) + h) * num_splits
        # while, not range(): the interpreter cannot take a loaded bound (splits are few anyway)
        m = tl.full([S_BLOCK], float("-inf"), dtype=tl.float32)
        s0 = 0
        while s0 < used:
            s = s0 + tl.arange(0, S_BLOCK)
            m_s = tl.load(stats_ptr + (base + s) * 2, mask=s < used, other=float("-inf"))
            m = tl.maximum(m, m_s)
            s0 += S_BLOCK
        m_max = tl.max(m, axis=0)
        l_tot = 0.0
        acc = tl.zeros([D_PAD], dtype=tl.float32)
        s0 = 0
        while s0 < used:
            s = s0 + tl.arange(0, S_BLOCK)
            s_ok = s < used
            m_s = tl.load(stats_ptr + (base + s) * 2, mask=s_ok, other=float("-inf"))
            l_s = tl.load(stats_ptr + (base + s) * 2 + 1, mask=s_ok, other=0.0)
            w = tl.where(s_ok, tl.exp2(m_s - m_max), 0.0)
            l_tot += tl.sum(w * l_s, axis=0)
            a = tl.load(
                acc_ptr + (base + s)[:, None] * D_PAD + d[None, :], mask=s_ok[:, None], other=0.0
            )
            acc += tl.sum(a * w[:, None], axis=0)
            s0 += S_BLOCK
        o = tl.where(used > 0, acc / tl.maximum(l_tot, 1e-30), 0.0)
        tl.store(
            out_ptr + b * stride_ob + h * stride_oh + d,
            o.to(out_ptr.dtype.element_ty),
            mask=d < HEAD_DIM,
        )
