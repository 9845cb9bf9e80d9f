"""Several linears of one input fused into one weight, so they run as one GEMM."""

from __future__ import annotations

import torch
from torch import nn


def fuse_linears(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for several linears of the same input.

    The linears' parameters become views of the fused tensors: loaders and `load_state_dict`
    keep filling them by name (and each rank's shard slices stay per projection).
    """
    weight = torch.cat([m.weight.detach() for m in linears])
    has_bias = linears[0].bias is not None
    bias = torch.cat([m.bias.detach() for m in linears]) if has_bias else None  # type: ignore[misc]
    start = 0
    for m in linears:
        rows = m.weight.shape[0]
        m.weight = nn.Parameter(weight[start : start + rows], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[start : start + rows], requires_grad=False)
        start += rows
    return weight, bias
