"""DeepSeek-V3's config, weight specification and KV-cache specification (no torch).

As transformers 5.24's `modeling_deepseek_v3.py` computes it: multi-head latent attention (MLA;
a q LoRA `q_a_proj` -> `q_a_layernorm` -> `q_b_proj`, or one `q_proj` where `q_lora_rank` is
None; `kv_a_proj_with_mqa` to the latent and the shared rotary key, `kv_b_proj` back to per-head
keys and values), RoPE (default or YaRN) on `qk_rope_head_dim` dimensions, interleaved or not
(`rope_interleave`); dense layers below `first_k_dense_replace`, MoE layers above with
`n_shared_experts` shared experts and sigmoid routing within the best `topk_group` of `n_group`
expert groups, steered by `e_score_correction_bias`, scaled by `routed_scaling_factor`.

The KV cache holds one vector per token and layer, `[latent ‖ rotated k_pe]`, shared by every
head (and replicated on the attention-TP ranks): attention runs in the latent space.
Weights are read as transformers saves them: experts per expert (`mlp.experts.{e}.gate_proj.
weight`, ...) or in the fused 3-D form (`mlp.experts.gate_up_proj`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from safeserve.model.config import ModelConfig, ModelConfigError
from safeserve.model.sharding import (
    dense_mlp_specs,
    embedding_specs,
    head_split,
    linear,
    routed_expert_specs,
    whole,
)
from safeserve.model.spec import KVSpec, Slice, WeightSpecs
from safeserve.moe.expert_map import ExpertMap
from safeserve.parallel.layout import Layout

MODEL = "safeserve.model.deepseek_v3.model:DeepseekV3ForCausalLM"

# transformers' `DeepseekV3Config` defaults of the keys a config.json may leave out.
DEFAULTS: dict[str, Any] = dict(
    intermediate_size=18432,
    moe_intermediate_size=2048,
    n_shared_experts=1,
    n_routed_experts=256,
    routed_scaling_factor=2.5,
    kv_lora_rank=512,
    q_lora_rank=1536,
    qk_rope_head_dim=64,
    v_head_dim=128,
    qk_nope_head_dim=128,
    n_group=8,
    topk_group=4,
    num_experts_per_tok=8,
    first_k_dense_replace=3,
    norm_topk_prob=True,
    rope_interleave=True,
)


@dataclass
class DeepseekV3Config(ModelConfig):
    q_lora_rank: int | None = None  # None: one q_proj
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    n_shared_experts: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    rope_interleave: bool = True

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.n_shared_experts

    def is_moe_layer(self, layer: int) -> bool:
        """Dense below `first_k_dense_replace`, MoE from there on (every `moe_layer_freq`-th
        layer, DeepSeek's rule; parse_config accepts 1 only, which transformers assumes)."""
        return (
            self.num_experts > 0
            and layer >= self.first_k_dense_replace
            and layer % self.moe_layer_freq == 0
        )

    def check(self) -> None:
        super().check()
        e, g, k = self.num_experts, self.n_group, self.topk_group
        if self.num_key_value_heads != self.num_attention_heads:
            raise ModelConfigError(
                f"num_key_value_heads {self.num_key_value_heads} must equal "
                f"num_attention_heads {self.num_attention_heads} for multi-head latent attention"
            )
        if self.qk_rope_head_dim % 2:
            raise ModelConfigError("qk_rope_head_dim must be even for RoPE")
        if e % g:
            raise ModelConfigError(f"n_group {g} must divide n_routed_experts {e}")
        if g > 1 and e // g < 2:
            raise ModelConfigError(
                "an expert group needs at least 2 experts (its score: the best 2)"
            )
        if not 1 <= k <= g:
            raise ModelConfigError(f"topk_group {k} must be in [1, n_group {g}]")
        if self.num_experts_per_tok > k * (e // g):
            raise ModelConfigError(
                f"num_experts_per_tok {self.num_experts_per_tok} exceeds the experts of "
                f"topk_group {k} groups ({k * (e // g)})"
            )


def _refuse_unless(ok: bool, message: str) -> None:
    if not ok:
        raise ModelConfigError(message)


def _rope_parameters(d: dict[str, Any]) -> dict[str, Any]:
    """The rope dict as transformers standardizes it for DeepSeek-V3 (`standardize_rope_params`):
    a top-level `original_max_position_embeddings` wins; YaRN needs its `factor` (the attention
    reads it for the softmax-scale correction)."""
    rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    kind = rope.get("rope_type") or rope.get("type") or "default"
    partial = rope.get("partial_rotary_factor", d.get("partial_rotary_factor"))
    _refuse_unless(partial in (None, 1, 1.0), "partial_rotary_factor is not supported")
    if kind == "yarn":
        _refuse_unless(rope.get("factor") is not None, "YaRN rope needs its 'factor'")
        if d.get("original_max_position_embeddings"):
            rope["original_max_position_embeddings"] = d["original_max_position_embeddings"]
    return rope


def parse_config(d: dict[str, Any]) -> DeepseekV3Config:
    scoring = d.get("scoring_func") or "sigmoid"
    _refuse_unless(scoring == "sigmoid", f"scoring_func {scoring!r} is not supported (sigmoid)")
    method = d.get("topk_method") or "noaux_tc"
    _refuse_unless(method == "noaux_tc", f"topk_method {method!r} is not supported (noaux_tc)")
    freq = d.get("moe_layer_freq") or 1
    _refuse_unless(freq == 1, f"moe_layer_freq {freq} is not supported (1)")
    full = {**DEFAULTS, **d}  # an explicit null stays null (q_lora_rank)
    experts = d.get("n_routed_experts", d.get("num_local_experts", DEFAULTS["n_routed_experts"]))
    _refuse_unless(bool(experts), "deepseek_v3 needs n_routed_experts")
    _refuse_unless(full["v_head_dim"] is not None, "deepseek_v3 needs v_head_dim")
    q_lora = full["q_lora_rank"]
    _refuse_unless(q_lora is None or q_lora > 0, f"q_lora_rank {q_lora} must be positive or null")
    rope = _rope_parameters(d)
    kw = ModelConfig.common({**full, "rope_parameters": rope}, rope_types=("default", "yarn"))
    # model_type: the family, which the registry dispatches on (Kimi K2 says `kimi_k2` and
    # `DeepseekV3ForCausalLM`); head_dim: what transformers' config sets (the rotary dims)
    kw |= dict(
        model_type="deepseek_v3",
        raw=d,
        num_experts=int(experts),
        head_dim=full["qk_rope_head_dim"],
    )
    return DeepseekV3Config(
        **kw,
        q_lora_rank=q_lora,
        kv_lora_rank=full["kv_lora_rank"],
        qk_nope_head_dim=full["qk_nope_head_dim"],
        qk_rope_head_dim=full["qk_rope_head_dim"],
        v_head_dim=full["v_head_dim"],
        n_shared_experts=full["n_shared_experts"] or 0,
        n_group=full["n_group"] or 1,
        topk_group=full["topk_group"] or 1,
        routed_scaling_factor=float(full["routed_scaling_factor"]),
        first_k_dense_replace=full["first_k_dense_replace"] or 0,
        moe_layer_freq=freq,
        rope_interleave=bool(full["rope_interleave"]),
    )


def mla_specs(cfg: DeepseekV3Config, layout: Layout, ours: str, hf: str) -> WeightSpecs:
    """MLA's projections: the latent ones (q_a, kv_a and their norms) replicated, q_b (or q),
    kv_b split by head rows, o_proj by head columns (its bias added once, after the
    all-reduce)."""
    h, n = cfg.hidden_size, cfg.num_attention_heads
    heads = head_split(cfg, layout)
    h0, h1 = heads.q_start, heads.q_start + heads.num_heads
    qk, kv_b, v = cfg.qk_head_dim, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.v_head_dim
    lat, rope = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    specs: WeightSpecs = {}
    if cfg.q_lora_rank is None:
        specs[ours + "q_proj.weight"] = linear(
            (n * qk, h), Slice(0, h0 * qk, h1 * qk), hf + "q_proj.weight"
        )
    else:
        r = cfg.q_lora_rank
        specs[ours + "q_a_proj.weight"] = linear((r, h), Slice(), hf + "q_a_proj.weight")
        specs[ours + "q_a_layernorm.weight"] = whole((r,), hf + "q_a_layernorm.weight")
        specs[ours + "q_b_proj.weight"] = linear(
            (n * qk, r), Slice(0, h0 * qk, h1 * qk), hf + "q_b_proj.weight"
        )
        if cfg.attention_bias:
            specs[ours + "q_a_proj.bias"] = whole((r,), hf + "q_a_proj.bias")
    specs[ours + "kv_a_proj_with_mqa.weight"] = linear(
        (lat + rope, h), Slice(), hf + "kv_a_proj_with_mqa.weight"
    )
    specs[ours + "kv_a_layernorm.weight"] = whole((lat,), hf + "kv_a_layernorm.weight")
    # absorbed into the query and the output (`layers/mla.py`), so held dequantized
    specs[ours + "kv_b_proj.weight"] = linear(
        (n * kv_b, lat), Slice(0, h0 * kv_b, h1 * kv_b), hf + "kv_b_proj.weight", True
    )
    specs[ours + "o_proj.weight"] = linear(
        (h, n * v), Slice(1, h0 * v, h1 * v), hf + "o_proj.weight"
    )
    if cfg.attention_bias:
        specs[ours + "kv_a_proj_with_mqa.bias"] = whole(
            (lat + rope,), hf + "kv_a_proj_with_mqa.bias"
        )
        specs[ours + "o_bias"] = whole((h,), hf + "o_proj.bias")
    return specs


def weight_specs(
    cfg: ModelConfig, layout: Layout, expert_map: ExpertMap | None = None
) -> WeightSpecs:
    assert isinstance(cfg, DeepseekV3Config)
    specs = embedding_specs(cfg)
    h, e = cfg.hidden_size, cfg.num_experts
    for i in range(cfg.num_hidden_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        specs |= mla_specs(cfg, layout, ours + "self_attn.", hf + "self_attn.")
        for norm in ("input_layernorm", "post_attention_layernorm"):
            specs[ours + norm + ".weight"] = whole((h,), hf + norm + ".weight")
        if not cfg.is_moe_layer(i):
            specs |= dense_mlp_specs(cfg, layout, ours + "mlp.", hf + "mlp.")
            continue
        gate = "mlp.gate."  # in float32, as the router's GEMM (`router_config`: logits_fp32)
        specs[ours + gate + "weight"] = whole((e, h), hf + gate + "weight", float32=True)
        specs[ours + gate + "e_score_correction_bias"] = whole(
            (e,), hf + gate + "e_score_correction_bias", float32=True
        )
        specs |= routed_expert_specs(
            cfg,
            layout,
            ours + "mlp.experts.",
            hf + "mlp.experts.",
            layer=i,
            expert_map=expert_map,
        )
        if cfg.n_shared_experts:
            specs |= dense_mlp_specs(
                cfg,
                layout,
                ours + "mlp.shared_experts.",
                hf + "mlp.shared_experts.",
                width=cfg.shared_intermediate_size,
                what="moe_intermediate_size * n_shared_experts",
            )
    return specs


def kv_spec(cfg: ModelConfig, layout: Layout) -> KVSpec:
    """One latent vector per token: `kv_lora_rank` latent entries (the values) then the rotated
    `qk_rope_head_dim` key entries, one "head", on every attention rank."""
    assert isinstance(cfg, DeepseekV3Config)
    head_split(cfg, layout)  # the heads must split over the attention-TP ranks
    width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    return KVSpec(cfg.num_hidden_layers, 1, width, cfg.kv_lora_rank, v_in_k=True)
