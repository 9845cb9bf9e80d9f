"""Which slice of each full weight a rank holds.

Attention is split by heads across the attention-TP ranks (column-parallel q/k/v, row-parallel o);
KV heads are split when there are enough, else each rank holds the one its query heads use. Dense
MLPs are split by FFN width across attention-TP ranks. Experts are split by expert blocks across
EP ranks and by FFN width across the ranks of one block. Every rank derives its slices from the
same full shapes, so random (dummy) weights and checkpoint weights shard the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from safeserve.engine.layout import Layout
from safeserve.model.config import ModelConfig
from safeserve.moe.placement import ExpertPlacement

if TYPE_CHECKING:  # the frontend checks layouts without importing torch
    import torch


class LayoutError(ValueError):
    pass


@dataclass(frozen=True)
class HeadSplit:
    num_heads: int  # query heads on this rank
    num_kv_heads: int
    q_start: int
    kv_start: int


def head_split(cfg: ModelConfig, layout: Layout) -> HeadSplit:
    tp, r = layout.attn_tp_size, layout.attn_tp_rank
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    if hq % tp:
        raise LayoutError(
            f"--tp-size {tp} must divide num_attention_heads {hq} (or use --enable-dp-attention)"
        )
    if hkv % tp == 0:
        kv_local, kv_start = hkv // tp, r * (hkv // tp)
    elif tp % hkv == 0:
        kv_local, kv_start = 1, (r * hkv) // tp
    else:
        raise LayoutError(f"--tp-size {tp} and num_key_value_heads {hkv} must divide one another")
    return HeadSplit(hq // tp, kv_local, r * (hq // tp), kv_start)


def dense_split(cfg: ModelConfig, layout: Layout) -> tuple[int, int]:
    """(start, stop) of the dense-MLP width this rank holds."""
    tp, r = layout.attn_tp_size, layout.attn_tp_rank
    width = cfg.intermediate_size
    if width % tp:
        raise LayoutError(f"--tp-size {tp} must divide intermediate_size {width}")
    step = width // tp
    return r * step, (r + 1) * step


def expert_split(cfg: ModelConfig, layout: Layout) -> tuple[ExpertPlacement, int, int]:
    """This rank's experts and the (start, stop) of their FFN width."""
    if cfg.num_experts % layout.ep_size:
        raise LayoutError(
            f"--ep-size {layout.ep_size} must divide the number of experts {cfg.num_experts}"
        )
    width = cfg.moe_intermediate_size
    if width % layout.moe_tp_size:
        raise LayoutError(
            f"tp_size/ep_size = {layout.moe_tp_size} must divide moe_intermediate_size {width}"
        )
    placement = ExpertPlacement(cfg.num_experts, layout.ep_size, layout.ep_rank)
    step = width // layout.moe_tp_size
    return placement, layout.moe_tp_rank * step, (layout.moe_tp_rank + 1) * step


def check_layout(cfg: ModelConfig, layout: Layout) -> None:
    """Raises LayoutError (one line) when the model cannot be laid out so."""
    head_split(cfg, layout)
    if any(not cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
        dense_split(cfg, layout)
    if cfg.num_experts:
        expert_split(cfg, layout)


@dataclass(frozen=True)
class Slice:
    """Rows `[start, stop)` of dimension `dim` (None: the whole tensor)."""

    dim: int | None = None
    start: int = 0
    stop: int = 0

    def apply(self, full: torch.Tensor) -> torch.Tensor:
        if self.dim is None:
            return full
        return full.narrow(self.dim, self.start, self.stop - self.start)


@dataclass(frozen=True)
class ExpertSlice:
    """Experts `[e0, e1)`; FFN width `[i0, i1)` of `width` (gate rows then up rows for w13)."""

    e0: int
    e1: int
    i0: int
    i1: int
    width: int
    is_w13: bool

    def apply(self, full: torch.Tensor) -> torch.Tensor:
        import torch

        experts = full[self.e0 : self.e1]
        if self.is_w13:
            return torch.cat(
                [
                    experts[:, self.i0 : self.i1],
                    experts[:, self.width + self.i0 : self.width + self.i1],
                ],
                dim=1,
            )
        return experts[:, :, self.i0 : self.i1]


def shard_specs(
    cfg: ModelConfig, layout: Layout
) -> dict[str, tuple[tuple[int, ...], Slice | ExpertSlice]]:
    """For each parameter name of our model: its full shape and the slice this rank holds."""
    h, d = cfg.hidden_size, cfg.head_dim
    heads = head_split(cfg, layout)
    specs: dict[str, tuple[tuple[int, ...], Slice | ExpertSlice]] = {
        "embed_tokens.weight": ((cfg.vocab_size, h), Slice()),
        "norm.weight": ((h,), Slice()),
    }
    if not cfg.tie_word_embeddings:
        specs["lm_head.weight"] = ((cfg.vocab_size, h), Slice())
    q_rows = Slice(0, heads.q_start * d, (heads.q_start + heads.num_heads) * d)
    kv_rows = Slice(0, heads.kv_start * d, (heads.kv_start + heads.num_kv_heads) * d)
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        a = p + "self_attn."
        specs[a + "q_proj.weight"] = ((cfg.num_attention_heads * d, h), q_rows)
        specs[a + "k_proj.weight"] = ((cfg.num_key_value_heads * d, h), kv_rows)
        specs[a + "v_proj.weight"] = ((cfg.num_key_value_heads * d, h), kv_rows)
        specs[a + "o_proj.weight"] = (
            (h, cfg.num_attention_heads * d),
            Slice(1, q_rows.start, q_rows.stop),
        )
        if cfg.attention_bias:
            specs[a + "q_proj.bias"] = ((cfg.num_attention_heads * d,), q_rows)
            specs[a + "k_proj.bias"] = ((cfg.num_key_value_heads * d,), kv_rows)
            specs[a + "v_proj.bias"] = ((cfg.num_key_value_heads * d,), kv_rows)
            specs[a + "o_bias"] = ((h,), Slice())
        specs[a + "q_norm.weight"] = ((d,), Slice())
        specs[a + "k_norm.weight"] = ((d,), Slice())
        specs[p + "input_layernorm.weight"] = ((h,), Slice())
        specs[p + "post_attention_layernorm.weight"] = ((h,), Slice())
        if cfg.is_moe_layer(i):
            placement, i0, i1 = expert_split(cfg, layout)
            e0, e1 = placement.local_start, placement.local_start + placement.experts_per_rank
            w = cfg.moe_intermediate_size
            specs[p + "mlp.gate.weight"] = ((cfg.num_experts, h), Slice())
            specs[p + "mlp.experts.w13"] = (
                (cfg.num_experts, 2 * w, h),
                ExpertSlice(e0, e1, i0, i1, w, True),
            )
            specs[p + "mlp.experts.w2"] = (
                (cfg.num_experts, h, w),
                ExpertSlice(e0, e1, i0, i1, w, False),
            )
        else:
            s0, s1 = dense_split(cfg, layout)
            w = cfg.intermediate_size
            specs[p + "mlp.gate_proj.weight"] = ((w, h), Slice(0, s0, s1))
            specs[p + "mlp.up_proj.weight"] = ((w, h), Slice(0, s0, s1))
            specs[p + "mlp.down_proj.weight"] = ((h, w), Slice(1, s0, s1))
    return specs
