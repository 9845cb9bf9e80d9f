"""Our Mixtral against transformers' own, through the paged KV cache, in float32; the start-up
checkpoint check on Mixtral's tensor names."""

from __future__ import annotations

from pathlib import Path

import pytest
from checkpoints_families import (
    write_mixtral_checkpoint,
)
from model_checks import assert_check_names, paged_logits_match_transformers, variant_checkpoint

from safeserve.model import registry
from safeserve.model.config import ModelConfigError
from safeserve.model.loader import check_checkpoint, load_model_config
from safeserve.model.sharding import LayoutError
from safeserve.parallel.layout import Layout

# Shapes and options that change the code path: one KV head, a tied head and top-3 of 6
# experts, sharded safetensors files with other widths.
VARIANTS = {
    "default": {},
    "mqa_tied_top3": dict(
        num_key_value_heads=1, tie_word_embeddings=True, num_local_experts=6, num_experts_per_tok=3
    ),
    "sharded": dict(num_hidden_layers=2, hidden_size=48, intermediate_size=24, head_dim=12),
}


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_mixtral_checkpoint(tmp_path_factory.mktemp("mixtral") / "good", seed=3)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_transformers_prefill_and_decode(
    variant: str, good: Path, tmp_path: Path
) -> None:
    write = write_mixtral_checkpoint
    ckpt = variant_checkpoint(write, good, tmp_path, variant, VARIANTS[variant])
    paged_logits_match_transformers(ckpt)


def test_reads_the_layout_transformers_saves(good: Path) -> None:
    """transformers 5 holds Mixtral's experts fused (`mlp.experts.gate_up_proj`) but saves them
    in the original per-expert layout, which is what we read."""
    check_checkpoint(str(good), load_model_config(str(good)))
    cfg = load_model_config(str(good))
    assert (cfg.model_type, cfg.num_experts, cfg.moe_intermediate_size) == ("mixtral", 8, 32)
    assert cfg.norm_topk_prob and not cfg.attention_bias
    specs = registry.weight_specs(cfg, Layout())
    w13 = specs["layers.0.mlp.experts.w13"].source
    assert w13.expert_names(5) == (
        "model.layers.0.block_sparse_moe.experts.5.w1.weight",
        "model.layers.0.block_sparse_moe.experts.5.w3.weight",
    )
    assert specs["layers.2.mlp.gate.weight"].source == "model.layers.2.block_sparse_moe.gate.weight"


@pytest.mark.parametrize(
    "name,edit",
    [
        ("model.layers.1.block_sparse_moe.experts.7.w2.weight", "drop"),
        ("model.layers.2.block_sparse_moe.gate.weight", "drop"),
        ("model.layers.0.block_sparse_moe.experts.3.w3.weight", "truncate"),
        ("model.layers.0.self_attn.k_proj.weight", "truncate"),
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
        intermediate_size=6,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    # found by its architecture where model_type is missing
    cfg = registry.parse_config({**base, "architectures": ["MixtralForCausalLM"]})
    assert cfg.model_type == "mixtral" and cfg.is_moe_layer(1)
    assert registry.parse_config({**base, "model_type": "mixtral", "sliding_window": 64})
    with pytest.raises(ModelConfigError, match="sliding-window"):
        registry.parse_config({**base, "model_type": "mixtral", "sliding_window": 16})
    with pytest.raises(LayoutError, match="must divide the number of experts 4"):
        registry.check_layout(cfg, Layout(0, 8, 8, dp_attention=True))
    with pytest.raises(LayoutError, match="must divide moe_intermediate_size 6"):
        registry.check_layout(cfg, Layout(0, 4, 1, dp_attention=True))
