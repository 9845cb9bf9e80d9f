"""The router GEMM and its top-k in one launch (`router_topk`) for decode-sized batches; larger
batches take a library GEMM and `fused_topk_softmax`. The softmax/top-k math and its stores are
`topk_softmax`'s, shared by both kernels."""

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
from safeserve.kernels.topk_softmax import _topk_outputs, fused_topk_softmax

if HAS_TRITON:
    from safeserve.kernels.topk_softmax import _softmax_topk_store

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
