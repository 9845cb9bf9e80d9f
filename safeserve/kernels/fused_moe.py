"""Fused mixture-of-experts kernels (Triton), with torch reference paths.

`fused_moe` computes, for every token, the routing-weighted sum over its valid top-k slots of
`down(silu(gate(x)) * up(x))`, where gate/up rows live stacked in `w13` and down in `w2`.

Two launch plans, picked per token count by the tuned config (`"mode"`):

* ``sorted`` (the general plan): an align kernel sorts the (token, slot) pairs by expert and pads
  each expert's segment to ``BLOCK_M`` rows; a grouped GEMM runs gate and up for one tile of
  rows of one expert, applies SiLU-and-mul and the routing weight in its epilogue and writes the
  intermediate; a second grouped GEMM runs down and writes one row per pair; a last kernel sums
  the ``k`` rows of each token (skipping slots with id -1).
* ``pair`` (decode, a handful of tokens): no sort at all. Each (token, slot) pair is its own
  row tile for gate/up, and the down kernel loops over the ``k`` slots of one token inside one
  program, so the top-k sum happens in registers. Two launches in all. ``"split": n`` in
  ``gemm2`` shares a token's slots among n programs (n times as many programs stream a decode
  step's down weights); each writes a float32 partial and the last one of a tile sums them in a
  fixed order. ``"pdl": true`` has the down kernel's programs prefetch their weights into L2
  before they wait for gate/up (measured slower on an H200, kernels/RESULTS.md); ``"wait"`` and
  false do not. ``"evict_first": true`` in a GEMM's config marks its weight loads evict-first in
  the caches.

Where the device has programmatic dependent launch (kernels/common.py, `pdl_supported`), every
launch here is a dependent of the one before it: its programs are resident, waiting, when the
previous kernel ends.

``"interleave": true`` in ``gemm1`` (both plans) loads gate and up columns alternately into one
B tile, so one dot of twice the width computes both (one accumulator, wider tensor-core
instructions); the epilogue splits it.

Every grid depends only on the shapes (never on the routing), so a whole call can be captured in
a CUDA graph. Tile configs are data (`safeserve.kernels.moe_config`); the align kernels are in
`safeserve.kernels.moe_align`, the router's top-k in `safeserve.kernels.topk_softmax`.

Triton is optional: without it (or on CPU tensors, unless ``TRITON_INTERPRET=1``) every entry
point runs its torch reference.
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
    zeroed_counters,
)
from safeserve.kernels.moe_align import moe_align
from safeserve.kernels.moe_config import PAIR_MODES, Config, fit_config, get_config

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
            group = GROUP_M * num_pid_n
            first_m = (pid // group) * GROUP_M
            group_m = tl.minimum(num_blocks_m - first_m, GROUP_M)
            pid_m = first_m + (pid % group) % group_m
            pid_n = (pid % group) // group_m
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
        group = GROUP_M * num_pid_n
        first_m = (pid // group) * GROUP_M
        group_m = tl.minimum(num_blocks_m - first_m, GROUP_M)
        pid_m = first_m + (pid % group) % group_m
        pid_n = (pid % group) // group_m
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
        first asks L2 for its weight slices. Those reads come before the wait: the weights are
        constant, and the ids were written by the router, which completed before gate/up's
        programs, each after its own wait, let this launch start.
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
                if e >= 0:
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


def _check_inputs(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> None:
    t, h = hidden_states.shape
    e, two_i, h13 = w13.shape
    if h13 != h or two_i % 2 or w2.shape != (e, h, two_i // 2):
        raise ValueError(
            f"shape mismatch: hidden {tuple(hidden_states.shape)}, w13 {tuple(w13.shape)}, "
            f"w2 {tuple(w2.shape)}"
        )
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != t:
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
            f"must both be [{t}, k]"
        )


def fused_moe(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: Config | None = None,
) -> torch.Tensor:
    """[T, H] = sum over valid slots of w * down(silu(gate(x)) * up(x)).

    hidden_states [T, H]; w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I];
    topk_weights [T, k] (hidden dtype or float32); topk_ids [T, k] local expert ids, -1 = skip.
    No host synchronisation: safe to capture in a CUDA graph. `config` overrides the lookup.
    """
    _check_inputs(hidden_states, w13, w2, topk_weights, topk_ids)
    if not use_kernels(hidden_states):
        from safeserve.moe.runner import grouped_experts_torch

        return grouped_experts_torch(hidden_states, w13, w2, topk_ids, topk_weights)
    call = MoeLaunch(hidden_states, w13, w2, topk_weights, topk_ids, config)
    if call.num_pairs == 0:
        return call.out.zero_()
    call.align()
    call.gate_up()
    call.down()
    return call.out


def _evict(gemm: Config) -> str:
    """`"evict_first": true` in a GEMM's config: its weight loads go first out of the caches."""
    return "evict_first" if gemm.get("evict_first") else ""


class MoeLaunch:
    """One `fused_moe` call split into its launches (align, gate/up, down, top-k sum).

    `fused_moe` runs them in order; kernels/bench_fused_moe.py times them one by one.
    """

    def __init__(
        self,
        hidden_states: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        config: Config | None = None,
    ) -> None:
        # The kernels take unit strides on the last dim as given (so their loads vectorise).
        self.x = hidden_states if hidden_states.stride(1) == 1 else hidden_states.contiguous()
        self.w13 = w13 if w13.stride(2) == 1 else w13.contiguous()
        self.w2 = w2 if w2.stride(2) == 1 else w2.contiguous()
        self.num_tokens, self.hidden = hidden_states.shape
        self.num_experts, two_i, _ = w13.shape
        self.inter = two_i // 2
        self.top_k = topk_ids.shape[1]
        self.num_pairs = self.num_tokens * self.top_k
        self.dtype, self.device = hidden_states.dtype, hidden_states.device
        self.out = torch.empty(self.num_tokens, self.hidden, dtype=self.dtype, device=self.device)
        if config is None:
            config = get_config(
                self.num_tokens, self.num_experts, self.hidden, self.inter, self.top_k
            )
        self.cfg = fit_config(config, hidden_states.element_size(), self.top_k)
        self.ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
        self.route_w = topk_weights if topk_weights.is_contiguous() else topk_weights.contiguous()
        self.pair_mode = self.cfg["mode"] in PAIR_MODES
        # float32 runs are correctness runs (checked against transformers to 1e-4): no tf32 there.
        self.dot_precision = "ieee" if self.dtype == torch.float32 else "tf32"
        self.pdl = pdl_supported(self.device)  # every launch a programmatic dependent
        self.sorted_ids = self.block_expert = self.npost = self.ids  # unused by the pair plan
        self.num_blocks = self.num_pairs
        self.cache: torch.Tensor | None = None
        self.y: torch.Tensor | None = None

    def align(self) -> None:
        """Sort the pairs by expert (sorted plan) and size the intermediate buffer."""
        if self.pair_mode:
            rows = self.num_pairs
        else:
            self.sorted_ids, self.block_expert, self.npost = moe_align(
                self.ids, self.num_experts, self.cfg["BLOCK_M"]
            )
            self.num_blocks = self.block_expert.numel()
            rows = self.num_blocks * self.cfg["BLOCK_M"]
            self.y = torch.empty(self.num_pairs, self.hidden, dtype=self.dtype, device=self.device)
        self.cache = torch.empty(rows, self.inter, dtype=self.dtype, device=self.device)

    def gate_up(self) -> None:
        g1, cache = self.cfg["gemm1"], self.cache
        assert cache is not None, "align() first"
        grid = (self.num_blocks * triton.cdiv(self.inter, g1["BLOCK_N"]),)
        _gate_up_kernel[grid](
            self.x,
            self.w13,
            cache,
            self.route_w,
            self.ids,
            self.sorted_ids,
            self.block_expert,
            self.npost,
            self.num_pairs,
            self.num_blocks,
            self.inter,
            self.hidden,
            self.x.stride(0),
            self.w13.stride(0),
            self.w13.stride(1),
            cache.stride(0),
            TOP_K=self.top_k,
            BLOCK_M=self.cfg["BLOCK_M"],
            BLOCK_N=g1["BLOCK_N"],
            BLOCK_K=g1["BLOCK_K"],
            GROUP_M=g1.get("GROUP_M", 1),
            PAIR_MODE=self.pair_mode,
            EVEN_K=self.hidden % g1["BLOCK_K"] == 0,
            DOT_PRECISION=self.dot_precision,
            USE_PDL=self.pdl,
            INTERLEAVE=bool(g1.get("interleave", False)),
            B_EVICT=_evict(g1),
            num_warps=g1["num_warps"],
            num_stages=g1["num_stages"],
            launch_pdl=self.pdl,
        )

    def down(self) -> None:
        """The down projection, and the top-k sum (in registers for the pair plan)."""
        if self.pair_mode:
            self._down_pair()
        else:
            self.down_sorted()
            self.sum_topk()

    def _down_pair(self) -> None:
        g2, cache, w2, out = self.cfg["gemm2"], self.cache, self.w2, self.out
        assert cache is not None, "align() first"
        split = max(1, min(int(g2.get("split", 1)), self.top_k))
        tiles_n = triton.cdiv(self.hidden, g2["BLOCK_N"])
        if split > 1:
            part = torch.empty(self.num_tokens, split, self.hidden, device=self.device)
            counters = zeroed_counters(self.device, self.num_tokens * tiles_n, "moe_split")
        else:
            part = counters = out  # not read
        _down_pair_kernel[(self.num_tokens * tiles_n * split,)](
            cache,
            w2,
            out,
            self.ids,
            part,
            counters,
            self.num_tokens,
            self.hidden,
            self.inter,
            cache.stride(0),
            w2.stride(0),
            w2.stride(1),
            out.stride(0),
            TOP_K=self.top_k,
            K_PAD=next_power_of_2(self.top_k),
            BLOCK_M=self.cfg["BLOCK_M"],
            BLOCK_N=g2["BLOCK_N"],
            BLOCK_K=g2["BLOCK_K"],
            EVEN_K=self.inter % g2["BLOCK_K"] == 0,
            DOT_PRECISION=self.dot_precision,
            USE_PDL=self.pdl,
            PDL_PREFETCH=self.pdl and self.cfg["pdl_prefetch"],
            K_LINES=next_power_of_2(triton.cdiv(self.inter * w2.element_size(), 128)),
            LINE_ELEMS=128 // w2.element_size(),
            SPLIT=split,
            B_EVICT=_evict(g2),
            num_warps=g2["num_warps"],
            num_stages=g2["num_stages"],
            launch_pdl=self.pdl,
        )

    def down_sorted(self) -> None:
        g2, cache, w2, y = self.cfg["gemm2"], self.cache, self.w2, self.y
        assert cache is not None and y is not None, "align() first"
        grid = (self.num_blocks * triton.cdiv(self.hidden, g2["BLOCK_N"]),)
        _down_sorted_kernel[grid](
            cache,
            w2,
            y,
            self.sorted_ids,
            self.block_expert,
            self.npost,
            self.num_pairs,
            self.num_blocks,
            self.hidden,
            self.inter,
            cache.stride(0),
            w2.stride(0),
            w2.stride(1),
            y.stride(0),
            BLOCK_M=self.cfg["BLOCK_M"],
            BLOCK_N=g2["BLOCK_N"],
            BLOCK_K=g2["BLOCK_K"],
            GROUP_M=g2.get("GROUP_M", 1),
            EVEN_K=self.inter % g2["BLOCK_K"] == 0,
            DOT_PRECISION=self.dot_precision,
            B_EVICT=_evict(g2),
            USE_PDL=self.pdl,
            num_warps=g2["num_warps"],
            num_stages=g2["num_stages"],
            launch_pdl=self.pdl,
        )

    def sum_topk(self) -> None:
        y, out = self.y, self.out
        assert y is not None, "align() first"
        block_n = min(1024, next_power_of_2(self.hidden))
        _sum_topk_kernel[(self.num_tokens, triton.cdiv(self.hidden, block_n))](
            y,
            self.ids,
            out,
            self.num_tokens,
            self.hidden,
            y.stride(0),
            out.stride(0),
            TOP_K=self.top_k,
            BLOCK_N=block_n,
            USE_PDL=self.pdl,
            num_warps=4,
            launch_pdl=self.pdl,
        )
