"""Qwen2-MoE's config, weight specification and KV-cache specification (no torch).

Grouped-query attention with q/k/v biases (`qkv_bias`, transformers' default True) and none on
o, no q/k norm; softmax top-k routing (renormalized with `norm_topk_prob`, default False) plus a
shared expert of width `shared_expert_intermediate_size` scaled by sigmoid(`shared_expert_gate`);
dense layers of width `intermediate_size` where `mlp_only_layers` or `decoder_sparse_step` say
so. Experts are read as transformers saves them (`mlp.experts.{e}.gate_proj.weight`, ...) or in
the fused 3-D form (`mlp.experts.gate_up_proj`); the shared expert from `mlp.shared_expert.*`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from safeserve.model.config import ModelConfig, ModelConfigError, SparseStepConfig
from safeserve.model.sharding import (
    dense_mlp_specs,
    embedding_specs,
    gqa_attention_specs,
    head_split,
    routed_expert_specs,
    whole,
)
from safeserve.model.spec import KVSpec, WeightSpecs
from safeserve.moe.expert_map import ExpertMap
from safeserve.parallel.layout import Layout

MODEL = "safeserve.model.qwen2_moe.model:Qwen2MoeForCausalLM"


@dataclass
class Qwen2MoeConfig(SparseStepConfig):
    shared_expert_intermediate_size: int = 0

    @property
    def shared_intermediate_size(self) -> int:
        return self.shared_expert_intermediate_size


# What transformers' Qwen2MoeConfig fills in for a field config.json leaves out that changes what
# the weights compute (a shape it leaves out is the checkpoint's to say: a wrong one is refused).
DEFAULTS: dict[str, Any] = dict(
    num_experts=60,
    num_experts_per_tok=4,
    norm_topk_prob=False,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=32768,
)


def parse_config(d: dict[str, Any]) -> Qwen2MoeConfig:
    if "shared_expert_intermediate_size" not in d:
        raise ModelConfigError("config.json has no 'shared_expert_intermediate_size'")
    common = ModelConfig.common(d, defaults=DEFAULTS)
    return Qwen2MoeConfig(
        **common
        | dict(
            model_type="qwen2_moe",
            # q/k/v biases (o has none): `qkv_bias`, True where older configs do not say.
            attention_bias=bool(d.get("qkv_bias", True)),
        ),
        **SparseStepConfig.sparse_fields(d),
        shared_expert_intermediate_size=d["shared_expert_intermediate_size"],
    )


def weight_specs(
    cfg: ModelConfig, layout: Layout, expert_map: ExpertMap | None = None
) -> WeightSpecs:
    assert isinstance(cfg, Qwen2MoeConfig)
    specs = embedding_specs(cfg)
    h = cfg.hidden_size
    for i in range(cfg.num_hidden_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        specs |= gqa_attention_specs(
            cfg, layout, ours + "self_attn.", hf + "self_attn.", qk_norm=False, o_bias=False
        )
        for norm in ("input_layernorm", "post_attention_layernorm"):
            specs[ours + norm + ".weight"] = whole((h,), hf + norm + ".weight")
        if not cfg.is_moe_layer(i):
            specs |= dense_mlp_specs(cfg, layout, ours + "mlp.", hf + "mlp.")
            continue
        specs[ours + "mlp.gate.weight"] = whole((cfg.num_experts, h), hf + "mlp.gate.weight")
        specs |= routed_expert_specs(
            cfg,
            layout,
            ours + "mlp.experts.",
            hf + "mlp.experts.",
            layer=i,
            expert_map=expert_map,
        )
        specs |= dense_mlp_specs(
            cfg,
            layout,
            ours + "mlp.shared_experts.",
            hf + "mlp.shared_expert.",
            width=cfg.shared_expert_intermediate_size,
            what="shared_expert_intermediate_size",
        )
        gate = "mlp.shared_expert_gate.weight"
        specs[ours + gate] = whole((1, h), hf + gate)
    return specs


def kv_spec(cfg: ModelConfig, layout: Layout) -> KVSpec:
    heads = head_split(cfg, layout).num_kv_heads
    return KVSpec(cfg.num_hidden_layers, heads, cfg.head_dim, cfg.head_dim)
