"""Stage 3: run every local expert over the tokens routed to it.

On CUDA the experts run as the Triton fused MoE (`safeserve.kernels.fused_moe`: no host sync,
CUDA-graph safe); elsewhere, the torch path below, which is also that kernel's test oracle.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from safeserve.guards.admission import DispatchBuffers
from safeserve.kernels import fused_moe as fm
from safeserve.moe.dispatch.base import CombineInput, DispatchOutput


def grouped_experts_torch(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    workspace: DispatchBuffers | None = None,
) -> torch.Tensor:
    """Reference path: sort (token, slot) pairs by expert, one GEMM pair per expert with tokens.

    hidden_states [N, H]; w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I];
    topk_ids [N, k] local expert ids or -1 (skip); topk_weights [N, k].
    Returns [N, H] = sum over valid slots of weight * down(silu(gate(x)) * up(x)).
    With a `workspace` (admission's preallocated buffers) no activation memory is allocated:
    one expert's rows never exceed the budget, since a row holds each expert at most once.
    """
    num_tokens, top_k = topk_ids.shape
    if workspace is not None:
        out = workspace.expert_out[:num_tokens]
        out.zero_()
    else:
        out = torch.zeros_like(hidden_states)
    flat_ids = topk_ids.reshape(-1)
    pair_idx = torch.nonzero(flat_ids >= 0).squeeze(1)
    if pair_idx.numel() == 0:
        return out
    expert_ids = flat_ids[pair_idx]
    order = torch.argsort(expert_ids, stable=True)
    pair_idx, expert_ids = pair_idx[order], expert_ids[order]
    token_idx = pair_idx // top_k
    pair_w = topk_weights.reshape(-1)[pair_idx].unsqueeze(1)
    counts = torch.bincount(expert_ids, minlength=w13.shape[0]).tolist()
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


class ExpertRunner(torch.nn.Module):
    """Holds this rank's experts as two stacked weights and computes them in groups."""

    def __init__(self, num_local_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.w13 = torch.nn.Parameter(
            torch.empty(num_local_experts, 2 * intermediate_size, hidden_size), requires_grad=False
        )
        self.w2 = torch.nn.Parameter(
            torch.empty(num_local_experts, hidden_size, intermediate_size), requires_grad=False
        )

    def forward(self, d: DispatchOutput) -> CombineInput:
        if d.hidden_states.is_cuda and fm.HAS_TRITON:
            # Its buffers scale with the received rows, which admission already bounds.
            y = fm.fused_moe(d.hidden_states, self.w13, self.w2, d.topk_weights, d.topk_ids)
            return CombineInput(y, d.handle)
        y = grouped_experts_torch(
            d.hidden_states, self.w13, self.w2, d.topk_ids, d.topk_weights, d.workspace
        )
        return CombineInput(y, d.handle)
