"""The Triton kernels of paged attention (`safeserve.kernels.paged_attention` launches them):
the KV-cache store, the decode kernel (one program per sequence, kv head and split of the
context; `_decode_tile` is one tile of its online softmax, shared with the prefill kernel of
`safeserve.kernels.paged_prefill`) and the merge of the splits. Defined only where Triton is
installed.
"""

from __future__ import annotations

from safeserve.kernels.common import HAS_TRITON, pdl_wait, tl, triton

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
