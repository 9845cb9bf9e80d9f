"""Stage 3: run every local expert over the tokens routed to it.

On CUDA the experts run as the Triton fused MoE (`safeserve.kernels.fused_moe`: no host sync,
CUDA-graph safe); elsewhere, the torch path below, which is also that kernel's test oracle.
"""

from __future__ import annotations

import torch

from safeserve.kernels import fused_moe as fm
from safeserve.kernels.moe_reference import grouped_experts_torch
from safeserve.moe.dispatch.base import CombineInput, DispatchOutput


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
