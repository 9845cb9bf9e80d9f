"""Rotary position embeddings: default, and YaRN (frequency interpolation by band, and an
attention-scale factor folded into cos/sin), with transformers' numerics (float32 angles)."""

from __future__ import annotations

import math
from typing import Protocol

import torch
from torch import nn


class RopeConfig(Protocol):
    """What the embedding reads of a model's rotary settings (`model.config.RopeConfig`)."""

    theta: float
    type: str
    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    mscale: float
    mscale_all_dim: float
    attention_factor: float | None
    truncate: bool


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inv_frequencies(dim: int, rope: RopeConfig) -> tuple[torch.Tensor, float]:
    """The inverse frequencies of `dim` rotary dimensions, and the factor cos/sin carry."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    if rope.type == "default":
        return 1.0 / (rope.theta**exponents), 1.0
    if rope.type != "yarn":
        raise ValueError(f"rope_type {rope.type!r}")
    factor, base = rope.factor, rope.theta
    if rope.attention_factor is not None:
        attention = rope.attention_factor
    elif rope.mscale and rope.mscale_all_dim:
        attention = yarn_mscale(factor, rope.mscale) / yarn_mscale(factor, rope.mscale_all_dim)
    else:
        attention = yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        orig = rope.original_max_position_embeddings
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # the share of the original frequency, by dimension
    pos_freqs = base**exponents
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, attention


class RotaryEmbedding(nn.Module):
    def __init__(self, dim: int, rope: RopeConfig) -> None:
        super().__init__()
        self.dim = dim
        self.rope = rope
        inv_freq, self.attention_scaling = inv_frequencies(dim, rope)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def reset_buffers(self, device: torch.device | str) -> None:
        """Recomputes the frequencies on `device` (after the model left the meta device)."""
        self.inv_freq = inv_frequencies(self.dim, self.rope)[0].to(device)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, dim] in `dtype` (rotate-half layout: each frequency twice)."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)
