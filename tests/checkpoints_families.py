"""Small random Mixtral and Qwen2-MoE checkpoints for tests, written by `transformers` itself
(`checkpoints.write_checkpoint`): odd small shapes that every layout of `layouts.LAYOUTS` can
split (8 experts for EP 2 and 4; FFN widths divisible by TP 2 and 4)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from checkpoints import write_checkpoint
from seeds import seeded


def write_mixtral_checkpoint(
    out_dir: Path, seed: int = 0, max_shard_size: str | None = None, **overrides: Any
) -> Path:
    """Random Mixtral weights (every layer an MoE block, top-2 renormalized); transformers saves
    the experts as `block_sparse_moe.experts.{e}.w1/w2/w3`."""
    params: dict[str, Any] = dict(
        hidden_size=64,
        intermediate_size=32,  # one expert's width
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=512,
        rope_theta=1e6,
    )
    params.update(overrides)
    return write_checkpoint(out_dir, "Mixtral", params, seed, max_shard_size)


def _qkv_biases(model: Any) -> None:
    """q/k/v biases well away from zero, so that a bias read wrong (or an o bias added that the
    model has not) shows in the logits."""
    import torch

    gen = seeded(7)
    for name, p in model.named_parameters():
        if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)


def write_qwen2_moe_checkpoint(
    out_dir: Path, seed: int = 0, max_shard_size: str | None = None, **overrides: Any
) -> Path:
    """Random Qwen2-MoE weights: q/k/v biases, a gated shared expert, a dense layer (layer 1,
    `mlp_only_layers`), unnormalized top-k (`norm_topk_prob` False, transformers' default)."""
    params: dict[str, Any] = dict(
        hidden_size=64,
        intermediate_size=96,  # the dense layers' width
        moe_intermediate_size=32,
        shared_expert_intermediate_size=40,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=8,
        num_experts_per_tok=3,
        mlp_only_layers=[1],
        max_position_embeddings=512,
        rope_theta=10000.0,
    )
    params.update(overrides)
    return write_checkpoint(out_dir, "Qwen2Moe", params, seed, max_shard_size, init=_qkv_biases)
