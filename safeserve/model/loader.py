"""Build a family's model and fill its weights: from safetensors, randomly (`dummy`), or the
tiny model. (Its config and the checkpoint's headers are read in `checkpoint.py`, without torch.)

What is read from where follows the family's weight specification (`model/spec.py`): each
parameter's checkpoint tensor and the slice this rank holds, so each rank reads only its rows
and the experts its placement holds. Stacked experts are read from one tensor per expert and
projection (as transformers saves them) or from a fused 3-D tensor where the checkpoint has one.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from safeserve.config import TINY_MODEL
from safeserve.kernels.fp8_reference import FP8, block_dequantize, block_quantize
from safeserve.layers.linear import BlockFp8Linear
from safeserve.model import registry
from safeserve.model.base import CausalLM
from safeserve.model.checkpoint import TINY_CONFIG as TINY_CONFIG  # re-exported
from safeserve.model.checkpoint import LoadError, _Checkpoint, load_model_config
from safeserve.model.checkpoint import check_checkpoint as check_checkpoint  # re-exported
from safeserve.model.quant import FP8_DTYPE, SCALE_SUFFIX, weight_name
from safeserve.model.sharding import routing_source
from safeserve.model.spec import ExpertSlice, ExpertSource, Slice, WeightSpec, WeightSpecs
from safeserve.moe.dispatch.base import Dispatcher
from safeserve.moe.layer import write_expert_map
from safeserve.moe.runner import ExpertRunner
from safeserve.parallel.comm import Comm, Layout

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_model(
    model: str,
    load_format: str,
    dtype: str,
    device: str | torch.device,
    dispatcher: Dispatcher,
    layout: Layout | None = None,
    comm: Comm | None = None,
    seed: int = 0,
    quantization: str | None = None,
) -> CausalLM:
    """This rank's shard of the model, with its weights filled (`quantization`: as
    `--quantization`)."""
    cfg = load_model_config(model, quantization)
    layout = layout or Layout()
    comm = comm or Comm(layout, torch.device(device))
    torch_dtype = DTYPES[dtype]
    # The expert map (None: the trivial one) places the routed experts: the routers' rows of
    # this rank's send table, and the logical expert whose weights each local slot holds.
    expert_map = dispatcher.placement.expert_map if cfg.num_experts else None
    ckpt = None if model == TINY_MODEL or load_format == "dummy" else _Checkpoint(Path(model))
    stored = ckpt.dtype if ckpt is not None and cfg.quant and not cfg.quant.online else None
    specs = registry.weight_specs(cfg, layout, expert_map, stored)
    with torch.device("meta"), _NoInitOnMeta():
        net = registry.model_class(cfg)(cfg, layout, comm, dispatcher)
        _use_fp8(net, specs)  # before allocation: the weights are never held in high precision
    net = _to_empty(net, device, torch_dtype)
    # Buffers are not parameters: recompute them on the real device.
    net.reset_buffers(device)
    moe = [layer.mlp for layer in net.layers if layer.is_moe]
    if moe:
        placement = dispatcher.placement
        m = placement.map_for(cfg.num_experts, len(moe))
        write_expert_map(moe, m, routing_source(layout))
    # Before filling: the per-projection parameters become views of the fused weights.
    net.fuse_projections()
    params = dict(net.named_parameters())
    scales = {n + SCALE_SUFFIX for n, s in specs.items() if s.fp8 and not s.fp8.dequantize}
    tied = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    missing = set(params) - set(specs) - scales - tied
    if missing:
        raise LoadError(f"no weight spec for {sorted(missing)[:3]}")
    extra = (set(specs) | scales) - set(params)
    if extra:
        raise LoadError(f"weight spec names no parameter: {sorted(extra)[:3]}")
    if ckpt is None:
        init_random_weights(params, specs, seed)
    else:
        load_safetensors(params, specs, ckpt)
    net.eval()
    return net


def _use_fp8(net: torch.nn.Module, specs: WeightSpecs) -> None:
    """Makes the modules of the specs' FP8 weights block FP8: linears become `BlockFp8Linear`,
    expert runners hold FP8 experts."""
    modules = dict(net.named_modules())
    for name, spec in specs.items():
        if spec.fp8 is None or spec.fp8.dequantize:
            continue
        owner, _, param = name.rpartition(".")
        m = modules[owner]
        if isinstance(m, ExpertRunner):
            if m.block is None:
                m.use_fp8(spec.fp8.block)
        elif isinstance(m, torch.nn.Linear) and param == "weight":
            parent, _, attr = owner.rpartition(".")
            setattr(modules[parent], attr, BlockFp8Linear.like(m, spec.fp8.block))
        else:
            raise LoadError(f"{name} is not a linear layer's weight: it cannot be FP8")


class _NoInitOnMeta(TorchFunctionMode):
    """Building the model on the meta device without the work that is thrown away: every
    parameter and buffer is replaced by `to_empty` and filled (weights) or recomputed (rotary
    and router buffers) on the real device afterwards. So the modules' own random
    initialisation (`nn.Embedding`, `nn.Linear`) is skipped, and index ranges (`arange`, a few
    elements) are made on the CPU: on meta tensors `normal_` and arithmetic such as the rotary
    frequencies run Python decompositions whose first call imports `torch._dynamo`, about 2 s
    of every rank's start-up."""

    FILLS = (torch.nn.init.normal_, torch.nn.init.uniform_, torch.nn.init.kaiming_uniform_)

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in self.FILLS:
            tensor = args[0] if args else kwargs["tensor"]
            if tensor.is_meta:
                return tensor
        if func is torch.arange and kwargs.get("device") is None:
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def _to_empty(
    net: torch.nn.Module, device: str | torch.device, dtype: torch.dtype
) -> torch.nn.Module:
    """`net.to_empty(device=device).to(dtype)` in one pass through `torch.empty_strided`:
    `empty_like` of a meta tensor runs a Python decomposition whose first call imports sympy,
    about 1 s of every rank's start-up. Floating tensors are made in `dtype` at once: made in
    the modules' float32 and cast afterwards, a bf16 model held twice its size on the device
    for a moment, and the allocator kept that memory cached, so the KV cache, sized from the
    device's free memory, lost as much as the weights (4 GB of KV on an H200 with
    Qwen3-30B-A3B instead of about 60). FP8 weights and their float32 scales keep their dtype."""
    keep = {id(p) for n, p in net.named_parameters() if p.dtype == FP8 or n.endswith(SCALE_SUFFIX)}
    return net._apply(
        lambda t: torch.empty_strided(
            t.size(),
            t.stride(),
            dtype=dtype if t.is_floating_point() and id(t) not in keep else t.dtype,
            device=device,
        )
    )


@torch.no_grad()
def init_random_weights(
    params: dict[str, torch.nn.Parameter], specs: WeightSpecs, seed: int
) -> None:
    """Deterministic weights: the same full model whatever the layout; each rank keeps its slice
    (FP8 weights: its slice of the random weight, quantized)."""
    for index, name in enumerate(sorted(specs)):
        full_shape, piece = specs[name].shape, specs[name].piece
        p = params[name]
        if name.endswith("norm.weight"):
            p.fill_(1.0)
            continue
        if name.endswith("bias"):
            p.zero_()
            continue
        # One generator per tensor, so that a tensor's values do not depend on the others'.
        gen = torch.Generator(device=p.device).manual_seed(seed * 1_000_003 + index)
        full = torch.randn(full_shape, generator=gen, device=p.device, dtype=torch.float32) * 0.02
        _store(params, name, specs[name], piece.apply(full))
        del full


def _store(
    params: dict[str, torch.nn.Parameter], name: str, spec: WeightSpec, value: torch.Tensor
) -> None:
    """This rank's slice `value` of a weight into its parameter, quantized where it is FP8
    (held dequantized: rounded through FP8, as the checkpoint's FP8 would be)."""
    if spec.fp8 is None:
        params[name].copy_(value)
        return
    block = spec.fp8.block
    if spec.fp8.dequantize:
        params[name].copy_(block_dequantize(*block_quantize(value, block), block))
        return
    if isinstance(spec.piece, ExpertSlice) and spec.piece.is_w13:
        # gate and up are tiled each on its own, as a checkpoint stores them
        width = value.shape[1] // 2
        halves = [block_quantize(value[:, :width], block), block_quantize(value[:, width:], block)]
        tiles = halves[0][1].shape[1]
        for k, (q, s) in enumerate(halves):
            params[name][:, k * width : (k + 1) * width].copy_(q)
            params[name + SCALE_SUFFIX][:, k * tiles : (k + 1) * tiles].copy_(s)
        return
    q, s = block_quantize(value, block)
    params[name].copy_(q)
    params[name + SCALE_SUFFIX].copy_(s)


@torch.no_grad()
def load_safetensors(
    params: dict[str, torch.nn.Parameter], specs: WeightSpecs, ckpt: _Checkpoint
) -> None:
    """Each parameter's slice from the checkpoint: FP8 weights with their block scales as
    stored, or quantized as they are read (`--quantization fp8`: one tensor at a time in
    float32, never the whole model)."""
    for name in sorted(specs):
        spec, dst = specs[name], params[name]
        fp8 = spec.fp8
        stored = ckpt.dtype(weight_name(spec.source, ckpt.dtype))
        if stored == FP8_DTYPE and (fp8 is None or fp8.scale is None):
            raise LoadError(
                f"{weight_name(spec.source, ckpt.dtype)} is stored as FP8 without scales"
            )
        if fp8 is None:
            _read(ckpt, dst, spec)
        elif fp8.scale is not None and not fp8.dequantize:
            _read(ckpt, dst, spec)
            _read(ckpt, params[name + SCALE_SUFFIX], fp8.scale)
        elif fp8.scale is not None:  # stored FP8, held dequantized
            assert isinstance(fp8.scale.source, str) and isinstance(fp8.scale.piece, Slice)
            q = torch.empty(dst.shape, dtype=FP8, device=dst.device)
            _read(ckpt, q, spec)
            scale = ckpt.get_slice(fp8.scale.source, fp8.scale.piece).to(dst.device)
            dst.copy_(block_dequantize(q, scale, fp8.block))
        else:  # quantized as read (online)
            value = torch.empty(dst.shape, dtype=torch.float32, device=dst.device)
            _read(ckpt, value, spec)
            _store(params, name, spec, value)
            del value
    logger.info("loaded %d tensors from %s", len(specs), ckpt.model_dir)


def _read(ckpt: _Checkpoint, dst: torch.Tensor, spec: WeightSpec) -> None:
    """This rank's slice of the checkpoint tensor(s) of `spec` into `dst`."""
    if isinstance(spec.source, ExpertSource):
        assert isinstance(spec.piece, ExpertSlice)
        _load_experts(ckpt, dst, spec.source, spec.piece, spec.shape)
        return
    shape = ckpt.shape(spec.source)
    if shape != spec.shape:
        raise LoadError(f"{spec.source}: checkpoint shape {shape} != expected {spec.shape}")
    assert isinstance(spec.piece, Slice)
    dst.copy_(ckpt.get_slice(spec.source, spec.piece))


def _load_experts(
    ckpt: _Checkpoint,
    dst: torch.Tensor,
    source: ExpertSource,
    piece: ExpertSlice,
    full_shape: tuple[int, ...],
) -> None:
    if source.fused is not None and source.fused in ckpt:
        if ckpt.shape(source.fused) != full_shape:
            raise LoadError(
                f"{source.fused}: checkpoint shape {ckpt.shape(source.fused)} != "
                f"expected {full_shape}"
            )
        block = piece.contiguous
        if block is not None:  # one read of the block of rows
            dst.copy_(piece.narrow(ckpt.get_slice(source.fused, Slice(0, block.start, block.stop))))
            return
        for slot, e in enumerate(piece.experts):  # each slot its logical expert's row
            dst[slot : slot + 1].copy_(
                piece.narrow(ckpt.get_slice(source.fused, Slice(0, e, e + 1)))
            )
        return
    width = piece.i1 - piece.i0
    for slot, e in enumerate(piece.experts):
        names = source.expert_names(e)
        if piece.is_w13:
            gate, up = names
            dst[slot, :width].copy_(ckpt.get_slice(gate, Slice(0, piece.i0, piece.i1)))
            dst[slot, width:].copy_(ckpt.get_slice(up, Slice(0, piece.i0, piece.i1)))
        else:
            dst[slot].copy_(ckpt.get_slice(names[0], Slice(1, piece.i0, piece.i1)))
