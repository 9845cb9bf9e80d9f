"""The Triton kernels of the fused MoE's ``chunk`` plan (`safeserve.kernels.fused_moe` launches
them): one program per (token, slot) pair and slice of the intermediate dimension runs that
slice's gate/up rows, SiLU-and-mul and routing weight, then that slice's columns of the down
projection, and writes a float32 partial of the token's output row; a second, small kernel sums
a token's partials in a fixed order. Defined only where Triton is installed.

Why: at one or two decode tokens the MoE layer only streams its routed experts' weights. The
other plans stream them in two dependent launches (gate/up, then down), each paying its own ramp
and tail. Here the down weights of a slice depend only on that slice's gate/up rows, so every
program streams both and no program waits for another.
"""

from __future__ import annotations

from safeserve.kernels.common import HAS_TRITON, pdl_wait, tl, triton

if HAS_TRITON:

    @triton.jit(do_not_specialize=["num_pairs"])
    def _chunk_kernel(
        x_ptr,
        w13_ptr,
        w2_ptr,
        topk_w_ptr,
        ids_ptr,
        part_ptr,
        num_pairs,
        inter,
        H,
        stride_xt,
        stride_w13e,
        stride_w13n,
        stride_w2e,
        stride_w2n,
        TOP_K: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_I: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_H: tl.constexpr,
        SLICE: tl.constexpr,
        EVEN_K: tl.constexpr,
        FULL_SLICES: tl.constexpr,
        EVEN_H: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        USE_PDL: tl.constexpr,
        B_EVICT: tl.constexpr,
    ):
        """part[pair, c, :] = down[e][:, slice c] @ (w_pair * silu(gate[e][c] x) * up[e][c] x).

        Slice c is intermediate rows [c * SLICE, (c + 1) * SLICE) (SLICE <= BLOCK_I; fewer rows
        than the tile give more programs: at one token there are only k pairs); e = ids[pair].
        Pairs with id -1 write nothing (the sum kernel skips them). Gate and up rows are loaded
        interleaved into one B tile, so one dot does both; row 0 of the A tile is the token, rows
        1.. are zeros (tensor-core tiles are at least 16 rows), so they stay zero through the
        epilogue.
        """
        pdl_wait(USE_PDL)
        pid = tl.program_id(0)
        pair = pid % num_pairs  # the pair varies fastest: one slice of every pair runs together
        chunk = pid // num_pairs
        expert = tl.load(ids_ptr + pair).to(tl.int32)
        if expert < 0:
            return
        token = (pair // TOP_K).to(tl.int64)
        offs_r = tl.arange(0, BLOCK_M)
        row0 = offs_r == 0
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = x_ptr + token * stride_xt + offs_r[:, None] * 0 + offs_k[None, :]
        # column 2j of the B tile is gate row i_j, column 2j+1 up row i_j (row inter + i_j of w13);
        # a slice narrower than the tile leaves its last columns unread and zero
        offs_c = tl.arange(0, 2 * BLOCK_I)
        rows_i = chunk * SLICE + offs_c // 2
        col_ok = (offs_c // 2 < SLICE) & (rows_i < inter)
        w_rows = tl.where(col_ok, rows_i, 0) + (offs_c % 2) * inter
        b_ptrs = (
            w13_ptr
            + expert.to(tl.int64) * stride_w13e
            + w_rows[None, :].to(tl.int64) * stride_w13n
            + offs_k[:, None]
        )
        acc = tl.zeros([BLOCK_M, 2 * BLOCK_I], dtype=tl.float32)
        for kk in range(0, tl.cdiv(H, BLOCK_K)):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=row0[:, None], other=0.0)
                if FULL_SLICES:
                    b = tl.load(b_ptrs, eviction_policy=B_EVICT)
                else:
                    b = tl.load(b_ptrs, mask=col_ok[None, :], other=0.0, eviction_policy=B_EVICT)
            else:
                k_ok = offs_k < H - kk * BLOCK_K
                a = tl.load(a_ptrs, mask=row0[:, None] & k_ok[None, :], other=0.0)
                b_ok = k_ok[:, None] & col_ok[None, :]
                b = tl.load(b_ptrs, mask=b_ok, other=0.0, eviction_policy=B_EVICT)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        acc_g, acc_u = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_I, 2]))
        route_w = tl.load(topk_w_ptr + pair).to(tl.float32)
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u * route_w  # zero in unread columns
        offs_j = tl.arange(0, BLOCK_I)
        offs_i = chunk * SLICE + offs_j
        i_ok = (offs_j < SLICE) & (offs_i < inter)  # the loads below are masked by it
        h = h.to(w2_ptr.dtype.element_ty)
        # down: [BLOCK_M, BLOCK_I] @ [BLOCK_I, BLOCK_H] per tile of the output row
        offs_h = tl.arange(0, BLOCK_H)
        w2_ptrs = (
            w2_ptr
            + expert.to(tl.int64) * stride_w2e
            + offs_h[None, :].to(tl.int64) * stride_w2n
            + offs_i[:, None]
        )
        p_ptrs = part_ptr + (chunk * num_pairs + pair).to(tl.int64) * H + offs_h
        for n0 in range(0, H, BLOCK_H):
            if FULL_SLICES and EVEN_H:
                b = tl.load(w2_ptrs, eviction_policy=B_EVICT)
            else:
                b_ok = i_ok[:, None] & (n0 + offs_h < H)[None, :]
                b = tl.load(w2_ptrs, mask=b_ok, other=0.0, eviction_policy=B_EVICT)
            y = tl.dot(h, b, input_precision=DOT_PRECISION)
            y0 = tl.sum(tl.where(row0[:, None], y, 0.0), axis=0)
            if EVEN_H:
                tl.store(p_ptrs, y0)
            else:
                tl.store(p_ptrs, y0, mask=n0 + offs_h < H)
            w2_ptrs += BLOCK_H * stride_w2n
            p_ptrs += BLOCK_H

    @triton.jit(do_not_specialize=["num_pairs"])
    def _chunk_sum_kernel(
        part_ptr,
        ids_ptr,
        out_ptr,
        num_pairs,
        num_chunks,
        H,
        stride_ot,
        TOP_K: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_N: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        """out[t, n] = sum over slices c and valid slots s of part[c, t*k+s, n], in a fixed order
        (the result does not depend on which program finished first)."""
        pdl_wait(USE_PDL)
        t = tl.program_id(0)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < H
        rows = tl.arange(0, BLOCK_R)  # row r = slice r // TOP_K, slot r % TOP_K
        acc = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
        for r0 in range(0, num_chunks * TOP_K, BLOCK_R):
            r = r0 + rows
            pair = t * TOP_K + r % TOP_K
            ok = r < num_chunks * TOP_K
            slot_id = tl.load(ids_ptr + pair, mask=ok, other=-1)
            ok = ok & (slot_id >= 0)
            src = ((r // TOP_K) * num_pairs + pair).to(tl.int64) * H
            v = tl.load(
                part_ptr + src[:, None] + offs_n[None, :],
                mask=ok[:, None] & n_ok[None, :],
                other=0.0,
            )
            acc += v
        tl.store(
            out_ptr + t.to(tl.int64) * stride_ot + offs_n,
            tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty),
            mask=n_ok,
        )
