"""A SiLU-gated MLP (`down(silu(gate(x)) * up(x))`), split by FFN width across the
attention-TP ranks (one all-reduce), replicated with attention data-parallel. Dense layers and
shared experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from safeserve.kernels.linear import linear
from safeserve.layers.linear import BlockFp8Linear, fuse_fp8_linears, fuse_linears, project
from safeserve.parallel.comm import Comm


class DenseMLP(nn.Module):
    # block-FP8 gate|up as one linear (`fuse_fp8_linears`), outside the module tree
    gate_up_fp8: BlockFp8Linear | None = None

    def __init__(self, hidden_size: int, width: int, comm: Comm, reduce: bool) -> None:
        """`width`: this rank's share of the FFN width; `reduce`: all-reduce the partial sums
        (the width is split across ranks)."""
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, width, bias=False)
        self.up_proj = nn.Linear(hidden_size, width, bias=False)
        self.down_proj = nn.Linear(width, hidden_size, bias=False)
        self.comm = comm
        self.reduce = reduce
        self.gate_up_weight: torch.Tensor | None = None

    def fuse_projections(self) -> None:
        self.gate_up_weight = fuse_linears([self.gate_proj, self.up_proj])[0]
        object.__setattr__(self, "gate_up_fp8", fuse_fp8_linears([self.gate_proj, self.up_proj]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # `linear`: the skinny Triton GEMM for decode-sized batches on CUDA, else F.linear
        if self.gate_up_weight is not None:
            gate, up = linear(x, self.gate_up_weight).chunk(2, dim=-1)
        elif self.gate_up_fp8 is not None:
            gate, up = self.gate_up_fp8(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        out = project(self.down_proj, F.silu(gate) * up)
        return self.comm.all_reduce(out) if self.reduce else out
