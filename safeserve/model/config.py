"""The architecture facts a rank needs, read from a Hugging Face `config.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("qwen3_moe",)


class ModelConfigError(ValueError):
    """The checkpoint's config cannot be served; the message says why in one line."""


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: list[int]
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    hidden_act: str = "silu"
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    def is_moe_layer(self, layer: int) -> bool:
        """Same rule as transformers' Qwen3-MoE decoder layer."""
        return (
            layer not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        model_type = d.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelConfigError(
                f"model_type {model_type!r} is not supported (supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        hidden_act = d.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ModelConfigError(f"hidden_act {hidden_act!r} is not supported (only silu)")
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default")) if rope else "default"
        if rope_type not in ("default", None):
            raise ModelConfigError(f"rope_type {rope_type!r} is not supported (only default RoPE)")
        rope_theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        if d.get("use_sliding_window") and d.get("sliding_window"):
            raise ModelConfigError("sliding-window attention is not supported")
        num_heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or d["hidden_size"] // num_heads
        eos = d.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        cfg = cls(
            model_type=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            intermediate_size=d.get("intermediate_size", 0),
            moe_intermediate_size=d.get("moe_intermediate_size", 0),
            # transformers 5 writes `num_local_experts`; older configs `num_experts`.
            num_experts=d.get("num_experts") or d.get("num_local_experts") or 0,
            num_experts_per_tok=d.get("num_experts_per_tok", 0),
            norm_topk_prob=bool(d.get("norm_topk_prob", False)),
            decoder_sparse_step=d.get("decoder_sparse_step", 1) or 1,
            mlp_only_layers=list(d.get("mlp_only_layers") or []),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)),
            hidden_act=hidden_act,
            eos_token_ids=eos_ids,
            bos_token_id=d.get("bos_token_id"),
            raw=d,
        )
        cfg.check()
        return cfg

    def check(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim % 2:
            raise ModelConfigError("head_dim must be even for RoPE")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ModelConfigError("num_experts_per_tok must be in [1, num_experts]")

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError as e:
            raise ModelConfigError(f"no config.json at {path}") from e
        except json.JSONDecodeError as e:
            raise ModelConfigError(f"{path} is not valid JSON: {e}") from e
        return cls.from_dict(d)
