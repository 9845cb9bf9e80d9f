"""Qwen3-MoE (`model_type: qwen3_moe`) over a paged KV cache.

The numerics follow transformers' implementation (RMSNorm in float32, RoPE computed from float32
angles, softmax top-k routing in float32) so that float32 logits agree within 1e-4.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from safeserve.engine.attention import AttentionMetadata, paged_attention
from safeserve.engine.parallel import Comm, Layout
from safeserve.model.config import ModelConfig
from safeserve.model.sharding import dense_split, expert_split, head_split
from safeserve.moe.dispatch.base import Dispatcher
from safeserve.moe.layer import MoELayer


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (
            theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, D]."""
    return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]


class Attention(nn.Module):
    """Tensor-parallel over heads: column-parallel q/k/v, row-parallel o, one all-reduce."""

    def __init__(self, cfg: ModelConfig, layer_id: int, layout: Layout, comm: Comm) -> None:
        super().__init__()
        self.layer_id = layer_id
        split = head_split(cfg, layout)
        self.num_heads = split.num_heads
        self.num_kv_heads = split.num_kv_heads
        self.head_dim = cfg.head_dim
        self.comm = comm
        self.reduce = layout.attn_tp_size > 1
        h, d, bias = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        # Added once, after the all-reduce of the partial o_proj outputs.
        self.o_bias = nn.Parameter(torch.zeros(h), requires_grad=False) if bias else None
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.scale = d**-0.5

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(t, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(t, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = paged_attention(q, k, v, kv_cache, meta, self.scale)
        out = self.o_proj(out.reshape(t, self.num_heads * self.head_dim))
        if self.reduce:
            out = self.comm.all_reduce(out)
        if self.o_bias is not None:
            out = out + self.o_bias
        return out


class DenseMLP(nn.Module):
    """Split by FFN width across attention-TP ranks (replicated with attention-DP)."""

    def __init__(self, cfg: ModelConfig, layout: Layout, comm: Comm) -> None:
        super().__init__()
        start, stop = dense_split(cfg, layout)
        width, h = stop - start, cfg.hidden_size
        self.gate_proj = nn.Linear(h, width, bias=False)
        self.up_proj = nn.Linear(h, width, bias=False)
        self.down_proj = nn.Linear(width, h, bias=False)
        self.comm = comm
        self.reduce = layout.attn_tp_size > 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.comm.all_reduce(out) if self.reduce else out


class DecoderLayer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, layer_id: int, layout: Layout, comm: Comm, dispatcher: Dispatcher
    ) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_id, layout, comm)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.is_moe = cfg.is_moe_layer(layer_id)
        self.mlp: nn.Module
        if self.is_moe:
            placement, i0, i1 = expert_split(cfg, layout)
            self.mlp = MoELayer(
                cfg.hidden_size,
                i1 - i0,
                cfg.num_experts,
                cfg.num_experts_per_tok,
                cfg.norm_topk_prob,
                placement,
                dispatcher,
            )
        else:
            self.mlp = DenseMLP(cfg, layout, comm)

    def forward(self, x, cos, sin, meta, kv_cache) -> torch.Tensor:  # type: ignore[no-untyped-def]
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3MoeForCausalLM(nn.Module):
    def __init__(
        self, cfg: ModelConfig, layout: Layout, comm: Comm, dispatcher: Dispatcher
    ) -> None:
        super().__init__()
        self.config = cfg
        self.layout = layout
        self.dispatcher = dispatcher
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, layout, comm, dispatcher) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        for p in self.parameters():
            p.requires_grad_(False)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Returns the final hidden states [T, H] of every scheduled token."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, meta, kv)
        return self.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
