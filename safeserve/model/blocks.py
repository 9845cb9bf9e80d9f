"""This rank's building blocks for a family's config and layout: grouped-query attention split by
heads, a dense MLP (or shared experts) split by width, an MoE block with its routed experts."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from safeserve.layers.attention import GQAttention
from safeserve.layers.decoder import DecoderLayer
from safeserve.layers.mlp import DenseMLP
from safeserve.model.config import ModelConfig
from safeserve.model.sharding import dense_split, expert_split, head_split
from safeserve.moe.dispatch.base import Dispatcher
from safeserve.moe.layer import MoELayer
from safeserve.moe.topk import RouterConfig
from safeserve.parallel.comm import Comm
from safeserve.parallel.layout import Layout


def gqa_attention(
    cfg: ModelConfig,
    layout: Layout,
    comm: Comm,
    qk_norm: bool,
    bias: bool = False,
    o_bias: bool = True,
) -> GQAttention:
    """The family's attention module on this rank (heads split across attention-TP ranks);
    `bias`: q/k/v biases, and o's too unless `o_bias` is False."""
    split = head_split(cfg, layout)
    return GQAttention(
        cfg.hidden_size,
        split.num_heads,
        split.num_kv_heads,
        cfg.head_dim,
        comm,
        reduce=layout.attn_tp_size > 1,
        bias=bias,
        qk_norm_eps=cfg.rms_norm_eps if qk_norm else None,
        o_bias=o_bias,
    )


def dense_mlp(cfg: ModelConfig, layout: Layout, comm: Comm, width: int | None = None) -> DenseMLP:
    start, stop = dense_split(cfg, layout, width)
    return DenseMLP(cfg.hidden_size, stop - start, comm, reduce=layout.attn_tp_size > 1)


def moe_layer(
    cfg: ModelConfig,
    layout: Layout,
    dispatcher: Dispatcher,
    router: RouterConfig,
    shared: nn.Module | None = None,
    shared_gate: bool = False,
) -> MoELayer:
    """An MoE block on this rank: its local slots are those of the dispatcher's placement (the
    rank's view of the expert map)."""
    placement = dispatcher.placement
    _, i0, i1 = expert_split(cfg, layout, placement.expert_map)
    return MoELayer(
        cfg.hidden_size,
        i1 - i0,
        cfg.num_experts,
        router,
        placement,
        dispatcher,
        shared,
        shared_gate,
    )


def decoder_layers(
    cfg: ModelConfig,
    attention: Callable[[int], nn.Module],
    mlp: Callable[[int], nn.Module],
) -> list[nn.Module]:
    """The model's decoder layers: layer i's attention and MLP (an MoE block where
    `cfg.is_moe_layer(i)`) with their two RMSNorms."""
    return [
        DecoderLayer(attention(i), mlp(i), cfg.hidden_size, cfg.rms_norm_eps, cfg.is_moe_layer(i))
        for i in range(cfg.num_hidden_layers)
    ]
