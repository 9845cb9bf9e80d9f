"""Router top-k: softmax over the experts in float32, the top k, optional renormalisation, and
the logical -> physical expert-id map, in one Triton kernel (`fused_topk_softmax`), with its
torch reference (`topk_softmax_torch`); and `router_topk`, which for decode-sized batches also
runs the router GEMM in that launch."""

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


def topk_softmax_torch(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for `fused_topk_softmax`: float32 weights, int32 ids."""
    from safeserve.moe.topk import softmax_topk

    weights, ids = softmax_topk(router_logits, top_k, renormalize, torch.float32)
    return weights, ids.to(torch.int32)


if HAS_TRITON:

    @triton.jit
    def _softmax_topk_store(
        x,
        rows,
        row_ok,
        cols,
        col_ok,
        w_ptr,
        ids_ptr,
        map_ptr,
        skew_ptr,
        num_experts,
        TOP_K: tl.constexpr,
        K_PAD: tl.constexpr,
        BLOCK_T: tl.constexpr,
        RENORMALIZE: tl.constexpr,
        HAS_MAP: tl.constexpr,
        HAS_SKEW: tl.constexpr,
    ):
        """Softmax of float32 logits x [BLOCK_T, E_PAD] (-inf past the experts), top k by
        repeated argmax (ties to the lower id), optional renormalisation, id map; stores.

        HAS_SKEW: the int64 at skew_ptr, when >= 0 (fault injection, `route_skew`), replaces
        every row's ids by the experts starting there, (skew + slot) % num_experts, before the
        map; the weights stay the top k's. A tensor, not a constexpr, so a CUDA graph captured
        with it follows the fault being set and cleared."""
        # Rows past the batch are all -inf: give them zeros rather than NaN (they are not
        # stored, but an argmax over an all-NaN row is an error in Triton's interpreter).
        x_max = tl.where(row_ok, tl.max(x, axis=1), 0.0)
        p = tl.exp(x - x_max[:, None])
        p = tl.where(col_ok[None, :], p, 0.0)
        p = p / tl.where(row_ok, tl.sum(p, axis=1), 1.0)[:, None]
        p = tl.where(col_ok[None, :], p, -2.0)  # never picked before a real expert
        kcols = tl.arange(0, K_PAD)
        top_w = tl.zeros([BLOCK_T, K_PAD], dtype=tl.float32)
        top_i = tl.zeros([BLOCK_T, K_PAD], dtype=tl.int32)
        for i in tl.static_range(TOP_K):
            best = tl.argmax(p, axis=1, tie_break_left=True).to(tl.int32)
            val = tl.max(p, axis=1)
            top_w = tl.where(kcols[None, :] == i, val[:, None], top_w)
            top_i = tl.where(kcols[None, :] == i, best[:, None], top_i)
            p = tl.where(cols[None, :] == best[:, None], -1.0, p)
        if RENORMALIZE:
            top_w = top_w / tl.sum(top_w, axis=1)[:, None]
        if HAS_SKEW:
            skew = tl.load(skew_ptr)
            skewed = ((skew + kcols) % num_experts).to(tl.int32)
            top_i = tl.where(skew >= 0, skewed[None, :], top_i)
        offs = rows[:, None].to(tl.int64) * TOP_K + kcols[None, :]
        mask = row_ok[:, None] & (kcols[None, :] < TOP_K)
        if HAS_MAP:  # logical -> physical expert id
            top_i = tl.load(map_ptr + top_i, mask=mask, other=0)
        tl.store(w_ptr + offs, top_w.to(w_ptr.dtype.element_ty), mask=mask)
        tl.store(ids_ptr + offs, top_i.to(ids_ptr.dtype.element_ty), mask=mask)

    @triton.jit(do_not_specialize=["num_tokens"])
    def _topk_softmax_kernel(
        logits_ptr,
        w_ptr,
        ids_ptr,
        map_ptr,
        skew_ptr,
        num_tokens,
        num_experts,
        stride_lt,
        TOP_K: tl.constexpr,
        K_PAD: tl.constexpr,
        E_PAD: tl.constexpr,
        BLOCK_T: tl.constexpr,
        RENORMALIZE: tl.constexpr,
        HAS_MAP: tl.constexpr,
        HAS_SKEW: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        pdl_wait(USE_PDL)
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.arange(0, E_PAD)
        row_ok = rows < num_tokens
        col_ok = cols < num_experts
        x = tl.load(
            logits_ptr + rows[:, None].to(tl.int64) * stride_lt + cols[None, :],
            mask=row_ok[:, None] & col_ok[None, :],
            other=-float("inf"),
        ).to(tl.float32)
        _softmax_topk_store(
            x, rows, row_ok, cols, col_ok, w_ptr, ids_ptr, map_ptr, skew_ptr, num_experts,
            TOP_K, K_PAD, BLOCK_T, RENORMALIZE, HAS_MAP, HAS_SKEW,
        )  # fmt: skip

    @triton.jit(do_not_specialize=["num_tokens"])
    def _router_topk_kernel(
        x_ptr,
        gate_ptr,
        logits_ptr,
        part_ptr,
        w_ptr,
        ids_ptr,
        map_ptr,
        skew_ptr,
        sync_ptr,
        num_tokens,
        num_experts,
        hidden,
        stride_xt,
        stride_ge,
        stride_lt,
        TOP_K: tl.constexpr,
        K_PAD: tl.constexpr,
        E_PAD: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SPLIT_E: tl.constexpr,
        SPLIT_K: tl.constexpr,
        RENORMALIZE: tl.constexpr,
        HAS_MAP: tl.constexpr,
        HAS_SKEW: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        """Router GEMM and top-k in one launch, logits = x @ gate.T.

        A token block's [BLOCK_T, E] logits are shared by SPLIT_E x SPLIT_K programs, each one
        [BLOCK_E experts, BLOCK_K of the hidden size] tile, so a decode step's router weights
        stream through many SMs at once. Each program stores its float32 partial in part
        [T, SPLIT_K, E] and bumps the block's counter; the last to arrive sums the partials in
        a fixed order (the result does not depend on arrival order), rounds the logits to their
        dtype (as a GEMM in that dtype would) and stores them, runs the top-k over the whole
        row and sets the counter back to zero. One program per block (SPLIT_E = SPLIT_K = 1)
        loops over the hidden size and needs no counter.
        """
        pid = tl.program_id(0)
        tb = pid // (SPLIT_E * SPLIT_K)
        eb = (pid // SPLIT_K) % SPLIT_E
        kb = pid % SPLIT_K
        rows = tb * BLOCK_T + tl.arange(0, BLOCK_T)
        row_ok = rows < num_tokens
        experts = eb * BLOCK_E + tl.arange(0, BLOCK_E)
        e_ok = experts < num_experts
        offs_k = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
        x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xt
        g_cols = gate_ptr + experts[None, :].to(tl.int64) * stride_ge
        if SPLIT_K == 1:
            pdl_wait(USE_PDL)
            for k0 in range(0, hidden, BLOCK_K):
                k_ok = k0 + offs_k < hidden
                a = tl.load(
                    x_rows + (k0 + offs_k)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0
                )
                b = tl.load(
                    g_cols + (k0 + offs_k)[:, None], mask=e_ok[None, :] & k_ok[:, None], other=0.0
                )
                acc = tl.dot(a, b.to(a.dtype), acc, input_precision=DOT_PRECISION)
        else:  # one K tile per program; its gate tile (a weight) is read before the wait
            k_ok = kb * BLOCK_K + offs_k < hidden
            b = tl.load(
                g_cols + (kb * BLOCK_K + offs_k)[:, None],
                mask=e_ok[None, :] & k_ok[:, None],
                other=0.0,
            )
            pdl_wait(USE_PDL)
            a = tl.load(
                x_rows + (kb * BLOCK_K + offs_k)[None, :],
                mask=row_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            acc = tl.dot(a, b.to(a.dtype), acc, input_precision=DOT_PRECISION)
        l_rows = logits_ptr + rows[:, None].to(tl.int64) * stride_lt
        if SPLIT_E * SPLIT_K == 1:  # one program: the top-k runs on its own tile
            tl.store(
                l_rows + experts[None, :],
                acc.to(logits_ptr.dtype.element_ty),
                mask=row_ok[:, None] & e_ok[None, :],
            )
            x = acc.to(logits_ptr.dtype.element_ty).to(tl.float32)
            x = tl.where(e_ok[None, :], x, -float("inf"))
            _softmax_topk_store(
                x, rows, row_ok, experts, e_ok, w_ptr, ids_ptr, map_ptr, skew_ptr, num_experts,
                TOP_K, K_PAD, BLOCK_T, RENORMALIZE, HAS_MAP, HAS_SKEW,
            )  # fmt: skip
        else:
            p_rows = part_ptr + rows[:, None].to(tl.int64) * (SPLIT_K * num_experts)
            tl.store(
                p_rows + kb * num_experts + experts[None, :],
                acc,
                mask=row_ok[:, None] & e_ok[None, :],
            )
            tl.debug_barrier()  # every thread's partial is issued before the release
            if tl.atomic_add(sync_ptr + tb, 1, sem="acq_rel") == SPLIT_E * SPLIT_K - 1:
                tl.debug_barrier()
                cols = tl.arange(0, E_PAD)
                col_ok = cols < num_experts
                mask = row_ok[:, None] & col_ok[None, :]
                total = tl.zeros([BLOCK_T, E_PAD], dtype=tl.float32)
                for j in tl.static_range(SPLIT_K):  # unrolled: every load is in flight at once
                    total += tl.load(
                        p_rows + j * num_experts + cols[None, :],
                        mask=mask,
                        other=0.0,
                        cache_modifier=".cg",
                    )
                logits = total.to(logits_ptr.dtype.element_ty)
                tl.store(l_rows + cols[None, :], logits, mask=mask)
                x = tl.where(col_ok[None, :], logits.to(tl.float32), -float("inf"))
                _softmax_topk_store(
                    x, rows, row_ok, cols, col_ok, w_ptr, ids_ptr, map_ptr, skew_ptr,
                    num_experts, TOP_K, K_PAD, BLOCK_T, RENORMALIZE, HAS_MAP, HAS_SKEW,
                )  # fmt: skip
                tl.atomic_xchg(sync_ptr + tb, 0)


def _topk_outputs(
    num_tokens: int,
    top_k: int,
    weights_dtype: torch.dtype,
    expert_map: torch.Tensor | None,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty weights [T, k] and ids [T, k] (int32, or the map's dtype when ids are mapped)."""
    weights = torch.empty(num_tokens, top_k, dtype=weights_dtype, device=device)
    ids_dtype = torch.int32 if expert_map is None else expert_map.dtype
    return weights, torch.empty(num_tokens, top_k, dtype=ids_dtype, device=device)


def fused_topk_softmax(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    weights_dtype: torch.dtype = torch.float32,
    expert_map: torch.Tensor | None = None,
    skew: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts in float32, top k, optional renormalisation, in one kernel.

    Returns (weights [T, k] in `weights_dtype`, ids [T, k]): ids int32, or, with `expert_map`
    ([E] int64, logical -> physical), the mapped ids as int64, mapped inside the same kernel.
    `skew` ([1] int64 on the device): where it holds an expert id e >= 0, every row's ids
    are e, e + 1, ... (mod E) instead (fault injection), read on the device at run time.
    Reference: `topk_softmax_torch` (+ `safeserve.moe.topk.skew_ids`).
    """
    if not use_kernels(router_logits):
        weights, ids = topk_softmax_torch(router_logits, top_k, renormalize)
        if skew is not None:
            from safeserve.moe.topk import skew_ids

            ids = skew_ids(ids, skew, router_logits.shape[-1])
        if expert_map is not None:
            ids = expert_map[ids.to(torch.int64)]
        return weights.to(weights_dtype), ids
    num_tokens, num_experts = router_logits.shape
    if top_k > num_experts:
        raise ValueError(f"top_k={top_k} > {num_experts} experts")
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    device = logits.device
    weights, ids = _topk_outputs(num_tokens, top_k, weights_dtype, expert_map, device)
    if num_tokens == 0:
        return weights, ids
    e_pad = next_power_of_2(num_experts)
    block_t = max(1, min(16, 2048 // e_pad, next_power_of_2(num_tokens)))
    pdl = pdl_supported(device)
    _topk_softmax_kernel[(triton.cdiv(num_tokens, block_t),)](
        logits,
        weights,
        ids,
        expert_map if expert_map is not None else ids,
        skew if skew is not None else ids,
        num_tokens,
        num_experts,
        logits.stride(0),
        TOP_K=top_k,
        K_PAD=next_power_of_2(top_k),
        E_PAD=e_pad,
        BLOCK_T=block_t,
        RENORMALIZE=renormalize,
        HAS_MAP=expert_map is not None,
        HAS_SKEW=skew is not None,
        # A decode step's few rows fit one warp: its reductions then need no shared memory.
        USE_PDL=pdl,
        num_warps=1 if e_pad * block_t <= 256 else (4 if e_pad * block_t <= 2048 else 8),
        launch_pdl=pdl,
    )
    return weights, ids


# Up to this many tokens the router GEMM runs inside the top-k launch (`router_topk`); larger
# batches take a library GEMM and the top-k kernel. On an H200 (128 experts, hidden 2,048;
# kernels/bench_router_topk.py) the one launch takes 5.9 / 6.5 us of kernel time at 1 / 16
# tokens against 6.7 / 8.2 us for the two, plus one launch gap less; at 64 tokens it is slower.
ROUTER_FUSED_MAX_TOKENS = 16


def router_topk(
    hidden_states: torch.Tensor,
    gate_weight: torch.Tensor,
    top_k: int,
    renormalize: bool,
    weights_dtype: torch.dtype = torch.float32,
    expert_map: torch.Tensor | None = None,
    num_warps: int = 8,
    skew: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Router logits (x @ gate.T, in the hidden dtype) and their top-k, as `fused_topk_softmax`
    (`skew` as there).

    Returns (weights, ids, logits). Up to `ROUTER_FUSED_MAX_TOKENS` tokens on the kernel path it
    is one launch; no host synchronisation either way (CUDA-graph safe). `num_warps`: of the
    one-launch kernel.
    """
    num_tokens, hidden = hidden_states.shape
    num_experts = gate_weight.shape[0]
    if gate_weight.shape[1] != hidden:
        raise ValueError(f"gate {tuple(gate_weight.shape)} does not take hidden size {hidden}")
    if not use_kernels(hidden_states) or num_tokens > ROUTER_FUSED_MAX_TOKENS or num_tokens == 0:
        logits = torch.nn.functional.linear(hidden_states, gate_weight.to(hidden_states.dtype))
        weights, ids = fused_topk_softmax(
            logits, top_k, renormalize, weights_dtype, expert_map, skew
        )
        return weights, ids, logits
    if top_k > num_experts:
        raise ValueError(f"top_k={top_k} > {num_experts} experts")
    x = hidden_states if hidden_states.stride(1) == 1 else hidden_states.contiguous()
    gate = gate_weight if gate_weight.stride(1) == 1 else gate_weight.contiguous()
    device = x.device
    logits = torch.empty(num_tokens, num_experts, dtype=x.dtype, device=device)
    weights, ids = _topk_outputs(num_tokens, top_k, weights_dtype, expert_map, device)
    e_pad = next_power_of_2(num_experts)
    # Tiles: 16 tokens (the smallest `tl.dot` takes) x 16 experts x 256 of the hidden size, so
    # 128 experts x 2,048 are 64 programs per token block, each reading 8 KB of the gate.
    block_t, block_e, block_k = 16, 16, min(256, max(16, next_power_of_2(hidden)))
    split_e = triton.cdiv(num_experts, block_e)
    split_k = triton.cdiv(hidden, block_k)
    num_blocks = triton.cdiv(num_tokens, block_t)
    if split_e * split_k > 1:
        sync = zeroed_counters(device, num_blocks, "router_topk")
        part = torch.empty(num_tokens, split_k, num_experts, dtype=torch.float32, device=device)
    else:
        sync = part = ids  # not read
    pdl = pdl_supported(device)
    _router_topk_kernel[(num_blocks * split_e * split_k,)](
        x,
        gate,
        logits,
        part,
        weights,
        ids,
        expert_map if expert_map is not None else ids,
        skew if skew is not None else ids,
        sync,
        num_tokens,
        num_experts,
        hidden,
        x.stride(0),
        gate.stride(0),
        logits.stride(0),
        TOP_K=top_k,
        K_PAD=next_power_of_2(top_k),
        E_PAD=e_pad,
        BLOCK_T=block_t,
        BLOCK_E=block_e,
        BLOCK_K=block_k,
        SPLIT_E=split_e,
        SPLIT_K=split_k,
        RENORMALIZE=renormalize,
        HAS_MAP=expert_map is not None,
        HAS_SKEW=skew is not None,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        USE_PDL=pdl,
        num_warps=num_warps,
        launch_pdl=pdl,
    )
    return weights, ids, logits
