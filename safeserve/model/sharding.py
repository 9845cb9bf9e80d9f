"""Which slice of each full weight a rank holds, and the weight-spec pieces families share.

Attention is split by heads across the attention-TP ranks (column-parallel q/k/v, row-parallel o);
KV heads are split when there are enough, else each rank holds the one its query heads use. Dense
MLPs (and shared experts) are split by FFN width across attention-TP ranks. Routed experts are
placed on EP ranks by the expert map (`moe/expert_map.py`: trivially, contiguous blocks) and
split by FFN width across the ranks of one EP rank. Every rank
derives its slices from the same full shapes, so random (dummy) weights and checkpoint weights
shard the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from safeserve.config import ServerArgs
from safeserve.model.config import ModelConfig
from safeserve.model.spec import ExpertSlice, ExpertSource, Slice, WeightSpec, WeightSpecs
from safeserve.moe.expert_map import ExpertMap
from safeserve.moe.placement import ExpertPlacement
from safeserve.parallel.layout import Layout


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


def dense_split(
    cfg: ModelConfig, layout: Layout, width: int | None = None, what: str = "intermediate_size"
) -> tuple[int, int]:
    """(start, stop) of the dense-MLP width (`width`, default the config's) this rank holds."""
    tp, r = layout.attn_tp_size, layout.attn_tp_rank
    width = cfg.intermediate_size if width is None else width
    if width % tp:
        raise LayoutError(f"--tp-size {tp} must divide {what} {width}")
    step = width // tp
    return r * step, (r + 1) * step


def moe_layers(cfg: ModelConfig) -> list[int]:
    """The decoder layers that are MoE layers, in order: row j of the expert map is layer
    `moe_layers(cfg)[j]`'s."""
    return [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]


def expert_split(
    cfg: ModelConfig, layout: Layout, expert_map: ExpertMap | None = None
) -> tuple[ExpertPlacement, int, int]:
    """This rank's view of the expert map (None: the trivial map, the experts in contiguous
    blocks per EP rank) and the (start, stop) of their FFN width."""
    if expert_map is None:
        if cfg.num_experts % layout.ep_size:
            raise LayoutError(
                f"--ep-size {layout.ep_size} must divide the number of experts {cfg.num_experts}"
            )
    elif (expert_map.num_logical, expert_map.ep_size) != (cfg.num_experts, layout.ep_size):
        raise LayoutError(
            f"expert map of {expert_map.num_logical} experts over {expert_map.ep_size} EP ranks "
            f"for a model of {cfg.num_experts} experts with --ep-size {layout.ep_size}"
        )
    width = cfg.moe_intermediate_size
    if width % layout.moe_tp_size:
        raise LayoutError(
            f"tp_size/ep_size = {layout.moe_tp_size} must divide moe_intermediate_size {width}"
        )
    if expert_map is None:
        placement = ExpertPlacement(cfg.num_experts, layout.ep_size, layout.ep_rank)
    else:
        placement = ExpertPlacement.of(expert_map, layout.ep_rank)
    step = width // layout.moe_tp_size
    return placement, layout.moe_tp_rank * step, (layout.moe_tp_rank + 1) * step


def starting_expert_map(args: ServerArgs, cfg: ModelConfig, layout: Layout) -> ExpertMap | None:
    """The placement a rank starts with (--init-expert-location, --ep-num-redundant-experts);
    None for the trivial one without redundant slots (the contiguous blocks)."""
    from safeserve.moe.eplb.location import TRIVIAL, initial_expert_map

    if args.init_expert_location == TRIVIAL and not args.ep_num_redundant_experts:
        return None
    return initial_expert_map(
        args.init_expert_location,
        cfg.num_experts,
        len(moe_layers(cfg)),
        layout.ep_size,
        args.ep_num_redundant_experts,
        getattr(cfg, "n_group", 1) or 1,
        args.seed,
    )


def routing_source(layout: Layout) -> int | None:
    """Whose send table this rank's routers use (`ExpertMap.send_to`): its own EP rank's with
    attention data-parallel (each rank routes its own tokens); None, the group's shared one,
    with tensor-parallel attention, where every rank routes the same tokens and the ranks must
    choose the same replica for each (the `none` backend computes each rank's slots over every
    token)."""
    return layout.ep_rank if layout.dp_attention else None


# -- spec pieces ---------------------------------------------------------------------------------


def whole(shape: tuple[int, ...], source: str, float32: bool = False) -> WeightSpec:
    """A replicated parameter (`float32`: held in float32 whatever the model's dtype)."""
    return WeightSpec(shape, Slice(), source, float32)


def linear(
    shape: tuple[int, int], piece: Slice, source: str, dequantize_fp8: bool = False
) -> WeightSpec:
    """A linear layer's weight `[out, in]` (block FP8 under quantization, `model/quant.py`;
    `dequantize_fp8`: held in the model's dtype all the same, see `WeightSpec`)."""
    return WeightSpec(shape, piece, source, linear=True, dequantize_fp8=dequantize_fp8)


def embedding_specs(cfg: ModelConfig, hf: str = "model.") -> WeightSpecs:
    """Embedding table, final norm and (unless tied) the LM head."""
    h = cfg.hidden_size
    specs = {
        "embed_tokens.weight": whole((cfg.vocab_size, h), hf + "embed_tokens.weight"),
        "norm.weight": whole((h,), hf + "norm.weight"),
    }
    if not cfg.tie_word_embeddings:
        specs["lm_head.weight"] = whole((cfg.vocab_size, h), "lm_head.weight")
    return specs


def gqa_attention_specs(
    cfg: ModelConfig, layout: Layout, ours: str, hf: str, qk_norm: bool, o_bias: bool = True
) -> WeightSpecs:
    """q/k/v/o projections split by heads (biases with `attention_bias`; o's bias is added once,
    after the all-reduce, and only with `o_bias`: Qwen2-MoE has q/k/v biases only), and per-head
    q/k RMSNorm weights with `qk_norm`. `ours` and `hf` are the prefixes of the attention module
    in our model and in the checkpoint."""
    h, d = cfg.hidden_size, cfg.head_dim
    heads = head_split(cfg, layout)
    q_rows = Slice(0, heads.q_start * d, (heads.q_start + heads.num_heads) * d)
    kv_rows = Slice(0, heads.kv_start * d, (heads.kv_start + heads.num_kv_heads) * d)
    hq, hkv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    specs = {
        ours + "q_proj.weight": linear((hq, h), q_rows, hf + "q_proj.weight"),
        ours + "k_proj.weight": linear((hkv, h), kv_rows, hf + "k_proj.weight"),
        ours + "v_proj.weight": linear((hkv, h), kv_rows, hf + "v_proj.weight"),
        ours + "o_proj.weight": linear(
            (h, hq), Slice(1, q_rows.start, q_rows.stop), hf + "o_proj.weight"
        ),
    }
    if cfg.attention_bias:
        specs[ours + "q_proj.bias"] = WeightSpec((hq,), q_rows, hf + "q_proj.bias")
        specs[ours + "k_proj.bias"] = WeightSpec((hkv,), kv_rows, hf + "k_proj.bias")
        specs[ours + "v_proj.bias"] = WeightSpec((hkv,), kv_rows, hf + "v_proj.bias")
        if o_bias:
            specs[ours + "o_bias"] = whole((h,), hf + "o_proj.bias")
    if qk_norm:
        specs[ours + "q_norm.weight"] = whole((d,), hf + "q_norm.weight")
        specs[ours + "k_norm.weight"] = whole((d,), hf + "k_norm.weight")
    return specs


def dense_mlp_specs(
    cfg: ModelConfig,
    layout: Layout,
    ours: str,
    hf: str,
    width: int | None = None,
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
    what: str = "intermediate_size",
) -> WeightSpecs:
    """A SiLU-gated MLP of FFN `width` split by width across attention-TP ranks; `names` are
    the checkpoint's gate, up and down projections under `hf`."""
    h = cfg.hidden_size
    w = cfg.intermediate_size if width is None else width
    s0, s1 = dense_split(cfg, layout, w, what)
    gate, up, down = names
    return {
        ours + "gate_proj.weight": linear((w, h), Slice(0, s0, s1), hf + gate + ".weight"),
        ours + "up_proj.weight": linear((w, h), Slice(0, s0, s1), hf + up + ".weight"),
        ours + "down_proj.weight": linear((h, w), Slice(1, s0, s1), hf + down + ".weight"),
    }


def routed_expert_specs(
    cfg: ModelConfig,
    layout: Layout,
    ours: str,
    hf: str,
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
    *,
    layer: int | None = None,
    expert_map: ExpertMap | None = None,
) -> WeightSpecs:
    """This rank's stacked routed experts `ours + "w13"` [slots, 2I, H] and `ours + "w2"`
    [slots, H, I] of decoder layer `layer`, one per local physical slot: the weights of the
    logical expert the expert map puts there (None: the trivial map), read per expert
    (`hf + "{e}." + name + ".weight"`) or from the fused 3-D tensors (`hf + "gate_up_proj"`,
    `hf + "down_proj"`) where the checkpoint has them. Full shapes are over the logical
    experts."""
    placement, i0, i1 = expert_split(cfg, layout, expert_map)
    rows = moe_layers(cfg)
    if expert_map is None:
        expert_map = ExpertMap.trivial(cfg.num_experts, layout.ep_size, len(rows))
        row = 0 if layer is None or not rows else rows.index(layer)
    elif layer is None:
        raise ValueError("routed_expert_specs of an expert map needs the decoder layer")
    else:
        row = rows.index(layer)
    experts = expert_map.local_logical(row, placement.ep_rank) if rows else ()
    w, h, n = cfg.moe_intermediate_size, cfg.hidden_size, cfg.num_experts
    gate, up, down = (hf + "{e}." + name + ".weight" for name in names)
    return {
        ours + "w13": WeightSpec(
            (n, 2 * w, h),
            ExpertSlice(experts, i0, i1, w, True),
            ExpertSource(hf + "gate_up_proj", (gate, up)),
            linear=True,
        ),
        ours + "w2": WeightSpec(
            (n, h, w),
            ExpertSlice(experts, i0, i1, w, False),
            ExpertSource(hf + "down_proj", (down,)),
            linear=True,
        ),
    }
