"""Router top-k: softmax over the experts in float32, the top k, optional renormalisation, and
the logical -> physical expert-id map, in one Triton kernel (`fused_topk_softmax`), with its
torch reference (`topk_softmax_torch`)."""

from __future__ import annotations

import torch

from safeserve.kernels.common import HAS_TRITON, next_power_of_2, tl, triton, use_kernels


def topk_softmax_torch(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for `fused_topk_softmax`: float32 weights, int32 ids."""
    from safeserve.moe.topk import softmax_topk

    weights, ids = softmax_topk(router_logits, top_k, renormalize, torch.float32)
    return weights, ids.to(torch.int32)


if HAS_TRITON:

    @triton.jit(do_not_specialize=["num_tokens"])
    def _topk_softmax_kernel(
        logits_ptr,
        w_ptr,
        ids_ptr,
        map_ptr,
        num_tokens,
        num_experts,
        stride_lt,
        TOP_K: tl.constexpr,
        K_PAD: tl.constexpr,
        E_PAD: tl.constexpr,
        BLOCK_T: tl.constexpr,
        RENORMALIZE: tl.constexpr,
        HAS_MAP: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.arange(0, E_PAD)
        row_ok = rows < num_tokens
        col_ok = cols < num_experts
        x = tl.load(
            logits_ptr + rows[:, None].to(tl.int64) * stride_lt + cols[None, :],
            mask=row_ok[:, None] & col_ok[None, :],
            other=-float("inf"),
        ).to(tl.float32)
        x_max = tl.max(x, axis=1)
        p = tl.exp(x - x_max[:, None])
        p = tl.where(col_ok[None, :], p, 0.0)
        p = p / tl.sum(p, axis=1)[:, None]
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
        offs = rows[:, None].to(tl.int64) * TOP_K + kcols[None, :]
        mask = row_ok[:, None] & (kcols[None, :] < TOP_K)
        if HAS_MAP:  # logical -> physical expert id
            top_i = tl.load(map_ptr + top_i, mask=mask, other=0)
        tl.store(w_ptr + offs, top_w.to(w_ptr.dtype.element_ty), mask=mask)
        tl.store(ids_ptr + offs, top_i.to(ids_ptr.dtype.element_ty), mask=mask)


def fused_topk_softmax(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    weights_dtype: torch.dtype = torch.float32,
    expert_map: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts in float32, top k, optional renormalisation, in one kernel.

    Returns (weights [T, k] in `weights_dtype`, ids [T, k]): ids int32, or, with `expert_map`
    ([E] int64, logical -> physical), the mapped ids as int64, mapped inside the same kernel.
    Reference: `topk_softmax_torch`.
    """
    if not use_kernels(router_logits):
        weights, ids = topk_softmax_torch(router_logits, top_k, renormalize)
        if expert_map is not None:
            ids = expert_map[ids.to(torch.int64)]
        return weights.to(weights_dtype), ids
    num_tokens, num_experts = router_logits.shape
    if top_k > num_experts:
        raise ValueError(f"top_k={top_k} > {num_experts} experts")
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    device = logits.device
    weights = torch.empty(num_tokens, top_k, dtype=weights_dtype, device=device)
    ids_dtype = torch.int32 if expert_map is None else expert_map.dtype
    ids = torch.empty(num_tokens, top_k, dtype=ids_dtype, device=device)
    if num_tokens == 0:
        return weights, ids
    e_pad = next_power_of_2(num_experts)
    block_t = max(1, min(16, 2048 // e_pad, next_power_of_2(num_tokens)))
    _topk_softmax_kernel[(triton.cdiv(num_tokens, block_t),)](
        logits,
        weights,
        ids,
        expert_map if expert_map is not None else ids,
        num_tokens,
        num_experts,
        logits.stride(0),
        TOP_K=top_k,
        K_PAD=next_power_of_2(top_k),
        E_PAD=e_pad,
        BLOCK_T=block_t,
        RENORMALIZE=renormalize,
        HAS_MAP=expert_map is not None,
        # A decode step's few rows fit one warp: its reductions then need no shared memory.
        num_warps=1 if e_pad * block_t <= 256 else (4 if e_pad * block_t <= 2048 else 8),
    )
    return weights, ids
