"""The torch reference of the fused MoE (`fused_moe.py`): the experts' CPU path and the kernel's
test oracle."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class Workspace(Protocol):
    """Preallocated activation buffers, each with at least as many rows as any expert gets."""

    expert_out: torch.Tensor
    work_x: torch.Tensor
    work_gate_up: torch.Tensor
    work_act: torch.Tensor
    work_y: torch.Tensor


def pairs_by_expert(
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, list[int]] | None:
    """The routed (token, expert) pairs (ids -1 skipped) grouped by expert, in token order
    within an expert: each pair's token index, its weight `[pairs, 1]`, and the pairs per
    expert; None when there are none."""
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1)
    pair_idx = torch.nonzero(flat_ids >= 0).squeeze(1)
    if pair_idx.numel() == 0:
        return None
    expert_ids = flat_ids[pair_idx]
    order = torch.argsort(expert_ids, stable=True)
    pair_idx, expert_ids = pair_idx[order], expert_ids[order]
    pair_w = topk_weights.reshape(-1)[pair_idx].unsqueeze(1)
    counts = torch.bincount(expert_ids, minlength=num_experts).tolist()
    return pair_idx // top_k, pair_w, counts


def grouped_experts_torch(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    workspace: Workspace | None = None,
) -> torch.Tensor:
    """Reference path: sort (token, slot) pairs by expert, one GEMM pair per expert with tokens.

    hidden_states [N, H]; w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I];
    topk_ids [N, k] local expert ids or -1 (skip); topk_weights [N, k].
    Returns [N, H] = sum over valid slots of weight * down(silu(gate(x)) * up(x)).
    With a `workspace` (admission's preallocated buffers, `guards.admission.DispatchBuffers`) no activation memory is allocated:
    one expert's rows never exceed the budget, since a row holds each expert at most once.
    """
    num_tokens = topk_ids.shape[0]
    if workspace is not None:
        out = workspace.expert_out[:num_tokens]
        out.zero_()
    else:
        out = torch.zeros_like(hidden_states)
    pairs = pairs_by_expert(topk_ids, topk_weights, w13.shape[0])
    if pairs is None:
        return out
    token_idx, pair_w, counts = pairs
    if workspace is None:
        x = hidden_states[token_idx]
        y = torch.empty_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            seg = slice(start, start + count)
            gate, up = F.linear(x[seg], w13[expert]).chunk(2, dim=-1)
            y[seg] = F.linear(F.silu(gate) * up, w2[expert])
            start += count
        out.index_add_(0, token_idx, y * pair_w.to(y.dtype))
        return out
    width = w2.shape[2]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        seg = slice(start, start + count)
        rows = token_idx[seg]
        xe = torch.index_select(hidden_states, 0, rows, out=workspace.work_x[:count])
        gate_up = torch.mm(xe, w13[expert].t(), out=workspace.work_gate_up[:count])
        gate = F.silu(gate_up[:, :width], inplace=True)
        act = torch.mul(gate, gate_up[:, width:], out=workspace.work_act[:count])
        ye = torch.mm(act, w2[expert].t(), out=workspace.work_y[:count])
        ye.mul_(pair_w[seg].to(ye.dtype))
        out.index_add_(0, rows, ye)
        start += count
    return out
