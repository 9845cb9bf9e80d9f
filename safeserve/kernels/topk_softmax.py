"""Router top-k: softmax over the experts in float32, the top k, optional renormalisation, and
the logical -> physical expert-id map, in one Triton kernel (`fused_topk_softmax`), with its
torch references (`softmax_topk`, the routers' CPU path; `topk_softmax_torch`; `skew_ids`, the
route-skew fault injection as the kernels apply it). `router_topk`, which for decode-sized batches also runs
the router GEMM in that launch, is in `safeserve.kernels.router_topk`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from safeserve.kernels.common import (
    HAS_TRITON,
    next_power_of_2,
    pdl_supported,
    pdl_wait,
    tl,
    triton,
    use_kernels,
)


def softmax_topk(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts in float32, take the top k, optionally renormalize them to sum to 1."""
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(out_dtype), ids


def skew_ids(ids: torch.Tensor, skew: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Route skew (fault injection), as the router kernels apply it: where skew[0] >= 0, every
    row's ids become skew, skew + 1, ... (mod num_experts); else `ids` unchanged. No host sync."""
    top_k = ids.shape[-1]
    skewed = (skew + torch.arange(top_k, device=ids.device)) % num_experts
    return torch.where(skew >= 0, skewed.to(ids.dtype).expand_as(ids), ids)


def topk_softmax_torch(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for `fused_topk_softmax`: float32 weights, int32 ids."""
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
    Reference: `topk_softmax_torch` (+ `skew_ids`).
    """
    if not use_kernels(router_logits):
        weights, ids = topk_softmax_torch(router_logits, top_k, renormalize)
        if skew is not None:
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
