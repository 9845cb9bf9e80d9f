"""Small random DeepSeek-V3 checkpoints for tests, written by `transformers` itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from checkpoints import write_checkpoint

# Small odd shapes: 4 heads (tp 4 splits them), 12 routed experts in 4 groups of 3 (divisible
# by the layouts' EP sizes 2 and 4), a dense first layer, two shared experts, a q LoRA.
PARAMS: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=80,
    moe_intermediate_size=24,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=12,
    n_shared_experts=2,
    num_experts_per_tok=3,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    q_lora_rank=24,
    kv_lora_rank=20,
    qk_nope_head_dim=12,
    qk_rope_head_dim=8,
    v_head_dim=10,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,  # the latent norms keep transformers' 1e-6
    rope_parameters=dict(rope_type="default", rope_theta=10000.0),
)


def _init(model: Any) -> None:
    """Non-zero correction biases (large enough to change the routing, some negative enough to
    push score + bias below 0) and norm weights away from 1."""
    import torch

    for name, p in model.named_parameters():
        if "norm" in name:
            p.uniform_(0.5, 1.5)
    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(gate, "e_score_correction_bias"):
            bias = gate.e_score_correction_bias
            bias.copy_(torch.randn(bias.shape) * 0.3)


def write_deepseek_v3_checkpoint(
    out_dir: Path, seed: int = 0, max_shard_size: str | None = None, **overrides: Any
) -> Path:
    """Random DeepSeek-V3 weights saved with `save_pretrained`, plus a tokenizer."""
    params = {**PARAMS, **overrides}
    return write_checkpoint(out_dir, "DeepseekV3", params, seed, max_shard_size, _init)
