"""The Triton kernels of multi-head latent attention over the paged latent cache
(`safeserve.kernels.mla_attention` launches them): `_mla_tile` (one tile of context tokens of
an online softmax, shared by decode and prefill), the decode kernel and its combine of split
partials, and the prefill kernel. Defined only where Triton is installed.

Every token's cache entry is one vector `[latent (DV) ‖ rope key (DR)]`; a tile loads the latent
part once and uses it twice, as the key's first DV entries (scores) and as the value (output),
for all the query rows of the program (a block of heads, times query tokens in prefill).
"""

from __future__ import annotations

from safeserve.kernels.common import HAS_TRITON, pdl_wait, tl, triton

if HAS_TRITON:
    from safeserve.kernels.paged_attention_kernels import _softmax_step

    @triton.jit
    def _mla_tile(
        q_lat,
        q_rope,
        c_ptr,
        bt_ptr,
        b,
        start,
        hi,
        pos_q,
        m_i,
        l_i,
        acc,
        qk_scale,
        stride_cs,
        stride_bt,
        DV: tl.constexpr,
        DV_PAD: tl.constexpr,
        DR: tl.constexpr,
        DR_PAD: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PAGE: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        CAUSAL: tl.constexpr,
        FULL: tl.constexpr = False,
    ):
        """One tile of BLOCK_N context tokens of sequence b (positions start .. start+BLOCK_N-1,
        those from `hi` on masked), gathered through its block table: scores of every row
        against [latent ‖ rope], then the online softmax and p @ latent into acc.

        With CAUSAL (prefill) row r sees positions up to pos_q[r] only; position 0 is visible
        to every row, so no row's max stays -inf. Without it (decode) pos_q is not read. FULL:
        every position of the tile is below `hi` and visible to every row: nothing masked."""
        pos = start + tl.arange(0, BLOCK_N)
        ok = pos < hi
        if FULL:
            block = tl.load(bt_ptr + b * stride_bt + pos // PAGE).to(tl.int64)
        else:
            block = tl.load(bt_ptr + b * stride_bt + pos // PAGE, mask=ok, other=0).to(tl.int64)
        row = c_ptr + (block * PAGE + pos % PAGE) * stride_cs  # [BLOCK_N] entry starts
        dv = tl.arange(0, DV_PAD)
        if FULL and DV_PAD == DV:
            kv = tl.load(row[:, None] + dv[None, :])
        else:
            kv = tl.load(
                row[:, None] + dv[None, :], mask=ok[:, None] & (dv < DV)[None, :], other=0.0
            )
        qk = tl.dot(q_lat.to(kv.dtype), tl.trans(kv), input_precision=DOT_PRECISION)
        if DR > 0:
            dr = tl.arange(0, DR_PAD)
            kr = tl.load(
                row[:, None] + DV + dr[None, :], mask=ok[:, None] & (dr < DR)[None, :], other=0.0
            )
            qk += tl.dot(q_rope.to(kr.dtype), tl.trans(kr), input_precision=DOT_PRECISION)
        qk = qk * qk_scale
        return _softmax_step(qk, kv, ok, pos, pos_q, m_i, l_i, acc, DOT_PRECISION, CAUSAL, FULL)

    @triton.jit
    def _load_query(
        base,
        row_ok,
        DV: tl.constexpr,
        DV_PAD: tl.constexpr,
        DR: tl.constexpr,
        DR_PAD: tl.constexpr,
    ):
        """The latent part [R, DV_PAD] and rope part [R, DR_PAD] of the query rows that start
        at `base` [R] (zeros past the dims and for rows not ok)."""
        dv = tl.arange(0, DV_PAD)
        q_lat = tl.load(
            base[:, None] + dv[None, :], mask=row_ok[:, None] & (dv < DV)[None, :], other=0.0
        )
        dr = tl.arange(0, DR_PAD)
        q_rope = tl.load(
            base[:, None] + DV + dr[None, :], mask=row_ok[:, None] & (dr < DR)[None, :], other=0.0
        )
        return q_lat, q_rope

    # Values that change from step to step are not specialized (Triton would compile a variant
    # per divisibility by 16, or for 1), so a step of a new shape never waits for a compile:
    # the block tables' width (stride_bt) follows the step's longest context.
    @triton.jit(do_not_specialize=["scale", "stride_bt", "num_splits"])
    def _mla_decode_kernel(
        q_ptr,
        c_ptr,
        bt_ptr,
        ctx_ptr,
        out_ptr,
        acc_ptr,
        stats_ptr,
        scale,
        num_heads,
        stride_qb,
        stride_qh,
        stride_cs,
        stride_bt,
        stride_ob,
        stride_oh,
        num_splits,
        DV: tl.constexpr,
        DV_PAD: tl.constexpr,
        DR: tl.constexpr,
        DR_PAD: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_N: tl.constexpr,
        MIN_SPLIT: tl.constexpr,
        PAGE: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        WHILE_LOOP: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        """Program (head block hb, split s, sequence b) attends split s of sequence b's
        context for heads hb*BLOCK_H .. +BLOCK_H-1, each latent tile loaded once for all of
        them (`_mla_tile`). A context of ctx tokens is cut into splits of cdiv(ctx,
        num_splits) tokens rounded up to BLOCK_N, and at least MIN_SPLIT (a split's float32
        partial, BLOCK_H x DV_PAD, would otherwise cost about as much as the tokens it
        covers). Where the context is one split, that program writes the output; where it
        spans `used` > 1 splits, each stores its partial (acc [B, H, num_splits, DV_PAD],
        stats [B, H, num_splits, 2] = running max (log2 units), sum) and
        `_mla_combine_kernel`, the next launch, merges them. Programs whose split starts past
        the context return at once. Context 0: zeros."""
        hb = tl.program_id(0)
        s = tl.program_id(1)
        b = tl.program_id(2)
        # context_lens is step metadata copied from the host before the step's kernels (no kernel
        # writes it): read before the dependent-launch wait, so a program past its context exits
        # at once instead of holding a slot through the wait
        ctx = tl.load(ctx_ptr + b)
        split_len = tl.maximum(tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N, MIN_SPLIT)
        lo = s * split_len
        hi = tl.minimum(lo + split_len, ctx)
        if lo >= hi and s > 0:
            return
        pdl_wait(USE_PDL)
        heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        h_ok = heads < num_heads
        dv = tl.arange(0, DV_PAD)
        o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + dv[None, :]
        o_mask = h_ok[:, None] & (dv < DV)[None, :]
        if lo >= hi:  # context 0 (split 0): zeros, so padding rows of a graph batch stay finite
            zero = tl.zeros([BLOCK_H, DV_PAD], dtype=tl.float32)
            tl.store(o_ptrs, zero.to(out_ptr.dtype.element_ty), mask=o_mask)
            return
        q_lat, q_rope = _load_query(
            q_ptr + b * stride_qb + heads * stride_qh, h_ok, DV, DV_PAD, DR, DR_PAD
        )
        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, DV_PAD], dtype=tl.float32)
        qk_scale = scale * 1.4426950408889634  # exp2 instead of exp
        if WHILE_LOOP:  # Triton's interpreter cannot take loaded values as range() bounds
            start = lo
            while start < hi:
                m_i, l_i, acc = _mla_tile(
                    q_lat, q_rope, c_ptr, bt_ptr, b, start, hi, hi, m_i, l_i, acc, qk_scale,
                    stride_cs, stride_bt, DV, DV_PAD, DR, DR_PAD, BLOCK_N, PAGE, DOT_PRECISION,
                    False,
                )  # fmt: skip
                start += BLOCK_N
        else:
            for start in range(lo, hi, BLOCK_N):
                m_i, l_i, acc = _mla_tile(
                    q_lat, q_rope, c_ptr, bt_ptr, b, start, hi, hi, m_i, l_i, acc, qk_scale,
                    stride_cs, stride_bt, DV, DV_PAD, DR, DR_PAD, BLOCK_N, PAGE, DOT_PRECISION,
                    False,
                )  # fmt: skip
        if ctx <= split_len:  # the context is this one split: the result itself, no combine
            o = acc / l_i[:, None]
            tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=o_mask)
        else:
            part = (b * num_heads + heads) * num_splits + s  # [BLOCK_H] partial rows
            tl.store(acc_ptr + part[:, None] * DV_PAD + dv[None, :], acc, mask=h_ok[:, None])
            tl.store(stats_ptr + part * 2, m_i, mask=h_ok)
            tl.store(stats_ptr + part * 2 + 1, l_i, mask=h_ok)

    @triton.jit(do_not_specialize=["num_splits"])
    def _mla_combine_kernel(
        ctx_ptr,
        out_ptr,
        acc_ptr,
        stats_ptr,
        num_heads,
        stride_ob,
        stride_oh,
        num_splits,
        DV: tl.constexpr,
        DV_PAD: tl.constexpr,
        BLOCK_N: tl.constexpr,
        MIN_SPLIT: tl.constexpr,
        S_CHUNK: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        """Program (head h, sequence b) merges the `used` split partials of (b, h) that
        `_mla_decode_kernel` stored, S_CHUNK splits a pass, in a fixed order (the same answer
        every call), rescaling its running sum whenever a pass raises the running max; then
        divides by the total sum. Sequences of one split (written by the decode kernel) are
        left alone. Every program waits on the decode launch first, so this launch completes
        only after it (the chain of dependent launches stays ordered)."""
        h = tl.program_id(0)
        b = tl.program_id(1)
        pdl_wait(USE_PDL)
        ctx = tl.load(ctx_ptr + b)
        split_len = tl.maximum(tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N, MIN_SPLIT)
        if ctx <= split_len:
            return
        used = tl.cdiv(ctx, split_len)
        base = (b * num_heads + h) * num_splits
        dv = tl.arange(0, DV_PAD)
        m_run = tl.full([], float("-inf"), dtype=tl.float32)
        l_run = tl.zeros([], dtype=tl.float32)
        o = tl.zeros([DV_PAD], dtype=tl.float32)
        s0 = 0
        while s0 < used:  # while, not range(): the interpreter cannot take a loaded bound
            sp = s0 + tl.arange(0, S_CHUNK)
            ok = sp < used
            m_s = tl.load(stats_ptr + (base + sp) * 2, mask=ok, other=float("-inf"))
            l_s = tl.load(stats_ptr + (base + sp) * 2 + 1, mask=ok, other=0.0)
            a = tl.load(
                acc_ptr + (base + sp)[:, None] * DV_PAD + dv[None, :], mask=ok[:, None], other=0.0
            )
            m_new = tl.maximum(m_run, tl.max(m_s, axis=0))  # finite: split s0 holds tokens
            alpha = tl.exp2(m_run - m_new)  # 0 on the first pass (m_run = -inf)
            w = tl.where(ok, tl.exp2(m_s - m_new), 0.0)
            l_run = l_run * alpha + tl.sum(w * l_s, axis=0)
            o = o * alpha + tl.sum(a * w[:, None], axis=0)
            m_run = m_new
            s0 += S_CHUNK
        o = o / l_run
        tl.store(
            out_ptr + b * stride_ob + h * stride_oh + dv,
            o.to(out_ptr.dtype.element_ty),
            mask=dv < DV,
        )

    @triton.jit(do_not_specialize=["scale", "stride_bt", "tiles"])
    def _mla_prefill_kernel(
        q_ptr,
        c_ptr,
        bt_ptr,
        info_ptr,
        out_ptr,
        scale,
        tiles,
        num_heads,
        stride_qt,
        stride_qh,
        stride_cs,
        stride_bt,
        stride_ot,
        stride_oh,
        DV: tl.constexpr,
        DV_PAD: tl.constexpr,
        DR: tl.constexpr,
        DR_PAD: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PAGE: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        WHILE_LOOP: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        """Program (sequence x tile of BLOCK_M query tokens, head block) holds the tile's tokens
        times BLOCK_H heads as one row tile (every latent tile loaded once for all of them), with
        an online softmax over the context up to the tile's last position: unmasked where every
        row sees a context tile whole, causally masked on the chunk's diagonal (query i of a
        chunk of q_len over a context of ctx sits at position ctx - q_len + i). A sequence's
        tiles with the longest contexts start first; tiles past a shorter chunk exit at once."""
        pdl_wait(USE_PDL)
        seq = tl.program_id(0) // tiles
        t0 = (tiles - 1 - tl.program_id(0) % tiles) * BLOCK_M
        hb = tl.program_id(1)
        ctx = tl.load(info_ptr + seq * 3)
        q_start = tl.load(info_ptr + seq * 3 + 1)
        q_len = tl.load(info_ptr + seq * 3 + 2)
        if t0 >= q_len:
            return
        r = tl.arange(0, BLOCK_M * BLOCK_H)
        tok = t0 + r // BLOCK_H  # query token of each row, within the chunk
        heads = hb * BLOCK_H + r % BLOCK_H
        row_ok = (tok < q_len) & (heads < num_heads)
        pos_q = ctx - q_len + tok  # its position: it sees positions 0 .. pos_q
        rows = (q_start + tok).to(tl.int64)
        q_lat, q_rope = _load_query(
            q_ptr + rows * stride_qt + heads * stride_qh, row_ok, DV, DV_PAD, DR, DR_PAD
        )
        m_i = tl.full([BLOCK_M * BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M * BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M * BLOCK_H, DV_PAD], dtype=tl.float32)
        qk_scale = scale * 1.4426950408889634
        hi = tl.minimum(ctx, ctx - q_len + t0 + BLOCK_M)  # the tile's last row sees up to hi-1
        # context tiles before `full` are visible to every row (the tile's first token sees
        # positions 0 .. ctx - q_len + t0): no mask; the rest are masked causally
        full = (ctx - q_len + t0 + 1) // BLOCK_N * BLOCK_N
        if WHILE_LOOP:  # Triton's interpreter cannot take loaded values as range() bounds
            start = hi * 0
            while start < full:
                m_i, l_i, acc = _mla_tile(
                    q_lat, q_rope, c_ptr, bt_ptr, seq, start, hi, pos_q, m_i, l_i, acc,
                    qk_scale, stride_cs, stride_bt, DV, DV_PAD, DR, DR_PAD, BLOCK_N, PAGE,
                    DOT_PRECISION, True, True,
                )  # fmt: skip
                start += BLOCK_N
            while start < hi:
                m_i, l_i, acc = _mla_tile(
                    q_lat, q_rope, c_ptr, bt_ptr, seq, start, hi, pos_q, m_i, l_i, acc,
                    qk_scale, stride_cs, stride_bt, DV, DV_PAD, DR, DR_PAD, BLOCK_N, PAGE,
                    DOT_PRECISION, True,
                )  # fmt: skip
                start += BLOCK_N
        else:
            for start in range(0, full, BLOCK_N):
                m_i, l_i, acc = _mla_tile(
                    q_lat, q_rope, c_ptr, bt_ptr, seq, start, hi, pos_q, m_i, l_i, acc,
                    qk_scale, stride_cs, stride_bt, DV, DV_PAD, DR, DR_PAD, BLOCK_N, PAGE,
                    DOT_PRECISION, True, True,
                )  # fmt: skip
            for start in range(full, hi, BLOCK_N):
                m_i, l_i, acc = _mla_tile(
                    q_lat, q_rope, c_ptr, bt_ptr, seq, start, hi, pos_q, m_i, l_i, acc,
                    qk_scale, stride_cs, stride_bt, DV, DV_PAD, DR, DR_PAD, BLOCK_N, PAGE,
                    DOT_PRECISION, True,
                )  # fmt: skip
        o = acc / l_i[:, None]
        dv = tl.arange(0, DV_PAD)
        tl.store(
            out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + dv[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & (dv < DV)[None, :],
        )
