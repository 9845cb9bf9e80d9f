"""The Triton kernels of the fused MoE (`safeserve.kernels.fused_moe` launches them and says
what each plan does): gate/up with SiLU-and-mul and the routing weight, down for the sorted plan,
down with the top-k sum in registers for the pair plan (optionally split over programs), and the
top-k sum of the sorted plan. Defined only where Triton is installed.
"""

from __future__ import annotations

from safeserve.kernels.common import HAS_TRITON, grouped_tile, pdl_wait, tl, triton

if HAS_TRITON:

    @triton.jit
    def _mainloop(
        a_ptrs,
        b_ptrs,
        row_ok,
        acc,
        K,
        BLOCK_K: tl.constexpr,
        EVEN_K: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        B_EVICT: tl.constexpr = "",
    ):
        """acc += A[rows, :K] @ B[:K, cols] for tiles whose K runs along unit strides of both.

        B_EVICT is the cache eviction policy of the B (weight) loads ("" or "evict_first")."""
        offs_k = tl.arange(0, BLOCK_K)
        for kk in range(0, tl.cdiv(K, BLOCK_K)):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                b = tl.load(b_ptrs, eviction_policy=B_EVICT)
            else:
                k_ok = offs_k < K - kk * BLOCK_K
                a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0, eviction_policy=B_EVICT)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        return acc

    @triton.jit
    def _prefetch_l2(ptrs):
        tl.inline_asm_elementwise(
            "prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;",
            "=r,l",
            [ptrs],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )

    @triton.jit(do_not_specialize=["num_pairs", "num_blocks_m"])
    def _gate_up_kernel(
        x_ptr,
        w_ptr,
        out_ptr,
        topk_w_ptr,
        ids_ptr,
        sorted_ptr,
        block_expert_ptr,
        npost_ptr,
        num_pairs,
        num_blocks_m,
        N,
        K,
        stride_xt,
        stride_we,
        stride_wn,
        stride_om,
        TOP_K: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
        PAIR_MODE: tl.constexpr,
        EVEN_K: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        USE_PDL: tl.constexpr,
        INTERLEAVE: tl.constexpr,
        B_EVICT: tl.constexpr,
    ):
        """out[row, n] = w_pair * silu(x @ gate[e].T) * (x @ up[e].T) for one row tile of one expert.

        N is the intermediate size I; w rows [0, N) are gate, [N, 2N) are up. With INTERLEAVE
        the B tile holds gate and up columns alternately, so one dot of width 2*BLOCK_N does both
        (wider tensor-core instructions, one accumulator) and the epilogue splits it.
        """
        pdl_wait(USE_PDL)
        pid = tl.program_id(0)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        if PAIR_MODE:
            # The pair index varies fastest: programs that share an expert tile run together.
            pid_m = pid % num_blocks_m
            pid_n = pid // num_blocks_m
        else:
            pid_m, pid_n = grouped_tile(pid, num_blocks_m, num_pid_n, GROUP_M)
        offs_r = tl.arange(0, BLOCK_M)
        if PAIR_MODE:
            expert = tl.load(ids_ptr + pid_m).to(tl.int32)
            if expert < 0:
                return
            pair = pid_m + offs_r * 0
            row_ok = offs_r == 0
            out_rows = pair
        else:
            if pid_m * BLOCK_M >= tl.load(npost_ptr):
                return
            expert = tl.load(block_expert_ptr + pid_m)
            out_rows = pid_m * BLOCK_M + offs_r
            pair = tl.load(sorted_ptr + out_rows)
            row_ok = pair < num_pairs
        w_e = w_ptr + expert.to(tl.int64) * stride_we
        token = (pair // TOP_K).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_nw = offs_n % N
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = x_ptr + token[:, None] * stride_xt + offs_k[None, :]
        if INTERLEAVE:
            # column 2j is gate row n_j, column 2j+1 is up row n_j (= row N + n_j of w13)
            offs_c = tl.arange(0, 2 * BLOCK_N)
            w_rows = (pid_n * BLOCK_N + offs_c // 2) % N + (offs_c % 2) * N
            b_ptrs = w_e + w_rows[None, :] * stride_wn + offs_k[:, None]
            acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
            acc = _mainloop(a_ptrs, b_ptrs, row_ok, acc, K, BLOCK_K, EVEN_K, DOT_PRECISION, B_EVICT)
            acc_g, acc_u = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N, 2]))
        else:
            g_ptrs = w_e + offs_nw[None, :] * stride_wn + offs_k[:, None]
            u_ptrs = g_ptrs + N * stride_wn
            acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for kk in range(0, tl.cdiv(K, BLOCK_K)):
                if EVEN_K:
                    a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                    bg = tl.load(g_ptrs, eviction_policy=B_EVICT)
                    bu = tl.load(u_ptrs, eviction_policy=B_EVICT)
                else:
                    k_ok = offs_k < K - kk * BLOCK_K
                    a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                    bg = tl.load(g_ptrs, mask=k_ok[:, None], other=0.0, eviction_policy=B_EVICT)
                    bu = tl.load(u_ptrs, mask=k_ok[:, None], other=0.0, eviction_policy=B_EVICT)
                acc_g = tl.dot(a, bg, acc_g, input_precision=DOT_PRECISION)
                acc_u = tl.dot(a, bu, acc_u, input_precision=DOT_PRECISION)
                a_ptrs += BLOCK_K
                g_ptrs += BLOCK_K
                u_ptrs += BLOCK_K
        route_w = tl.load(topk_w_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u * route_w[:, None]
        o_ptrs = out_ptr + out_rows[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(
            o_ptrs, h.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n[None, :] < N)
        )

    @triton.jit(do_not_specialize=["num_pairs", "num_blocks_m"])
    def _down_sorted_kernel(
        a_ptr,
        w_ptr,
        y_ptr,
        sorted_ptr,
        block_expert_ptr,
        npost_ptr,
        num_pairs,
        num_blocks_m,
        N,
        K,
        stride_am,
        stride_we,
        stride_wn,
        stride_ym,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
        EVEN_K: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        B_EVICT: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        """y[pair, n] = a[row] @ down[e].T for one row tile of one expert (N = hidden, K = I)."""
        pdl_wait(USE_PDL)
        pid = tl.program_id(0)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        pid_m, pid_n = grouped_tile(pid, num_blocks_m, num_pid_n, GROUP_M)
        if pid_m * BLOCK_M >= tl.load(npost_ptr):
            return
        expert = tl.load(block_expert_ptr + pid_m)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_ptr + rows)
        row_ok = pair < num_pairs
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_nw = offs_n % N
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_am + offs_k[None, :]
        b_ptrs = (
            w_ptr + expert.to(tl.int64) * stride_we + offs_nw[None, :] * stride_wn + offs_k[:, None]
        )
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc = _mainloop(a_ptrs, b_ptrs, row_ok, acc, K, BLOCK_K, EVEN_K, DOT_PRECISION, B_EVICT)
        y_ptrs = y_ptr + pair[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
        tl.store(
            y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n[None, :] < N)
        )

    @triton.jit(do_not_specialize=["num_tokens"])
    def _down_pair_kernel(
        a_ptr,
        w_ptr,
        out_ptr,
        ids_ptr,
        part_ptr,
        sync_ptr,
        num_tokens,
        num_experts,
        N,
        K,
        stride_am,
        stride_we,
        stride_wn,
        stride_ot,
        TOP_K: tl.constexpr,
        K_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        EVEN_K: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        USE_PDL: tl.constexpr,
        PDL_PREFETCH: tl.constexpr,
        K_LINES: tl.constexpr,
        LINE_ELEMS: tl.constexpr,
        SPLIT: tl.constexpr,
        B_EVICT: tl.constexpr,
    ):
        """out[t, n] = sum over valid slots s of a[t*k+s] @ down[e_s].T (a is pre-weighted).

        With SPLIT > 1 the k slots of a token are shared by SPLIT programs (more programs stream
        a decode step's weights): each stores its float32 partial in part [T, SPLIT, N] and bumps
        the tile's counter in sync; the last to arrive sums the partials in a fixed order (the
        result does not depend on arrival order), writes out and zeroes the counter again.

        With USE_PDL this kernel is launched while the gate/up kernel still runs and waits for it
        (its programs are resident when gate/up ends); with PDL_PREFETCH (only with USE_PDL) it
        first asks L2 for its weight slices. Those reads come before the wait, so the ids they
        read may be the previous step's: every launch lets its dependent start before it waits
        itself (`safeserve.kernels.common`), so the router may still be running. The prefetch is
        only a hint (the ids are read again after the wait), and the ids it uses are clamped to
        the experts so that every prefetched address lies inside w.
        """
        pid = tl.program_id(0)
        group = pid % SPLIT
        pid_t = (pid // SPLIT) % num_tokens
        pid_n = pid // (SPLIT * num_tokens)
        slots = tl.arange(0, K_PAD)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        if PDL_PREFETCH:
            # one L2 prefetch per 128-byte line of each valid slot's [BLOCK_N, K] slice
            pre_ids = tl.load(ids_ptr + pid_t * TOP_K + slots, mask=slots < TOP_K, other=-1)
            line_k = tl.minimum(tl.arange(0, K_LINES) * LINE_ELEMS, K - 1)
            for j in tl.static_range(TOP_K):
                e = tl.sum(tl.where(slots == j, pre_ids.to(tl.int32), 0), axis=0)
                if (e >= 0) & (e < num_experts):
                    pf = w_ptr + e.to(tl.int64) * stride_we + (offs_n % N)[:, None] * stride_wn
                    _prefetch_l2(pf + line_k[None, :])
        pdl_wait(USE_PDL)
        slot_ids = tl.load(ids_ptr + pid_t * TOP_K + slots, mask=slots < TOP_K, other=-1).to(
            tl.int32
        )
        slots_per: tl.constexpr = (TOP_K + SPLIT - 1) // SPLIT
        s_lo = group * slots_per
        offs_r = tl.arange(0, BLOCK_M)
        row0 = offs_r == 0
        offs_nw = offs_n % N
        offs_k = tl.arange(0, BLOCK_K)
        num_k = tl.cdiv(K, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for it in range(0, slots_per * num_k):
            s = s_lo + it // num_k
            k0 = (it % num_k) * BLOCK_K
            expert = tl.sum(tl.where(slots == s, slot_ids + 1, 0), axis=0) - 1  # -1 past TOP_K
            ok = expert >= 0
            pair = (pid_t * TOP_K + s).to(tl.int64)
            a_ptrs = a_ptr + pair * stride_am + (k0 + offs_k)[None, :] + offs_r[:, None] * 0
            b_ptrs = (
                w_ptr
                + tl.maximum(expert, 0).to(tl.int64) * stride_we
                + offs_nw[None, :] * stride_wn
                + (k0 + offs_k)[:, None]
            )
            # masks combined with the slot's scalar `ok` by tl.where, not `&` (Triton 3.9's
            # interpreter rejects a tensor & scalar mask)
            if EVEN_K:
                a = tl.load(a_ptrs, mask=tl.where(ok, row0[:, None], False), other=0.0)
                b_ok = tl.where(ok, n_ok[None, :], False)  # constant along K: loads stay wide
                b = tl.load(b_ptrs, mask=b_ok, other=0.0, eviction_policy=B_EVICT)
            else:
                k_ok = (k0 + offs_k) < K
                a_ok = tl.where(ok, row0[:, None] & k_ok[None, :], False)
                a = tl.load(a_ptrs, mask=a_ok, other=0.0)
                b_ok = tl.where(ok, k_ok[:, None] & n_ok[None, :], False)
                b = tl.load(b_ptrs, mask=b_ok, other=0.0, eviction_policy=B_EVICT)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        res = tl.sum(tl.where(row0[:, None], acc, 0.0), axis=0)
        o_ptrs = out_ptr + pid_t.to(tl.int64) * stride_ot + offs_n
        if SPLIT == 1:
            tl.store(o_ptrs, res.to(out_ptr.dtype.element_ty), mask=n_ok)
        else:
            parts = part_ptr + (pid_t * SPLIT).to(tl.int64) * N + offs_n
            tl.store(parts + group * N, res, mask=n_ok)
            tl.debug_barrier()  # every thread's partial is issued before the release
            counter = sync_ptr + pid_t * tl.cdiv(N, BLOCK_N) + pid_n
            if tl.atomic_add(counter, 1, sem="acq_rel") == SPLIT - 1:
                tl.debug_barrier()
                total = tl.zeros([BLOCK_N], dtype=tl.float32)
                for j in tl.static_range(SPLIT):
                    total += tl.load(parts + j * N, mask=n_ok, other=0.0, cache_modifier=".cg")
                tl.store(o_ptrs, total.to(out_ptr.dtype.element_ty), mask=n_ok)
                tl.atomic_xchg(counter, 0)

    @triton.jit(do_not_specialize=["num_tokens"])
    def _sum_topk_kernel(
        y_ptr,
        ids_ptr,
        out_ptr,
        num_tokens,
        N,
        stride_ym,
        stride_ot,
        TOP_K: tl.constexpr,
        BLOCK_N: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        """out[t] = sum over slots s with id >= 0 of y[t*k+s] (float32 accumulation)."""
        pdl_wait(USE_PDL)
        pid_t = tl.program_id(0)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for s in tl.static_range(TOP_K):
            pair = pid_t.to(tl.int64) * TOP_K + s
            ok = tl.load(ids_ptr + pair) >= 0
            v = tl.load(
                y_ptr + pair * stride_ym + offs_n, mask=tl.where(ok, n_ok, False), other=0.0
            )
            acc += v.to(tl.float32)
        tl.store(
            out_ptr + pid_t.to(tl.int64) * stride_ot + offs_n,
            acc.to(out_ptr.dtype.element_ty),
            mask=n_ok,
        )
