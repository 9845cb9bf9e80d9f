"""Stage 3: run every local expert over the tokens routed to it.

On CUDA the experts run as the Triton fused MoE (`safeserve.kernels.fused_moe`: no host sync,
CUDA-graph safe); elsewhere, the torch path below, which is also that kernel's test oracle.
Block-FP8 experts with 128 x 128 blocks run the W8A8 fused MoE (`kernels.fused_moe_fp8`) where
the Triton kernels run (CUDA, or the interpreter); elsewhere, and for other blocks, the torch
reference of `kernels.fp8_reference` (activations in high precision).
"""

from __future__ import annotations

import torch

from safeserve.kernels import fused_moe as fm
from safeserve.kernels.common import use_kernels
from safeserve.kernels.fp8_quant import GROUP
from safeserve.kernels.fp8_reference import FP8, grouped_experts_fp8
from safeserve.kernels.fused_moe_fp8 import fused_moe_fp8
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
        self.block: tuple[int, int] | None = None  # block FP8 (`use_fp8`)

    def use_fp8(self, block: tuple[int, int]) -> None:
        """Holds the experts as block FP8: w13 and w2 in float8_e4m3fn (on their device,
        typically meta, before allocation) and their float32 scales per tile, w13's
        `[slots, 2 * ceil(I / b0), ceil(H / b1)]` (gate's tiles, then up's) and w2's
        `[slots, ceil(H / b0), ceil(I / b1)]`."""
        slots, two_i, h = self.w13.shape
        i = two_i // 2
        b0, b1 = block
        with self.w13.device:
            self.w13 = torch.nn.Parameter(torch.empty_like(self.w13, dtype=FP8), False)
            self.w2 = torch.nn.Parameter(torch.empty_like(self.w2, dtype=FP8), False)
            self.w13_scale_inv = torch.nn.Parameter(
                torch.empty(slots, 2 * -(-i // b0), -(-h // b1)), requires_grad=False
            )
            self.w2_scale_inv = torch.nn.Parameter(
                torch.empty(slots, -(-h // b0), -(-i // b1)), requires_grad=False
            )
        self.block = block

    def forward(self, d: DispatchOutput) -> CombineInput:
        if self.block == (GROUP, GROUP) and use_kernels(d.hidden_states):
            y = fused_moe_fp8(
                d.hidden_states,
                self.w13,
                self.w13_scale_inv,
                self.w2,
                self.w2_scale_inv,
                d.topk_weights,
                d.topk_ids,
            )
            return CombineInput(y, d.handle)
        if self.block is not None:
            ws = d.workspace
            out = ws.expert_out[: d.hidden_states.shape[0]] if ws is not None else None
            y = grouped_experts_fp8(
                d.hidden_states,
                self.w13,
                self.w13_scale_inv,
                self.w2,
                self.w2_scale_inv,
                d.topk_ids,
                d.topk_weights,
                self.block,
                out,
            )
            return CombineInput(y, d.handle)
        if d.hidden_states.is_cuda and fm.HAS_TRITON:
            # Its buffers scale with the received rows, which admission already bounds.
            y = fm.fused_moe(d.hidden_states, self.w13, self.w2, d.topk_weights, d.topk_ids)
            return CombineInput(y, d.handle)
        y = grouped_experts_torch(
            d.hidden_states, self.w13, self.w2, d.topk_ids, d.topk_weights, d.workspace
        )
        return CombineInput(y, d.handle)
