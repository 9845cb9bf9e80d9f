"""Grouped-query attention over the paged KV cache, tensor-parallel over heads: column-parallel
q/k/v, row-parallel o, one all-reduce. Optional per-head q/k RMSNorm (Qwen3), optional q/k/v/o
biases (o's added once, after the all-reduce).

On CUDA with q/k norm the projections run as one GEMM and the norm, RoPE and KV store as one
launch (`safeserve.kernels.qkv_rope`, `norm_rope`); without q/k norm RoPE runs in torch and the
store is the paged-attention store kernel. The CPU path is the same math in torch.
"""

from __future__ import annotations

import torch
from torch import nn

from safeserve.kernels import norm_rope as nr
from safeserve.kernels import paged_attention as pa
from safeserve.kernels.linear import gemm
from safeserve.kernels.qkv_rope import qkv_norm_rope_store
from safeserve.layers.linear import BlockFp8Linear, fuse_fp8_linears, fuse_linears, project
from safeserve.layers.norm import RMSNorm
from safeserve.layers.paged_attention import AttentionMetadata, attend
from safeserve.parallel.comm import Comm


class GQAttention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        comm: Comm,
        reduce: bool,
        bias: bool = False,
        qk_norm_eps: float | None = None,
        o_bias: bool = True,
    ) -> None:
        """`num_heads` / `num_kv_heads`: this rank's heads; `reduce`: all-reduce o's partial
        sums (heads split across ranks); `qk_norm_eps`: per-head q/k RMSNorm (None: none);
        `bias`: q/k/v biases, and o's too unless `o_bias` is False (Qwen2-MoE)."""
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = d = head_dim
        self.comm = comm
        self.reduce = reduce
        self.q_proj = nn.Linear(hidden_size, num_heads * d, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(num_heads * d, hidden_size, bias=False)
        self.o_bias = (
            nn.Parameter(torch.zeros(hidden_size), requires_grad=False) if bias and o_bias else None
        )
        self.q_norm = RMSNorm(d, qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(d, qk_norm_eps) if qk_norm_eps is not None else None
        self.scale = d**-0.5
        # q|k|v as one GEMM once `fuse_projections` ran (the loader calls it).
        self.qkv_weight: torch.Tensor | None = None
        self.qkv_bias: torch.Tensor | None = None

    # block-FP8 q|k|v as one linear (`fuse_fp8_linears`), outside the module tree
    qkv_fp8: BlockFp8Linear | None = None

    def fuse_projections(self) -> None:
        parts = [self.q_proj, self.k_proj, self.v_proj]
        self.qkv_weight, self.qkv_bias = fuse_linears(parts)
        object.__setattr__(self, "qkv_fp8", fuse_fp8_linears(parts))

    def _qkv(self, x: torch.Tensor) -> torch.Tensor:
        if self.qkv_weight is not None:
            return gemm(x, self.qkv_weight, self.qkv_bias)
        if self.qkv_fp8 is not None:
            return self.qkv_fp8(x)
        return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        k_cache, v_cache = kv_cache
        heads = (self.num_heads, self.num_kv_heads, k_cache, v_cache, meta.slot_mapping)
        if self.q_norm is not None and self.k_norm is not None:
            norm_rope = (self.q_norm.weight, self.k_norm.weight, cos, sin, self.q_norm.eps)
            if self.qkv_weight is not None:  # one launch on CUDA (`qkv_norm_rope_store`)
                q = qkv_norm_rope_store(x, self.qkv_weight, self.qkv_bias, *norm_rope, *heads)
            else:
                q = nr.qk_norm_rope_store(self._qkv(x), *norm_rope, *heads)
        else:
            hq, hkv = self.num_heads * d, self.num_kv_heads * d
            q, k, v = self._qkv(x).split([hq, hkv, hkv], dim=-1)
            q = nr.apply_rope(q.reshape(t, self.num_heads, d), cos, sin)
            k = nr.apply_rope(k.reshape(t, self.num_kv_heads, d), cos, sin)
            pa.store_kv(k, v.reshape(t, self.num_kv_heads, d), k_cache, v_cache, meta.slot_mapping)
        out = attend(q, kv_cache, meta, self.scale)
        out = project(self.o_proj, out.reshape(t, self.num_heads * d))
        if self.reduce:
            out = self.comm.all_reduce(out)
        if self.o_bias is not None:
            out = out + self.o_bias
        return out
