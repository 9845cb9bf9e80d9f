"""Multi-head latent attention (DeepSeek-V2/V3) over the paged KV cache, in the latent space.

Per token the cache keeps one vector `[latent ‖ k_pe]` (`kv_lora_rank` + `qk_rope_head_dim`
entries; the values are its first `kv_lora_rank`, a view: `KVSpec(v_in_k=True)`), shared by all
heads. The per-head keys and values transformers expands from it through `kv_b_proj` are never
built: `kv_b_proj`'s key rows are absorbed into the query (q_nope @ W_UK: a latent-space query,
concatenated with the rotated q_pe), attention runs over the cached vectors as over one KV head,
and its latent-space output goes through `kv_b_proj`'s value rows (W_UV), then `o_proj`. The
same scores as `q_nope·k_nope + q_pe·k_pe` of transformers' `DeepseekV3Attention`, up to float
rounding.

Heads are split across the attention-TP ranks (q_b/q and kv_b rows by head, o columns by head,
one all-reduce); the latent projections (q_a, kv_a and their norms) are replicated, so every
rank stores the same cache. `kv_b_proj` keeps its weight as loaded; the absorbed matrices are
views of it, taken in the forward. The cache entry (normed latent, rotated rope key, stored at the token's slot) and the
latent-space query are built by `safeserve.kernels.mla_prepare` (two launches on CUDA); `attend`
runs the MLA kernels over the latent cache on CUDA (`safeserve.kernels.mla_attention`, in CUDA
graphs too) and per-sequence SDPA elsewhere.
"""

from __future__ import annotations

import torch
from torch import nn

from safeserve.kernels.linear import linear
from safeserve.kernels.mla_prepare import latent_query, store_latent_entry
from safeserve.layers.linear import fuse_linears, project
from safeserve.layers.norm import RMSNorm
from safeserve.layers.paged_attention import AttentionMetadata, attend
from safeserve.parallel.comm import Comm

# transformers builds `q_a_layernorm` and `kv_a_layernorm` with RMSNorm's default eps, not the
# config's `rms_norm_eps`.
LATENT_NORM_EPS = 1e-6


class MLAttention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        scale: float,
        comm: Comm,
        reduce: bool,
        rope_interleave: bool = True,
        bias: bool = False,
    ) -> None:
        """`num_heads`: this rank's heads; `scale`: the softmax scale (qk_head_dim ** -0.5 and
        YaRN's correction); `reduce`: all-reduce o's partial sums (heads split across ranks);
        `bias`: transformers' `attention_bias` (q_a, kv_a and o biases; o's added after the
        all-reduce)."""
        super().__init__()
        self.num_heads = num_heads
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.nope, self.rope, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.scale = scale
        self.comm = comm
        self.reduce = reduce
        self.rope_interleave = rope_interleave
        qk = qk_nope_head_dim + qk_rope_head_dim
        if q_lora_rank is None:
            self.q_proj: nn.Linear | None = nn.Linear(hidden_size, num_heads * qk, bias=False)
            self.q_a_proj: nn.Linear | None = None
            self.q_a_layernorm: RMSNorm | None = None
            self.q_b_proj: nn.Linear | None = None
        else:
            self.q_proj = None
            self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(q_lora_rank, num_heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(
            kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(num_heads * v_head_dim, hidden_size, bias=False)
        self.o_bias = nn.Parameter(torch.zeros(hidden_size), requires_grad=False) if bias else None
        # q_a|kv_a (or q|kv_a) as one GEMM once `fuse_projections` ran.
        self.a_weight: torch.Tensor | None = None
        self.a_bias: torch.Tensor | None = None

    def fuse_projections(self) -> None:
        # Both read the layer's input: q_a|kv_a with a q LoRA, else q|kv_a (where their biases
        # agree: transformers gives q_proj none, kv_a one with attention_bias).
        first = self.q_a_proj if self.q_a_proj is not None else self.q_proj
        assert first is not None
        if (first.bias is None) == (self.kv_a_proj_with_mqa.bias is None):
            self.a_weight, self.a_bias = fuse_linears([first, self.kv_a_proj_with_mqa])

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [T, heads * qk_head_dim], compressed kv [T, kv_lora_rank + qk_rope_head_dim])."""
        kv_rows = self.kv_a_proj_with_mqa.weight.shape[0]
        if self.q_proj is not None:
            if self.a_weight is not None:
                q, kv = linear(x, self.a_weight, self.a_bias).split(
                    [self.q_proj.weight.shape[0], kv_rows], dim=-1
                )
                return q, kv
            return self.q_proj(x), self.kv_a_proj_with_mqa(x)
        assert self.q_a_proj is not None and self.q_a_layernorm is not None
        assert self.q_b_proj is not None
        if self.a_weight is not None:
            q_a, kv = linear(x, self.a_weight, self.a_bias).split(
                [self.q_a_proj.weight.shape[0], kv_rows], dim=-1
            )
        else:
            q_a, kv = self.q_a_proj(x), self.kv_a_proj_with_mqa(x)
        q_b = self.q_b_proj
        return project(q_b, self.q_a_layernorm(q_a)), kv

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        t, heads, lat = x.shape[0], self.num_heads, self.kv_lora_rank
        q, kv = self._project(x)
        q_nope, q_pe = q.view(t, heads, self.nope + self.rope).split([self.nope, self.rope], -1)
        norm = self.kv_a_layernorm
        store_latent_entry(
            kv, norm.weight, norm.eps, cos, sin, self.rope_interleave, kv_cache[0],
            meta.slot_mapping,
        )  # fmt: skip
        # kv_b_proj rows by head: nope key rows (W_UK) then value rows (W_UV), [lat] columns.
        w = self.kv_b_proj.weight.view(heads, self.nope + self.v_dim, lat)
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope :]
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, heads, lat]
        query = latent_query(q_latent, q_pe, cos, sin, self.rope_interleave)
        out = attend(query, kv_cache, meta, self.scale)  # [T, heads, lat]
        out = torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2))  # [heads, T, v]
        out = project(self.o_proj, out.transpose(0, 1).reshape(t, heads * self.v_dim))
        if self.reduce:
            out = self.comm.all_reduce(out)
        if self.o_bias is not None:
            out = out + self.o_bias
        return out
