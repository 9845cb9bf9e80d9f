"""Mixtral's config, weight specification and KV-cache specification (no torch).

Grouped-query attention without q/k norm or biases, every layer an MoE block: softmax top-k
routing, always renormalized. The experts' FFN width is the config's `intermediate_size`.
Weights are read as transformers saves them (it converts back to the original layout on
`save_pretrained`): `block_sparse_moe.gate.weight` and `block_sparse_moe.experts.{e}.w1`
(gate), `w3` (up), `w2` (down).
"""

from __future__ import annotations

from typing import Any

from safeserve.model.config import ModelConfig, ModelConfigError
from safeserve.model.sharding import (
    embedding_specs,
    gqa_attention_specs,
    head_split,
    routed_expert_specs,
    whole,
)
from safeserve.model.spec import KVSpec, WeightSpecs
from safeserve.moe.expert_map import ExpertMap
from safeserve.parallel.layout import Layout

MODEL = "safeserve.model.mixtral.model:MixtralForCausalLM"


# What transformers' MixtralConfig fills in for a field config.json leaves out that changes what
# the weights compute (a shape it leaves out is the checkpoint's to say: a wrong one is refused).
DEFAULTS: dict[str, Any] = dict(
    num_local_experts=8,
    num_experts_per_tok=2,
    rms_norm_eps=1e-5,
    rope_theta=1e6,
    max_position_embeddings=4096 * 32,
)


def parse_config(d: dict[str, Any]) -> ModelConfig:
    # transformers masks by `sliding_window` whenever it is set (there is no use_sliding_window).
    window = d.get("sliding_window")
    if window is not None and window < d.get(
        "max_position_embeddings", DEFAULTS["max_position_embeddings"]
    ):
        raise ModelConfigError(
            f"sliding-window attention is not supported (sliding_window {window})"
        )
    if "intermediate_size" not in d:
        raise ModelConfigError("config.json has no 'intermediate_size'")
    common = ModelConfig.common(d, defaults=DEFAULTS)
    return ModelConfig(
        **common
        | dict(
            model_type="mixtral",
            moe_intermediate_size=d["intermediate_size"],  # one expert's width
            norm_topk_prob=True,  # Mixtral always renormalizes its top k
            attention_bias=False,
        )
    )


def weight_specs(
    cfg: ModelConfig, layout: Layout, expert_map: ExpertMap | None = None
) -> WeightSpecs:
    specs = embedding_specs(cfg)
    h = cfg.hidden_size
    for i in range(cfg.num_hidden_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        specs |= gqa_attention_specs(cfg, layout, ours + "self_attn.", hf + "self_attn.", False)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            specs[ours + norm + ".weight"] = whole((h,), hf + norm + ".weight")
        moe = hf + "block_sparse_moe."
        specs[ours + "mlp.gate.weight"] = whole((cfg.num_experts, h), moe + "gate.weight")
        specs |= routed_expert_specs(
            cfg,
            layout,
            ours + "mlp.experts.",
            moe + "experts.",
            names=("w1", "w3", "w2"),
            layer=i,
            expert_map=expert_map,
        )
    return specs


def kv_spec(cfg: ModelConfig, layout: Layout) -> KVSpec:
    heads = head_split(cfg, layout).num_kv_heads
    return KVSpec(cfg.num_hidden_layers, heads, cfg.head_dim, cfg.head_dim)
