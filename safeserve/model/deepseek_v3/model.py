"""DeepSeek-V3 over the paged KV cache, with transformers' numerics (RMSNorm in float32, RoPE from
float32 angles, the router GEMM and its sigmoid group-limited top-k in float32), so float32
logits agree within 1e-4."""

from __future__ import annotations

from torch import nn

from safeserve.layers.mla import MLAttention
from safeserve.layers.rotary import RotaryEmbedding, yarn_mscale
from safeserve.model.base import CausalLM
from safeserve.model.blocks import decoder_layers, dense_mlp, moe_layer
from safeserve.model.deepseek_v3.spec import DeepseekV3Config
from safeserve.model.sharding import head_split
from safeserve.moe.dispatch.base import Dispatcher
from safeserve.moe.topk import RouterConfig
from safeserve.parallel.comm import Comm
from safeserve.parallel.layout import Layout


def softmax_scale(cfg: DeepseekV3Config) -> float:
    """qk_head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim) squared where
    `mscale_all_dim` is set (transformers' `yarn_apply_mscale`)."""
    scale = cfg.qk_head_dim**-0.5
    if cfg.rope.type != "default" and cfg.rope.mscale_all_dim:
        m = yarn_mscale(cfg.rope.factor, cfg.rope.mscale_all_dim)
        scale *= m * m
    return scale


def mla_attention(cfg: DeepseekV3Config, layout: Layout, comm: Comm) -> MLAttention:
    """This rank's attention: its heads of q_b / kv_b / o, the latent projections whole."""
    return MLAttention(
        cfg.hidden_size,
        head_split(cfg, layout).num_heads,
        cfg.q_lora_rank,
        cfg.kv_lora_rank,
        cfg.qk_nope_head_dim,
        cfg.qk_rope_head_dim,
        cfg.v_head_dim,
        softmax_scale(cfg),
        comm,
        reduce=layout.attn_tp_size > 1,
        rope_interleave=cfg.rope_interleave,
        bias=cfg.attention_bias,
    )


def router_config(cfg: DeepseekV3Config) -> RouterConfig:
    """transformers' `DeepseekV3TopkRouter`: float32 logits, sigmoid scores, the choice by
    score + `e_score_correction_bias` among the best `topk_group` groups, weights from the
    unbiased scores, renormalized (`norm_topk_prob`) and scaled."""
    return RouterConfig(
        cfg.num_experts_per_tok,
        cfg.norm_topk_prob,
        scoring="sigmoid",
        n_group=cfg.n_group,
        topk_group=cfg.topk_group,
        correction_bias=True,
        routed_scaling_factor=cfg.routed_scaling_factor,
        logits_fp32=True,
    )


class DeepseekV3ForCausalLM(CausalLM):
    def __init__(
        self, cfg: DeepseekV3Config, layout: Layout, comm: Comm, dispatcher: Dispatcher
    ) -> None:
        router = router_config(cfg)

        def mlp(i: int) -> nn.Module:
            if not cfg.is_moe_layer(i):
                return dense_mlp(cfg, layout, comm)
            shared = None
            if cfg.n_shared_experts:
                shared = dense_mlp(cfg, layout, comm, cfg.shared_intermediate_size)
            return moe_layer(cfg, layout, dispatcher, router, shared)

        layers = decoder_layers(cfg, lambda i: mla_attention(cfg, layout, comm), mlp)
        super().__init__(cfg, layers, RotaryEmbedding(cfg.qk_rope_head_dim, cfg.rope))
        self.layout = layout
        self.dispatcher = dispatcher
