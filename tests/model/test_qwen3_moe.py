"""Our Qwen3-MoE against transformers' own, through the paged KV cache, in float32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoints import write_qwen3_moe_checkpoint
from model_checks import dummy_load_generates, paged_logits_match_transformers

from safeserve.model.config import ModelConfigError
from safeserve.model.loader import build_model
from safeserve.model.registry import parse_config
from safeserve.moe.dispatch import LocalDispatcher
from safeserve.moe.placement import ExpertPlacement

# Shapes and options that change the code path: GQA ratios, tied head, attention bias, dense
# layers by `mlp_only_layers` and by `decoder_sparse_step`, unnormalized top-k, sharded files.
VARIANTS = {
    "default": {},
    "tied_bias_mha": dict(tie_word_embeddings=True, attention_bias=True, num_key_value_heads=4),
    "sparse_step_2": dict(
        decoder_sparse_step=2,
        mlp_only_layers=[],
        norm_topk_prob=False,
        num_experts=6,
        num_experts_per_tok=3,
        num_key_value_heads=1,
        head_dim=8,
        rope_theta=1e6,
    ),
    "sharded": dict(
        num_hidden_layers=2,
        mlp_only_layers=[],
        hidden_size=48,
        num_experts=5,
        num_experts_per_tok=1,
    ),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_transformers_prefill_and_decode(variant: str, tmp_path: Path) -> None:
    shard = "20KB" if variant == "sharded" else None
    ckpt = write_qwen3_moe_checkpoint(tmp_path, seed=3, max_shard_size=shard, **VARIANTS[variant])
    if variant == "sharded":
        assert (ckpt / "model.safetensors.index.json").exists()
    paged_logits_match_transformers(ckpt)


def test_config_rules() -> None:
    base = dict(
        model_type="qwen3_moe",
        vocab_size=10,
        hidden_size=8,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
    )
    cfg = parse_config({**base, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, False, False]
    assert parse_config({**base, "num_local_experts": 6, "num_experts": None}).num_experts == 6
    with pytest.raises(ModelConfigError, match="not supported"):
        parse_config({**base, "model_type": "llama"})
    with pytest.raises(ModelConfigError, match="rope_type"):
        parse_config({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_dummy_load_format_needs_only_config_json(tmp_path: Path) -> None:
    cfg = dict(
        model_type="qwen3_moe",
        vocab_size=300,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=128,
    )
    model = dummy_load_generates(cfg, tmp_path)
    assert model.layers[0].mlp.experts.w13.abs().sum() > 0  # really initialized


def test_fused_projections_alias_the_per_projection_weights() -> None:
    """q|k|v is one GEMM: the three parameters are views of it, so loading by name fills it."""
    net = build_model("tiny", "dummy", "float32", "cpu", LocalDispatcher(ExpertPlacement(8)))
    attn = net.layers[0].self_attn
    assert attn.qkv_weight is not None
    rows = [attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0]]
    torch.testing.assert_close(attn.qkv_weight[: rows[0]], attn.q_proj.weight, rtol=0, atol=0)
    state = {k: torch.randn_like(v) for k, v in net.state_dict().items()}
    net.load_state_dict(state)
    v_rows = attn.qkv_weight[rows[0] + rows[1] :]
    torch.testing.assert_close(v_rows, state["layers.0.self_attn.v_proj.weight"], rtol=0, atol=0)
    dense = net.layers[2].mlp  # the tiny model's dense layer
    assert dense.gate_up_weight is not None
    up = dense.gate_up_weight[dense.gate_proj.weight.shape[0] :]
    torch.testing.assert_close(up, state["layers.2.mlp.up_proj.weight"], rtol=0, atol=0)
