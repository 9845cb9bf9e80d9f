"""Our Qwen2-MoE against transformers' own, through the paged KV cache, in float32; the
start-up checkpoint check on its shared-expert and bias tensors."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from checkpoints_families import (
    write_qwen2_moe_checkpoint,
)
from model_checks import assert_check_names, paged_logits_match_transformers, variant_checkpoint

from safeserve.model import registry
from safeserve.model.config import ModelConfigError
from safeserve.model.loader import check_checkpoint, load_model_config
from safeserve.model.sharding import LayoutError
from safeserve.parallel.layout import Layout

# Shapes and options that change the code path: dense layers by `decoder_sparse_step`,
# renormalized top-k, one KV head; no q/k/v biases, a tied head and sharded files.
VARIANTS = {
    "default": {},
    "sparse_step_2_norm_mqa": dict(
        decoder_sparse_step=2,
        mlp_only_layers=[],
        norm_topk_prob=True,
        num_experts_per_tok=2,
        num_key_value_heads=1,
    ),
    "sharded_no_bias_tied": dict(
        num_hidden_layers=2,
        hidden_size=48,
        shared_expert_intermediate_size=24,
        mlp_only_layers=[],
        qkv_bias=False,
        tie_word_embeddings=True,
    ),
}


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_qwen2_moe_checkpoint(tmp_path_factory.mktemp("qwen2_moe") / "good", seed=3)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_transformers_prefill_and_decode(
    variant: str, good: Path, tmp_path: Path
) -> None:
    write = write_qwen2_moe_checkpoint
    ckpt = variant_checkpoint(write, good, tmp_path, variant, VARIANTS[variant])
    paged_logits_match_transformers(ckpt)


def test_reads_q_k_v_biases_the_shared_expert_and_its_gate(good: Path) -> None:
    from safetensors import safe_open

    check_checkpoint(str(good), load_model_config(str(good)))
    cfg = load_model_config(str(good))
    assert [cfg.is_moe_layer(i) for i in range(3)] == [True, False, True]
    assert cfg.attention_bias and not cfg.norm_topk_prob
    specs = registry.weight_specs(cfg, Layout())
    attn = "layers.0.self_attn."
    assert {attn + p + ".bias" for p in ("q_proj", "k_proj", "v_proj")} <= set(specs)
    assert attn + "o_bias" not in specs  # o_proj has no bias
    gate = specs["layers.2.mlp.shared_expert_gate.weight"]
    assert (gate.shape, gate.source) == ((1, 64), "model.layers.2.mlp.shared_expert_gate.weight")
    up = specs["layers.0.mlp.shared_experts.up_proj.weight"]
    assert (up.shape, up.source) == ((40, 64), "model.layers.0.mlp.shared_expert.up_proj.weight")
    assert "layers.1.mlp.shared_experts.up_proj.weight" not in specs  # the dense layer
    with safe_open(str(good / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.layers.0.self_attn.k_proj.bias").abs().min() > 0
        assert "model.layers.0.self_attn.o_proj.bias" not in f.keys()


@pytest.mark.parametrize(
    "name,edit",
    [
        ("model.layers.0.mlp.shared_expert_gate.weight", "drop"),
        ("model.layers.2.mlp.shared_expert.down_proj.weight", "drop"),
        ("model.layers.2.self_attn.v_proj.bias", "drop"),
        ("model.layers.0.mlp.experts.5.gate_proj.weight", "drop"),
        ("model.layers.0.mlp.shared_expert.up_proj.weight", "truncate"),
        ("model.layers.1.mlp.gate_proj.weight", "truncate"),
    ],
)
def test_check_names_a_missing_or_misshapen_tensor(
    good: Path, tmp_path: Path, name: str, edit: str
) -> None:
    assert_check_names(good, tmp_path, name, edit)


def test_config_rules() -> None:
    base = dict(
        vocab_size=10,
        hidden_size=8,
        intermediate_size=12,
        moe_intermediate_size=4,
        shared_expert_intermediate_size=6,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
    )
    cfg = registry.parse_config({**base, "architectures": ["Qwen2MoeForCausalLM"]})
    assert cfg.model_type == "qwen2_moe"
    assert cfg.attention_bias and not cfg.norm_topk_prob  # transformers' defaults
    cfg = registry.parse_config(
        {**base, "model_type": "qwen2_moe", "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    )
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, False, False]
    assert not registry.parse_config(
        {**base, "model_type": "qwen2_moe", "qkv_bias": False}
    ).attention_bias
    with pytest.raises(ModelConfigError, match="shared_expert_intermediate_size"):
        registry.parse_config(
            {k: v for k, v in base.items() if k != "shared_expert_intermediate_size"}
            | {"model_type": "qwen2_moe"}
        )
    with pytest.raises(ModelConfigError, match="sliding-window"):
        registry.parse_config(
            {**base, "model_type": "qwen2_moe", "use_sliding_window": True, "sliding_window": 8}
        )
    with pytest.raises(LayoutError, match="must divide shared_expert_intermediate_size 6"):
        registry.check_layout(
            replace(cfg, num_attention_heads=4, num_key_value_heads=4), Layout(0, 4, 4)
        )
