"""Qwen2-MoE over the paged KV cache, with transformers' numerics (RMSNorm in float32, RoPE from
float32 angles, softmax top-k routing in float32), so float32 logits agree within 1e-4. The
shared expert runs on every rank like a dense MLP (split by width across the attention-TP
ranks) and is added, scaled by sigmoid(shared_expert_gate(x)), to the routed output."""

from __future__ import annotations

from torch import nn

from safeserve.layers.rotary import RotaryEmbedding
from safeserve.model.base import CausalLM
from safeserve.model.blocks import decoder_layers, dense_mlp, gqa_attention, moe_layer
from safeserve.model.config import ModelConfig
from safeserve.model.qwen2_moe.spec import Qwen2MoeConfig
from safeserve.moe.dispatch.base import Dispatcher
from safeserve.moe.topk import RouterConfig
from safeserve.parallel.comm import Comm
from safeserve.parallel.layout import Layout


class Qwen2MoeForCausalLM(CausalLM):
    def __init__(
        self, cfg: ModelConfig, layout: Layout, comm: Comm, dispatcher: Dispatcher
    ) -> None:
        assert isinstance(cfg, Qwen2MoeConfig)
        router = RouterConfig(cfg.num_experts_per_tok, cfg.norm_topk_prob)

        def mlp(i: int) -> nn.Module:
            if not cfg.is_moe_layer(i):
                return dense_mlp(cfg, layout, comm)
            shared = dense_mlp(cfg, layout, comm, cfg.shared_expert_intermediate_size)
            return moe_layer(cfg, layout, dispatcher, router, shared=shared, shared_gate=True)

        layers = decoder_layers(
            cfg,
            lambda i: gqa_attention(
                cfg, layout, comm, qk_norm=False, bias=cfg.attention_bias, o_bias=False
            ),
            mlp,
        )
        super().__init__(cfg, layers, RotaryEmbedding(cfg.head_dim, cfg.rope))
        self.layout = layout
        self.dispatcher = dispatcher
