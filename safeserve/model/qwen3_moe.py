"""Qwen3-MoE (`model_type: qwen3_moe`) over a paged KV cache.

The numerics follow transformers' implementation (RMSNorm in float32, RoPE computed from float32
angles, softmax top-k routing in float32) so that float32 logits agree within 1e-4. On CUDA the
small ops run fused (`safeserve.kernels.norm_rope`: residual add + RMSNorm; q/k norm + RoPE + KV
store) and q|k|v is one GEMM; the CPU path runs the same math in torch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from safeserve.engine.attention import AttentionMetadata, attend
from safeserve.engine.parallel import Comm, Layout
from safeserve.kernels import norm_rope as nr
from safeserve.kernels.linear import linear
from safeserve.kernels.qkv_rope import qkv_norm_rope_store
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
        return nr.rms_norm(x, self.weight, self.eps)[0]

    def add_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual) in one kernel on CUDA."""
        return nr.rms_norm(x, self.weight, self.eps, residual)


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


def fuse_linears(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for several linears of the same input, so they run as one GEMM.

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
        # q|k|v as one GEMM once `fuse_projections` ran (the loader calls it).
        self.qkv_weight: torch.Tensor | None = None
        self.qkv_bias: torch.Tensor | None = None

    def fuse_projections(self) -> None:
        self.qkv_weight, self.qkv_bias = fuse_linears([self.q_proj, self.k_proj, self.v_proj])

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        t = x.shape[0]
        k_cache, v_cache = kv_cache
        norm_rope = (self.q_norm.weight, self.k_norm.weight, cos, sin, self.q_norm.eps)
        heads = (self.num_heads, self.num_kv_heads, k_cache, v_cache, meta.slot_mapping)
        if self.qkv_weight is not None:  # decode batches: one launch (`qkv_norm_rope_store`)
            q = qkv_norm_rope_store(x, self.qkv_weight, self.qkv_bias, *norm_rope, *heads)
        else:
            qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
            q = nr.qk_norm_rope_store(qkv, *norm_rope, *heads)
        out = attend(q, kv_cache, meta, self.scale)
        out = linear(out.reshape(t, self.num_heads * self.head_dim), self.o_proj.weight)
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
        self.gate_up_weight: torch.Tensor | None = None

    def fuse_projections(self) -> None:
        self.gate_up_weight = fuse_linears([self.gate_proj, self.up_proj])[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is not None:
            gate, up = F.linear(x, self.gate_up_weight).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        out = self.down_proj(F.silu(gate) * up)
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

    def forward(  # type: ignore[no-untyped-def]
        self, x: torch.Tensor, residual: torch.Tensor | None, cos, sin, meta, kv_cache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before it); the next layer's
        norm adds the two (the model's `x + mlp(norm(x))`, one kernel fewer)."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_norm(x, residual)
        h = self.self_attn(h, cos, sin, meta, kv_cache)
        h, residual = self.post_attention_layernorm.add_norm(h, residual)
        return self.mlp(h), residual


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
        residual: torch.Tensor | None = None
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, cos, sin, meta, kv)
        if residual is None:  # no layers
            return self.norm(x)
        return self.norm.add_norm(x, residual)[0]

    def fuse_projections(self) -> None:
        """q|k|v (and dense gate|up) as one GEMM each; call once the parameters are allocated."""
        for layer in self.layers:
            layer.self_attn.fuse_projections()
            if not layer.is_moe:
                layer.mlp.fuse_projections()

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
