"""Grouped top-k with a correction bias, as DeepSeek-V3 routes: float32 sigmoid or softmax
scores, the choice by score + bias among the best `topk_group` of `n_group` expert groups (a
group's score: the sum of its two best choice values), weights from the unbiased scores,
optionally renormalised, scaled; then the route skew and the logical -> physical id map. One
Triton kernel (`fused_grouped_topk`) and its torch reference (`grouped_topk_torch`, the routers'
CPU path)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from safeserve.kernels.common import (
    HAS_TRITON,
    batch_invariant,
    next_power_of_2,
    pdl_supported,
    pdl_wait,
    tl,
    triton,
    use_kernels,
)
from safeserve.kernels.topk_softmax import _topk_outputs, skew_ids

# transformers' DeepSeek-V3 router adds this to the renormalisation's denominator
RENORMALIZE_EPS = 1e-20


def grouped_topk_torch(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    scoring: str = "softmax",
    n_group: int = 1,
    topk_group: int = 1,
    bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
    out_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores (softmax or sigmoid, float32), the choice among the best `topk_group` groups by
    score + bias, weights from the unbiased scores (renormalized, scaled). As transformers'
    DeepSeek-V3 router does it. Returns (weights [T, k] in `out_dtype`, ids [T, k] int64)."""
    logits = router_logits.float()
    if scoring == "sigmoid":
        scores = logits.sigmoid()
    else:
        scores = F.softmax(logits, dim=-1, dtype=torch.float32)
    choice = scores if bias is None else scores + bias.float()[None, :]
    if n_group > 1:
        t, e = choice.shape
        grouped = choice.view(t, n_group, e // n_group)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        keep = torch.topk(group_scores, topk_group, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(group_scores).scatter_(1, keep, 1.0)
        mask = mask.unsqueeze(-1).expand(t, n_group, e // n_group).reshape(t, e)
        # -inf, not 0: sigmoid scores plus a negative bias are below 0, and a dropped
        # group's expert must never win over a kept one (transformers masks with -inf).
        choice = choice.masked_fill(mask == 0, float("-inf"))
    ids = torch.topk(choice, top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + RENORMALIZE_EPS)
    weights = weights * routed_scaling_factor
    return weights.to(out_dtype), ids


if HAS_TRITON:

    @triton.jit(do_not_specialize=["num_tokens"])
    def _grouped_topk_kernel(
        logits_ptr,
        bias_ptr,
        w_ptr,
        ids_ptr,
        map_ptr,
        skew_ptr,
        num_tokens,
        num_experts,
        n_group,
        group_size,
        stride_lt,
        scaling,
        TOP_K: tl.constexpr,
        K_PAD: tl.constexpr,
        TOPK_GROUP: tl.constexpr,
        G_PAD: tl.constexpr,
        GS_PAD: tl.constexpr,
        BLOCK_T: tl.constexpr,
        SIGMOID: tl.constexpr,
        GROUPED: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        RENORMALIZE: tl.constexpr,
        HAS_MAP: tl.constexpr,
        HAS_SKEW: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        """BLOCK_T tokens' routing, each token one row of G_PAD * GS_PAD columns: column
        g * GS_PAD + j holds expert g * group_size + j (j < group_size, g < n_group), so each
        group is a power-of-two run of columns (a group of 9 experts takes 16) and the groups'
        reductions run on the [BLOCK_T, G_PAD, GS_PAD] view of the same row. Without groups
        (n_group 1) it is expert c at column c.

        Selection by repeated argmax; exact ties go to the lower expert id (and group). A
        dropped group's experts (and NaN choices) sit at DROPPED, a finite value below any
        real choice; taken experts and padding columns at -inf, below that: so a token's k ids
        are always k distinct experts, even for non-finite logits (a NaN row gets NaN weights).
        The weights are the unbiased scores of the chosen experts, recomputed from their
        logits. HAS_SKEW: as `topk_softmax._softmax_topk_store`'s (fault injection, read at
        run time).
        """
        DROPPED: tl.constexpr = -1e38
        E_PAD: tl.constexpr = G_PAD * GS_PAD
        cols = tl.arange(0, E_PAD)
        grp = cols // GS_PAD
        expert = grp * group_size + cols % GS_PAD
        col_ok = (grp < n_group) & (cols % GS_PAD < group_size)
        if HAS_BIAS:  # a weight: read before the wait
            bias = tl.load(bias_ptr + expert, mask=col_ok, other=0.0).to(tl.float32)
        pdl_wait(USE_PDL)
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        row_ok = rows < num_tokens
        l_rows = logits_ptr + rows.to(tl.int64) * stride_lt
        # rows past the batch read 0 (not -inf: no NaN anywhere); they are not stored
        x = tl.load(
            l_rows[:, None] + expert[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0
        ).to(tl.float32)
        if SIGMOID:
            scores = tl.sigmoid(x)
        else:
            x_max = tl.max(tl.where(col_ok[None, :], x, -float("inf")), axis=1)
            p = tl.where(col_ok[None, :], tl.exp(x - x_max[:, None]), 0.0)
            p_sum = tl.sum(p, axis=1)
            scores = p / p_sum[:, None]
        choice = scores
        if HAS_BIAS:
            choice = choice + bias[None, :]
        choice = tl.where(choice == choice, choice, DROPPED)  # NaN
        choice = tl.where(col_ok[None, :], choice, -float("inf"))
        if GROUPED:
            gcols = tl.arange(0, G_PAD)
            jcols = tl.arange(0, GS_PAD)
            view = tl.reshape(choice, [BLOCK_T, G_PAD, GS_PAD])
            best, best_j = tl.max(view, axis=2, return_indices=True)
            second = tl.max(
                tl.where(jcols[None, None, :] == best_j[:, :, None], -float("inf"), view), axis=2
            )
            group_score = tl.where(gcols[None, :] < n_group, best + second, -float("inf"))
            keep = tl.zeros([BLOCK_T, G_PAD], dtype=tl.int1)
            for _ in tl.static_range(TOPK_GROUP):
                g = tl.argmax(group_score, axis=1, tie_break_left=True)
                hit = gcols[None, :] == g[:, None]
                keep = keep | hit
                group_score = tl.where(hit, -float("inf"), group_score)
            view = tl.where(keep[:, :, None] | (view == -float("inf")), view, DROPPED)
            choice = tl.reshape(view, [BLOCK_T, E_PAD])
        kcols = tl.arange(0, K_PAD)
        top_c = tl.zeros([BLOCK_T, K_PAD], dtype=tl.int32)
        for i in tl.static_range(TOP_K):
            c = tl.argmax(choice, axis=1, tie_break_left=True).to(tl.int32)
            top_c = tl.where(kcols[None, :] == i, c[:, None], top_c)
            choice = tl.where(cols[None, :] == c[:, None], -float("inf"), choice)
        # column -> expert (clamped: no load out of bounds, whatever was picked)
        top_e = tl.minimum((top_c // GS_PAD) * group_size + top_c % GS_PAD, num_experts - 1)
        mask = row_ok[:, None] & (kcols[None, :] < TOP_K)
        xk = tl.load(l_rows[:, None] + top_e, mask=mask, other=0.0).to(tl.float32)
        if SIGMOID:
            top_w = tl.sigmoid(xk)
        else:
            top_w = tl.exp(xk - x_max[:, None]) / p_sum[:, None]
        top_w = tl.where(kcols[None, :] < TOP_K, top_w, 0.0)
        if RENORMALIZE:
            top_w = top_w / (tl.sum(top_w, axis=1)[:, None] + 1e-20)
        top_w = top_w * scaling
        if HAS_SKEW:
            skew = tl.load(skew_ptr)
            skewed = ((skew + kcols) % num_experts).to(tl.int32)
            top_e = tl.where(skew >= 0, skewed[None, :], top_e)
        if HAS_MAP:  # logical -> physical expert id
            top_e = tl.load(map_ptr + top_e, mask=mask, other=0)
        offs = rows[:, None].to(tl.int64) * TOP_K + kcols[None, :]
        tl.store(w_ptr + offs, top_w.to(w_ptr.dtype.element_ty), mask=mask)
        tl.store(ids_ptr + offs, top_e.to(ids_ptr.dtype.element_ty), mask=mask)


def check_grouping(num_experts: int, top_k: int, n_group: int, topk_group: int) -> None:
    """Raise ValueError unless the groups divide the experts and the kept groups hold top_k."""
    if n_group < 1 or num_experts % n_group:
        raise ValueError(f"n_group={n_group} does not divide {num_experts} experts")
    group_size = num_experts // n_group
    if n_group > 1 and group_size < 2:
        raise ValueError(f"groups of {group_size} expert: a group's score takes its best two")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group={topk_group} not in [1, n_group={n_group}]")
    kept = num_experts if n_group == 1 else topk_group * group_size
    if not 1 <= top_k <= kept:
        raise ValueError(f"top_k={top_k} not in [1, {kept}] (the experts of the kept groups)")


def fused_grouped_topk(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    scoring: str = "softmax",
    n_group: int = 1,
    topk_group: int = 1,
    bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
    weights_dtype: torch.dtype = torch.float32,
    expert_map: torch.Tensor | None = None,
    skew: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`grouped_topk_torch`'s routing in one kernel, then the skew and the id map.

    router_logits [T, E] (any float dtype; the math is float32); `bias` [E] (the correction
    bias, float32 or any float dtype) steers the choice only. Returns (weights [T, k] in
    `weights_dtype`, ids [T, k]): ids int32, or, with `expert_map` ([E], logical -> physical),
    the mapped ids in the map's dtype. `skew` as `fused_topk_softmax`'s. No host
    synchronisation and nothing allocated but the outputs (CUDA-graph safe). Where the kernels
    do not run, `grouped_topk_torch` + `skew_ids` + the map.
    """
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"scoring {scoring!r}: softmax or sigmoid")
    num_tokens, num_experts = router_logits.shape
    check_grouping(num_experts, top_k, n_group, topk_group)
    if not use_kernels(router_logits):
        weights, ids = grouped_topk_torch(
            router_logits,
            top_k,
            renormalize,
            scoring,
            n_group,
            topk_group,
            bias,
            routed_scaling_factor,
            weights_dtype,
        )
        if skew is not None:
            ids = skew_ids(ids, skew, num_experts)
        if expert_map is not None:
            return weights, expert_map[ids]
        return weights, ids.to(torch.int32)
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    device = logits.device
    weights, ids = _topk_outputs(num_tokens, top_k, weights_dtype, expert_map, device)
    if num_tokens == 0:
        return weights, ids
    group_size = num_experts // n_group
    g_pad, gs_pad = next_power_of_2(n_group), next_power_of_2(group_size)
    e_pad = g_pad * gs_pad
    # batch-invariant mode: one token a program whatever the batch (one reduction layout)
    block_t = (
        1 if batch_invariant() else max(1, min(16, 2048 // e_pad, next_power_of_2(num_tokens)))
    )
    pdl = pdl_supported(device)
    _grouped_topk_kernel[(triton.cdiv(num_tokens, block_t),)](
        logits,
        bias.contiguous() if bias is not None else logits,
        weights,
        ids,
        expert_map if expert_map is not None else ids,
        skew if skew is not None else ids,
        num_tokens,
        num_experts,
        n_group,
        group_size,
        logits.stride(0),
        float(routed_scaling_factor),
        TOP_K=top_k,
        K_PAD=next_power_of_2(top_k),
        TOPK_GROUP=topk_group,
        G_PAD=g_pad,
        GS_PAD=gs_pad,
        BLOCK_T=block_t,
        SIGMOID=scoring == "sigmoid",
        GROUPED=1 < n_group and topk_group < n_group,
        HAS_BIAS=bias is not None,
        RENORMALIZE=renormalize,
        HAS_MAP=expert_map is not None,
        HAS_SKEW=skew is not None,
        USE_PDL=pdl,
        # one warp up to 256 values (a decode token of 256 experts): no shared memory
        num_warps=1 if e_pad * block_t <= 256 else (4 if e_pad * block_t <= 2048 else 8),
        launch_pdl=pdl,
    )
    return weights, ids
