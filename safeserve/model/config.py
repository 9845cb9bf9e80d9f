"""The architecture facts every family shares, read from a Hugging Face `config.json`.

A family's config (`safeserve/model/<family>/spec.py`) is a subclass that adds its own fields and
its rule for which layers are MoE layers; `safeserve.model.registry.parse_config` picks the
family from `model_type` (or `architectures`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class ModelConfigError(ValueError):
    """The checkpoint's config cannot be served; the message says why in one line."""


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding: default (`theta` only) or YaRN (`factor`, the original context, the
    ramp's `beta_fast` / `beta_slow`, and the attention-scale terms `mscale`, `mscale_all_dim`,
    `attention_factor`)."""

    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True

    @classmethod
    def from_dict(cls, d: dict[str, Any], allowed: tuple[str, ...]) -> RopeConfig:
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_type = (rope.get("rope_type") or rope.get("type") or "default") if rope else "default"
        if rope_type not in allowed:
            raise ModelConfigError(
                f"rope_type {rope_type!r} is not supported for {d.get('model_type')} "
                f"(supported: {', '.join(allowed)})"
            )
        theta = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
        if rope_type == "default":
            return cls(theta=theta)
        return cls(
            theta=theta,
            type=rope_type,
            factor=float(rope.get("factor") or 1.0),
            original_max_position_embeddings=int(
                rope.get("original_max_position_embeddings")
                or d.get("original_max_position_embeddings")
                or d.get("max_position_embeddings", 4096)
            ),
            beta_fast=float(rope.get("beta_fast") or 32.0),
            beta_slow=float(rope.get("beta_slow") or 1.0),
            # absent: 0, as transformers' YaRN uses both terms only where both are given
            mscale=float(rope.get("mscale") or 0.0),
            mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0),
            attention_factor=rope.get("attention_factor"),
            truncate=bool(rope.get("truncate", True)),
        )


FP8_BLOCK = (128, 128)  # the one block size of block-FP8 weights served
FP8_SUPPORTED = (
    f"quant_method 'fp8', fmt 'e4m3', activation_scheme 'dynamic', weight_block_size "
    f"{list(FP8_BLOCK)}"
)


@dataclass(frozen=True)
class Fp8Config:
    """Block-FP8 weights (`safeserve.kernels.fp8_reference` has the format): `block` tiles of
    one float32 scale each. `online`: the checkpoint holds high-precision weights, quantized at
    load; else the checkpoint's FP8 linears (those stored as float8_e4m3fn with a
    `weight_scale_inv`) are read as they are. `ignored`: the modules the checkpoint names as
    left unquantized (`modules_to_not_convert` / `ignored_layers`)."""

    block: tuple[int, int] = FP8_BLOCK
    online: bool = False
    ignored: tuple[str, ...] = ()

    @classmethod
    def of_checkpoint(cls, q: dict[str, Any] | None) -> Fp8Config | None:
        """The checkpoint's `quantization_config` (None: none); ModelConfigError naming what is
        supported where it is another scheme."""
        if not q:
            return None
        got = (
            q.get("quant_method"),
            q.get("fmt", "e4m3"),
            q.get("activation_scheme", "dynamic"),
            list(q.get("weight_block_size") or []),
        )
        if got != ("fp8", "e4m3", "dynamic", list(FP8_BLOCK)):
            raise ModelConfigError(
                f"quantization_config (quant_method {got[0]!r}, fmt {got[1]!r}, activation_scheme "
                f"{got[2]!r}, weight_block_size {got[3]}) is not supported (supported: "
                f"{FP8_SUPPORTED})"
            )
        ignored = list(q.get("modules_to_not_convert") or []) + list(q.get("ignored_layers") or [])
        return cls(ignored=tuple(ignored))


# Keys that name the same field in configs of different transformers versions.
_ALIASES = {"num_experts": ("num_local_experts",), "num_local_experts": ("num_experts",)}


def with_defaults(d: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """`d` with each field of `defaults` that it leaves out (under any of its names) added:
    what transformers' config class of the family fills in for a `config.json` without it, so
    that both read the same model (Mixtral without `rope_theta` is RoPE base 1e6, not 1e4)."""
    out = dict(d)
    for key, value in defaults.items():
        if not any(name in d for name in (key, *_ALIASES.get(key, ()))):
            out[key] = value
    return out


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int  # dense layers' FFN width (0: none)
    moe_intermediate_size: int  # one routed expert's FFN width
    num_experts: int  # routed experts (0: a dense model)
    num_experts_per_tok: int
    norm_topk_prob: bool
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    hidden_act: str = "silu"
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    # Block-FP8 weights: the checkpoint's `quantization_config`, or `--quantization fp8`.
    quant: Fp8Config | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def rope_theta(self) -> float:
        return self.rope.theta

    def is_moe_layer(self, layer: int) -> bool:
        """Every layer of a model with experts; families with dense layers override it."""
        return self.num_experts > 0

    @property
    def shared_intermediate_size(self) -> int:
        """FFN width of the shared experts every token of an MoE layer runs besides its routed
        ones (all of them together); 0: none. Families that have them override it."""
        return 0

    @staticmethod
    def common(
        d: dict[str, Any],
        rope_types: tuple[str, ...] = ("default",),
        defaults: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The shared fields of `d`, as keyword arguments of a family's config class; a field
        `d` leaves out is read from `defaults` (`with_defaults`: the family's transformers
        defaults), and `raw` stays `d` as written."""
        raw, d = d, with_defaults(d, defaults or {})
        hidden_act = d.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ModelConfigError(f"hidden_act {hidden_act!r} is not supported (only silu)")
        if d.get("use_sliding_window") and d.get("sliding_window"):
            raise ModelConfigError("sliding-window attention is not supported")
        try:
            num_heads = d["num_attention_heads"]
            eos = d.get("eos_token_id")
            return dict(
                model_type=d.get("model_type", ""),
                vocab_size=d["vocab_size"],
                hidden_size=d["hidden_size"],
                num_hidden_layers=d["num_hidden_layers"],
                num_attention_heads=num_heads,
                num_key_value_heads=d.get("num_key_value_heads") or num_heads,
                head_dim=d.get("head_dim") or d["hidden_size"] // num_heads,
                intermediate_size=d.get("intermediate_size", 0) or 0,
                moe_intermediate_size=d.get("moe_intermediate_size", 0) or 0,
                # transformers 5 writes `num_local_experts`; older configs `num_experts`.
                num_experts=d.get("num_experts") or d.get("num_local_experts") or 0,
                num_experts_per_tok=d.get("num_experts_per_tok", 0) or 0,
                norm_topk_prob=bool(d.get("norm_topk_prob", False)),
                rms_norm_eps=d.get("rms_norm_eps", 1e-6),
                rope=RopeConfig.from_dict(d, rope_types),
                max_position_embeddings=d.get("max_position_embeddings", 4096),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=bool(d.get("attention_bias", False)),
                hidden_act=hidden_act,
                eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
                bos_token_id=d.get("bos_token_id"),
                quant=Fp8Config.of_checkpoint(d.get("quantization_config")),
                raw=raw,
            )
        except KeyError as e:
            raise ModelConfigError(f"config.json has no {e.args[0]!r}") from e

    def check(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim % 2:
            raise ModelConfigError("head_dim must be even for RoPE")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ModelConfigError("num_experts_per_tok must be in [1, num_experts]")


@dataclass
class SparseStepConfig(ModelConfig):
    """Qwen's rule for dense layers among the MoE layers: those in `mlp_only_layers`, and all
    but every `decoder_sparse_step`-th."""

    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)

    def is_moe_layer(self, layer: int) -> bool:
        return (
            layer not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @staticmethod
    def sparse_fields(d: dict[str, Any]) -> dict[str, Any]:
        return dict(
            decoder_sparse_step=d.get("decoder_sparse_step", 1) or 1,
            mlp_only_layers=list(d.get("mlp_only_layers") or []),
        )
