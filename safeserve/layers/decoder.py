"""A pre-norm decoder layer: `x + attn(norm(x))`, then `x + mlp(norm(x))`, with each residual
add fused into the next norm (one kernel fewer per block on CUDA)."""

from __future__ import annotations

import torch
from torch import nn

from safeserve.layers.norm import RMSNorm
from safeserve.layers.paged_attention import AttentionMetadata
from safeserve.parallel.schedule import Steps, drive


class DecoderLayer(nn.Module):
    def __init__(
        self, self_attn: nn.Module, mlp: nn.Module, hidden_size: int, eps: float, is_moe: bool
    ) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.is_moe = is_moe
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before it); the next layer's
        norm adds the two."""
        return drive(self.steps(x, residual, cos, sin, meta, kv_cache))

    def steps(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> Steps[tuple[torch.Tensor, torch.Tensor]]:
        """`forward` as a computation that yields while an MoE block's tokens move."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_norm(x, residual)
        h = self.self_attn(h, cos, sin, meta, kv_cache)
        h, residual = self.post_attention_layernorm.add_norm(h, residual)
        if hasattr(self.mlp, "steps"):
            return (yield from self.mlp.steps(h)), residual
        return self.mlp(h), residual
