"""RMSNorm, with the residual add of the previous block fused in (one kernel on CUDA)."""

from __future__ import annotations

import torch
from torch import nn

from safeserve.kernels import norm_rope as nr


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nr.rms_norm(x, self.weight, self.eps)[0]

    def add_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual) in one kernel on CUDA."""
        return nr.rms_norm(x, self.weight, self.eps, residual)
