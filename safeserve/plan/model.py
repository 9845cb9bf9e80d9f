"""What a model weighs and what a decode step reads, from its config alone (no torch, no weights).

Sizes come from the family's weight specification (`model/spec.py`): the shape of every
parameter a rank holds under a layout. The loader and the benchmark's floor read the same
specification, so these numbers equal what a rank allocates (`tests/plan` checks them against a
built model of every family).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from safeserve.model.config import FP8_BLOCK, ModelConfig
from safeserve.model.quant import scale_spec
from safeserve.model.registry import kv_spec, weight_specs
from safeserve.model.spec import ExpertSlice, Slice, WeightSpec
from safeserve.parallel.layout import Layout

QUANTIZATIONS = ("none", "fp8")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # fp8 and fp8_e4m3: serve's one FP8 cache
EMBED = "embed_tokens.weight"


def held_shape(spec: WeightSpec) -> list[int]:
    """The shape of the piece of `spec` a rank holds."""
    shape = list(spec.shape)
    piece = spec.piece
    if isinstance(piece, ExpertSlice):
        shape[0] = len(piece.experts)
        if piece.is_w13:
            shape[1] = 2 * (piece.i1 - piece.i0)
        else:
            shape[2] = piece.i1 - piece.i0
    elif isinstance(piece, Slice) and piece.dim is not None:
        shape[piece.dim] = piece.stop - piece.start
    return shape


def held_numel(spec: WeightSpec) -> int:
    """Elements of the piece of `spec` a rank holds."""
    return math.prod(held_shape(spec))


def fp8_quantized(spec: WeightSpec) -> bool:
    """Whether serve holds this weight in FP8 under block FP8 (`model/quant.py`): the linear
    weights, not the embedding, LM head, routers, norms, or MLA's absorbed `kv_b_proj`."""
    return spec.linear and not spec.dequantize_fp8


def fp8_bytes(spec: WeightSpec) -> int:
    """The piece of `spec` a rank holds in FP8, with its float32 block scales as the loader
    holds them (`model/quant.py: scale_spec`: one per 128 x 128 tile, w13's gate and up each
    tiled on their own)."""
    return held_numel(spec) + 4 * held_numel(scale_spec(spec, FP8_BLOCK))


@dataclass(frozen=True)
class RankBytes:
    """One rank's weights under a layout, by part, in bytes."""

    total: int  # every parameter the rank holds
    dense: int  # every weight but the routed experts and the embedding table (a step reads it)
    embed_row: int  # one row of the embedding table (a step reads one per token)
    expert: int  # one routed expert of one layer as the rank holds it (gate, up, down)
    local_experts: int  # routed experts per MoE layer on this rank
    kv_token: int  # one token's KV-cache entries over all layers, on this rank


@dataclass(frozen=True)
class ModelFacts:
    """What the planner needs of a model."""

    cfg: ModelConfig
    itemsize: int  # weights and activations (bf16: 2)
    quantization: str = "none"  # "fp8": block-quantized FP8 linear weights
    kv_itemsize: int | None = None  # None: the model's itemsize; 1: an FP8 KV cache

    @property
    def moe_layers(self) -> int:
        return sum(1 for i in range(self.cfg.num_hidden_layers) if self.cfg.is_moe_layer(i))

    def rank_bytes(self, layout: Layout) -> RankBytes:
        specs = weight_specs(self.cfg, layout)
        total = dense = local = embed_row = 0
        per_layer: dict[str, int] = {}  # one expert's bytes (w13 + w2), per MoE layer
        fp8 = self.quantization == "fp8" or self.cfg.quant is not None  # flag or checkpoint
        for name, spec in specs.items():
            if fp8 and fp8_quantized(spec):
                n = fp8_bytes(spec)
            else:
                n = held_numel(spec) * (4 if spec.float32 else self.itemsize)
            total += n
            if isinstance(spec.piece, ExpertSlice):
                local = len(spec.piece.experts)
                layer = name.rsplit(".", 1)[0]
                per_layer[layer] = per_layer.get(layer, 0) + n // local
                continue
            if name == EMBED:
                embed_row = n // spec.shape[0]
                if self.tied:
                    dense += n  # the table is the LM head too: a step reads all of it
                continue
            dense += n
        kv = kv_spec(self.cfg, layout).token_bytes(self.kv_itemsize or self.itemsize)
        expert = max(per_layer.values(), default=0)
        return RankBytes(total, dense, embed_row, expert, local, kv)

    @property
    def tied(self) -> bool:
        return bool(self.cfg.tie_word_embeddings)
