"""The Triton kernels of paged attention (`safeserve.kernels.paged_attention` launches them):
the KV-cache store and the decode kernel (one program per sequence, kv head and split of the
context; `_decode_tile` is one tile of its online softmax, shared with the prefill kernel of
`safeserve.kernels.paged_prefill`; `_merge_splits` is the merge of split partials that the last
split of a kv head (or of a group of its splits) to finish runs). Defined only where Triton is installed.
"""

from __future__ import annotations

from safeserve.kernels.common import HAS_TRITON, pdl_wait, tl, triton

if HAS_TRITON:
    from safeserve.kernels.kv_quant import load_value, store_value

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
        tl.store(kc_ptr + dst, store_value(kv, kc_ptr), mask=ok)
        tl.store(vc_ptr + dst, store_value(vv, vc_ptr), mask=ok)

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
        FULL: tl.constexpr = False,
    ):
        """One tile of BLOCK_N context tokens, gathered through the block table: online softmax.

        With CAUSAL (prefill, `safeserve.kernels.paged_prefill`) row r sees positions up to
        pos_q[r] only; position 0 is visible to every row, so no row's max stays -inf. Without
        it (decode) pos_q is not read. FULL: the caller knows every position of the tile is
        below `hi` and visible to every row, so nothing is masked."""
        d = tl.arange(0, D_PAD)
        pos = start + tl.arange(0, BLOCK_N)
        ok = pos < hi
        if FULL:
            block = tl.load(bt_ptr + b * stride_bt + pos // PAGE).to(tl.int64)
        else:
            block = tl.load(bt_ptr + b * stride_bt + pos // PAGE, mask=ok, other=0).to(tl.int64)
        slot = block * PAGE + pos % PAGE
        kv_off = slot[:, None] * stride_cs + kvh * stride_ch + d[None, :]
        if FULL and D_PAD == HEAD_DIM:
            k = tl.load(kc_ptr + kv_off)
            v = tl.load(vc_ptr + kv_off)
        else:
            kv_mask = ok[:, None] & (d < HEAD_DIM)[None, :]
            k = tl.load(kc_ptr + kv_off, mask=kv_mask, other=0.0)
            v = tl.load(vc_ptr + kv_off, mask=kv_mask, other=0.0)
        k = load_value(k, q)  # an FP8 cache is read back in the query's dtype
        v = load_value(v, q)
        qk = tl.dot(q.to(k.dtype), tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        return _softmax_step(qk, v, ok, pos, pos_q, m_i, l_i, acc, DOT_PRECISION, CAUSAL, FULL)

    @triton.jit
    def _softmax_step(
        qk,
        v,
        ok,
        pos,
        pos_q,
        m_i,
        l_i,
        acc,
        DOT_PRECISION: tl.constexpr,
        CAUSAL: tl.constexpr,
        FULL: tl.constexpr,
    ):
        """The online-softmax update of one tile (paged GQA and MLA attention alike): scaled
        scores qk [R, N] (log2 units) of positions `pos` [N] (valid where `ok`), masked unless
        FULL (causally by pos_q [R] with CAUSAL), folded into the running max m_i, sum l_i and
        output acc [R, D] with values v [N, D]."""
        if not FULL:
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

    @triton.jit
    def _merge_splits(
        acc_ptr,
        stats_ptr,
        base,
        g_ok,
        count,
        STRIDE: tl.constexpr,
        D_PAD: tl.constexpr,
        S_CHUNK: tl.constexpr,
    ):
        """Merges `count` partials of a kv head's query heads, rows `base + j * STRIDE` (j <
        count) of acc / stats, S_CHUNK of every head per pass, in one pass over them: the
        running sum is rescaled whenever a chunk raises the running max (as flash attention
        does over tiles). Returns (max, sum, unnormalised output) as a partial of its own. The
        partials are taken in a fixed order, so the result does not depend on which program
        merges. Reads bypass L1 (.cg): other programs wrote them."""
        d = tl.arange(0, D_PAD)
        m_run = tl.where(g_ok, float("-inf"), 0.0)  # padding heads: 0, so never -inf - -inf
        l_run = tl.zeros_like(m_run)
        o = tl.zeros([m_run.shape[0], D_PAD], dtype=tl.float32)
        s0 = 0
        while s0 < count:  # while, not range(): the interpreter cannot take a loaded bound
            s = s0 + tl.arange(0, S_CHUNK)
            ok = g_ok[:, None] & (s < count)[None, :]
            rows = base[:, None] + s[None, :] * STRIDE
            m_s = tl.load(stats_ptr + rows * 2, mask=ok, other=float("-inf"), cache_modifier=".cg")
            l_s = tl.load(stats_ptr + rows * 2 + 1, mask=ok, other=0.0, cache_modifier=".cg")
            a = tl.load(
                acc_ptr + rows[:, :, None] * D_PAD + d[None, None, :],
                mask=ok[:, :, None],
                other=0.0,
                cache_modifier=".cg",
            )
            m_new = tl.where(g_ok, tl.maximum(m_run, tl.max(m_s, axis=1)), 0.0)
            alpha = tl.exp2(m_run - m_new)  # 0 on the first chunk (m_run = -inf)
            w = tl.where(ok, tl.exp2(m_s - m_new[:, None]), 0.0)
            l_run = l_run * alpha + tl.sum(w * l_s, axis=1)
            o = o * alpha[:, None] + tl.sum(a * w[:, :, None], axis=1)
            m_run = m_new
            s0 += S_CHUNK
        return m_run, l_run, o

    @triton.jit
    def _store_merged(o_ptrs, g_ok, o, l_run, D_PAD: tl.constexpr, HEAD_DIM: tl.constexpr):
        """The merged output, divided by its total softmax sum."""
        d = tl.arange(0, D_PAD)
        o = o / tl.maximum(l_run, 1e-30)[:, None]
        o_mask = g_ok[:, None] & (d < HEAD_DIM)[None, :]
        tl.store(o_ptrs, o.to(o_ptrs.dtype.element_ty), mask=o_mask)

    # Values that change from step to step are not specialized (Triton would compile a variant
    # per divisibility by 16, or for 1), so a step of a new shape never waits for a compile:
    # the block tables' width (stride_bt) follows the step's longest context.
    @triton.jit(do_not_specialize=["scale", "stride_bt", "num_splits"])
    def _decode_kernel(
        q_ptr,
        kc_ptr,
        vc_ptr,
        bt_ptr,
        ctx_ptr,
        out_ptr,
        acc_ptr,
        stats_ptr,
        sync_ptr,
        scale,
        stride_qb,
        stride_qh,
        stride_cs,
        stride_ch,
        stride_bt,
        stride_ob,
        stride_oh,
        num_splits,
        split_tokens,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        GROUP: tl.constexpr,
        G_PAD: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PAGE: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        M_PAD: tl.constexpr,
        S_CHUNK: tl.constexpr,
        WHILE_LOOP: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        """Program (b, kvh, s) attends split s of sequence b's context for kv head kvh's GROUP
        query heads; a context of ctx tokens is cut into splits of cdiv(ctx, num_splits) tokens
        rounded up to BLOCK_N, so a short context in a wide table still spreads over programs
        (or of `split_tokens` tokens where that is > 0).
        Where the context spans one split, that program writes the result. Where it spans
        `used` > 1, each of those programs stores its float32 partial (acc [B, Hq, num_splits,
        D_PAD], stats [B, Hq, num_splits, 2] = running max, sum) and bumps the (b, kvh) counter
        of `sync_ptr`; the last of the `used` to arrive merges them (`_merge_splits`) and resets
        the counter to 0. Past 2 * S_CHUNK splits (more than two merge passes) the merge has two
        levels: groups of S_CHUNK consecutive splits count on counters of their own (after the
        B x kv-heads top ones, cdiv(num_splits, S_CHUNK) per (b, kvh)), the last of a group
        merges it into its first row, and the last group merges the groups. A merge's serial
        chain is then at most two passes after the walk, not used / S_CHUNK (16 for one
        sequence of 8,192 tokens). Programs whose split starts past the context return at
        once: they never touch the counters."""
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        s = tl.program_id(2)
        # context_lens is step metadata copied from the host before the step's kernels (no kernel
        # writes it), so it is read before the dependent-launch wait: a program past its context
        # exits at once instead of holding a slot on the GPU through the wait
        ctx = tl.load(ctx_ptr + b)
        # this sequence's own split length: its context over the grid's splits, whole tiles (the
        # grid is sized for the table's width, which in a CUDA graph is --max-model-len); or
        # `split_tokens` (> 0, whole tiles) whatever the grid: a row's splits, so its sums and
        # their order, then follow its own context alone (batch-invariant)
        if split_tokens > 0:
            split_len = split_tokens
        else:
            split_len = tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N
        lo = s * split_len
        hi = tl.minimum(lo + split_len, ctx)
        if lo >= hi and s > 0:
            return
        pdl_wait(USE_PDL)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D_PAD)
        g_ok = g < GROUP
        d_ok = d < HEAD_DIM
        heads = kvh * GROUP + g
        o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :]
        if lo >= hi:  # context 0 (split 0): zeros, so padding rows of a graph batch stay finite
            zero = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
            tl.store(o_ptrs, zero.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok)
            return
        # the splits that hold tokens: every program of (b, kvh) computes the same count
        used = tl.cdiv(ctx, split_len)  # at most num_splits
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
        if used == 1:  # the context is this one split: the result itself, no merge
            o = acc / l_i[:, None]
            tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
        else:
            # partial rows: [B, Hq, num_splits]; this kv head's first query head, split 0
            head0 = (b * GROUP * tl.num_programs(1) + kvh * GROUP) * num_splits
            row = head0 + g * num_splits + s
            tl.store(acc_ptr + row[:, None] * D_PAD + d[None, :], acc, mask=g_ok[:, None])
            tl.store(stats_ptr + row * 2, m_i, mask=g_ok)
            tl.store(stats_ptr + row * 2 + 1, l_i, mask=g_ok)
            tl.debug_barrier()  # every thread's partial is issued before the release
            counter = sync_ptr + b * tl.num_programs(1) + kvh
            # the merge's own head padding (no tl.dot there): GROUP rounded up to a power of 2
            mg = tl.arange(0, M_PAD)
            mg_ok = mg < GROUP
            m_heads = kvh * GROUP + mg
            m_out = out_ptr + b * stride_ob + m_heads[:, None] * stride_oh + d[None, :]
            m_base = head0 + mg * num_splits
            if used <= 2 * S_CHUNK:  # one or two passes: the last to arrive merges them all
                if tl.atomic_add(counter, 1, sem="acq_rel") == used - 1:
                    tl.debug_barrier()
                    m_run, l_run, o = _merge_splits(
                        acc_ptr, stats_ptr, m_base, mg_ok, used, 1, D_PAD, S_CHUNK
                    )
                    _store_merged(m_out, mg_ok, o, l_run, D_PAD, HEAD_DIM)
                    tl.atomic_xchg(counter, 0)
            else:
                # Two levels, so no program merges more than two passes in a row: the last of
                # each group of S_CHUNK consecutive splits merges its group (one pass) into the
                # group's first row, then the last group to finish merges the groups.
                grp = s // S_CHUNK
                members = tl.minimum(S_CHUNK, used - grp * S_CHUNK)
                groups_max = tl.cdiv(num_splits, S_CHUNK)
                g_counter = (
                    sync_ptr
                    + tl.num_programs(0) * tl.num_programs(1)
                    + (b * tl.num_programs(1) + kvh) * groups_max
                    + grp
                )
                if tl.atomic_add(g_counter, 1, sem="acq_rel") == members - 1:
                    tl.debug_barrier()
                    g_base = m_base + grp * S_CHUNK
                    m_run, l_run, o = _merge_splits(
                        acc_ptr, stats_ptr, g_base, mg_ok, members, 1, D_PAD, S_CHUNK
                    )
                    # the group's partial replaces its first split's (read above, by this
                    # program only)
                    tl.store(acc_ptr + g_base[:, None] * D_PAD + d[None, :], o, mask=mg_ok[:, None])
                    tl.store(stats_ptr + g_base * 2, m_run, mask=mg_ok)
                    tl.store(stats_ptr + g_base * 2 + 1, l_run, mask=mg_ok)
                    tl.atomic_xchg(g_counter, 0)
                    tl.debug_barrier()
                    n_groups = tl.cdiv(used, S_CHUNK)
                    if tl.atomic_add(counter, 1, sem="acq_rel") == n_groups - 1:
                        tl.debug_barrier()
                        m_run, l_run, o = _merge_splits(
                            acc_ptr, stats_ptr, m_base, mg_ok, n_groups, S_CHUNK, D_PAD, S_CHUNK
                        )
                        _store_merged(m_out, mg_ok, o, l_run, D_PAD, HEAD_DIM)
                        tl.atomic_xchg(counter, 0)
