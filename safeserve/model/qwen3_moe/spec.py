"""Qwen3-MoE's config, weight specification and KV-cache specification (no torch).

Grouped-query attention with per-head q/k RMSNorm, softmax top-k routing, dense layers where
`mlp_only_layers` or `decoder_sparse_step` say so. Experts are read as transformers saves them
(`mlp.experts.{e}.gate_proj.weight`, ...) or in the fused 3-D form (`mlp.experts.gate_up_proj`).
"""

from __future__ import annotations

from typing import Any

from safeserve.model.config import ModelConfig, SparseStepConfig
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

MODEL = "safeserve.model.qwen3_moe.model:Qwen3MoeForCausalLM"


class Qwen3MoeConfig(SparseStepConfig):
    pass


# What transformers' Qwen3MoeConfig fills in for a field config.json leaves out that changes what
# the weights compute (a shape it leaves out is the checkpoint's to say: a wrong one is refused).
DEFAULTS: dict[str, Any] = dict(
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=False,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=32768,
)


def parse_config(d: dict[str, Any]) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        **ModelConfig.common(d, defaults=DEFAULTS), **SparseStepConfig.sparse_fields(d)
    )


def weight_specs(
    cfg: ModelConfig, layout: Layout, expert_map: ExpertMap | None = None
) -> WeightSpecs:
    specs = embedding_specs(cfg)
    h = cfg.hidden_size
    for i in range(cfg.num_hidden_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        specs |= gqa_attention_specs(cfg, layout, ours + "self_attn.", hf + "self_attn.", True)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            specs[ours + norm + ".weight"] = whole((h,), hf + norm + ".weight")
        if cfg.is_moe_layer(i):
            specs[ours + "mlp.gate.weight"] = whole((cfg.num_experts, h), hf + "mlp.gate.weight")
            specs |= routed_expert_specs(
                cfg,
                layout,
                ours + "mlp.experts.",
                hf + "mlp.experts.",
                layer=i,
                expert_map=expert_map,
            )
        else:
            specs |= dense_mlp_specs(cfg, layout, ours + "mlp.", hf + "mlp.")
    return specs


def kv_spec(cfg: ModelConfig, layout: Layout) -> KVSpec:
    heads = head_split(cfg, layout).num_kv_heads
    return KVSpec(cfg.num_hidden_layers, heads, cfg.head_dim, cfg.head_dim)
