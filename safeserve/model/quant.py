"""Which weights are held as block FP8, and where their block scales come from (no torch).

Under an `Fp8Config` the linear weights of a family's specs (`WeightSpec.linear`: attention
projections, dense MLPs and shared experts, routed experts) become FP8 with a float32 scale per
128 x 128 tile. Of a checkpoint, a weight is FP8 where the checkpoint stores it so (dtype
F8_E4M3; its scales are the tensor `<weight>_scale_inv`), and stays in the model's dtype where
it is stored otherwise; with `--quantization fp8` every linear weight is quantized at load.
Embeddings, the LM head, norms and routers are never FP8.

A rank's shard of an FP8 weight must be whole tiles: a shard boundary inside a tile would split
one scale between two ranks, so such a layout is refused (LayoutError, naming the tensor).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from safeserve.model.config import Fp8Config, ModelConfigError
from safeserve.model.sharding import LayoutError
from safeserve.model.spec import ExpertSlice, ExpertSource, Fp8Spec, Slice, WeightSpec, WeightSpecs

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPE = "F8_E4M3"  # safetensors' name of float8_e4m3fn

# The stored dtype of a checkpoint tensor (safetensors' name), None where it has no such tensor.
StoredDtype = Callable[[str], str | None]


def weight_name(source: str | ExpertSource, stored: StoredDtype | None = None) -> str:
    """The checkpoint tensor whose dtype stands for a weight's: the fused expert tensor where
    the checkpoint has it, else expert 0's first per-expert tensor."""
    if isinstance(source, str):
        return source
    if source.fused is not None and stored is not None and stored(source.fused) is not None:
        return source.fused
    return source.expert_names(0)[0]


def fp8_specs(specs: WeightSpecs, quant: Fp8Config, stored: StoredDtype | None) -> WeightSpecs:
    """`specs` with their FP8 weights marked (`WeightSpec.fp8`). `stored`: the checkpoint's
    dtypes; None where they are not known (dummy weights, the planner): every linear not in the
    checkpoint's ignored modules counts as FP8 then."""
    out: WeightSpecs = {}
    for name, spec in specs.items():
        if spec.linear and _is_fp8(spec, quant, stored):
            _check_whole_tiles(spec, quant.block)
            scale = None if quant.online else scale_spec(spec, quant.block)
            spec = replace(spec, fp8=Fp8Spec(quant.block, scale, spec.dequantize_fp8))
        out[name] = spec
    return out


def _is_fp8(spec: WeightSpec, quant: Fp8Config, stored: StoredDtype | None) -> bool:
    if quant.online:
        return True
    name = weight_name(spec.source, stored)
    dtype = stored(name) if stored is not None else None
    if dtype is not None:
        return dtype == FP8_DTYPE
    # a module named, or one inside it ("model.layers.0.mlp.gate" is not "...mlp.gate_proj")
    module = name.rsplit(".", 1)[0]
    return not any(module == ig or module.startswith(ig + ".") for ig in quant.ignored if ig)


def _blocks(n: int, b: int) -> int:
    return -(-n // b)


def _check_whole_tiles(spec: WeightSpec, block: tuple[int, int]) -> None:
    piece = spec.piece
    if isinstance(piece, Slice):
        if piece.dim is None:
            return
        dim, start, stop, size = piece.dim, piece.start, piece.stop, spec.shape[piece.dim]
    else:  # stacked experts: the FFN width is w13's rows (each of gate, up), w2's columns
        dim = 1 if piece.is_w13 else 2
        start, stop, size = piece.i0, piece.i1, piece.width
    rows = dim == len(spec.shape) - 2
    b = block[0] if rows else block[1]
    if start % b or (stop % b and stop != size):
        raise LayoutError(
            f"{weight_name(spec.source)}: a rank of this layout holds "
            f"{'rows' if rows else 'columns'} [{start}, {stop}) of {size}, which cuts a "
            f"{block[0]}x{block[1]} FP8 block; FP8 weights need shard boundaries at multiples "
            f"of {b} (choose another --tp-size or --ep-size)"
        )


def scale_spec(spec: WeightSpec, block: tuple[int, int]) -> WeightSpec:
    """The spec of a weight's block scales: one per tile of the full weight (w13's gate and up
    each tiled on their own), the rank's tiles those of its shard, read from
    `<weight>_scale_inv` (per expert for stacked experts)."""
    bo, bi = block
    piece = spec.piece
    if isinstance(piece, Slice):
        rows, cols = spec.shape
        shape = (_blocks(rows, bo), _blocks(cols, bi))
        if piece.dim is not None:
            b = block[piece.dim]
            piece = Slice(piece.dim, piece.start // b, _blocks(piece.stop, b))
        assert isinstance(spec.source, str)
        return WeightSpec(shape, piece, spec.source + SCALE_SUFFIX, float32=True)
    assert isinstance(spec.source, ExpertSource)
    n, rows, cols = spec.shape
    b = bo if piece.is_w13 else bi
    if piece.is_w13:  # [E, 2I, H]: gate's tiles, then up's
        shape = (n, 2 * _blocks(rows // 2, bo), _blocks(cols, bi))
    else:  # [E, H, I]
        shape = (n, _blocks(rows, bo), _blocks(cols, bi))
    tiles = ExpertSlice(
        piece.experts, piece.i0 // b, _blocks(piece.i1, b), _blocks(piece.width, b), piece.is_w13
    )
    source = ExpertSource(None, tuple(e + SCALE_SUFFIX for e in spec.source.per_expert))
    return WeightSpec(shape, tiles, source, float32=True)


def check_fp8_flags(quant: Fp8Config | None, deterministic: bool) -> None:
    """FP8 weights are not served with --enable-deterministic-inference: their W8A8 kernels
    are not batch-invariant (the linear takes its split-K kernel up to 16 rows and tiles above,
    the fused MoE's tiles follow the token count)."""
    if quant is not None and deterministic:
        raise ModelConfigError(
            "--enable-deterministic-inference: FP8 weights run on W8A8 kernels whose results "
            "depend on the batch (no batch-invariant FP8 path yet); serve them without the flag"
        )
