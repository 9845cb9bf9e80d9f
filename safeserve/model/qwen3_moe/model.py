"""Qwen3-MoE over the paged KV cache, with transformers' numerics (RMSNorm in float32, RoPE from
float32 angles, softmax top-k routing in float32), so float32 logits agree within 1e-4."""

from __future__ import annotations

from safeserve.layers.rotary import RotaryEmbedding
from safeserve.model.base import CausalLM
from safeserve.model.blocks import decoder_layers, dense_mlp, gqa_attention, moe_layer
from safeserve.model.config import ModelConfig
from safeserve.moe.dispatch.base import Dispatcher
from safeserve.moe.topk import RouterConfig
from safeserve.parallel.comm import Comm
from safeserve.parallel.layout import Layout


class Qwen3MoeForCausalLM(CausalLM):
    def __init__(
        self, cfg: ModelConfig, layout: Layout, comm: Comm, dispatcher: Dispatcher
    ) -> None:
        router = RouterConfig(cfg.num_experts_per_tok, cfg.norm_topk_prob)
        layers = decoder_layers(
            cfg,
            lambda i: gqa_attention(cfg, layout, comm, qk_norm=True, bias=cfg.attention_bias),
            lambda i: (
                moe_layer(cfg, layout, dispatcher, router)
                if cfg.is_moe_layer(i)
                else dense_mlp(cfg, layout, comm)
            ),
        )
        super().__init__(cfg, layers, RotaryEmbedding(cfg.head_dim, cfg.rope))
        self.layout = layout
        self.dispatcher = dispatcher
