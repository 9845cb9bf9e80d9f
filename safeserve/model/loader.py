"""Build a model and fill its weights: from safetensors, randomly (`dummy`), or the tiny model.
(Its config and the checkpoint's headers are read in `checkpoint.py`, without torch.)

Each rank reads only the experts its placement holds. Both checkpoint layouts of Qwen3-MoE
experts are read: one tensor per expert and projection (`mlp.experts.{e}.gate_proj.weight`, as
transformers saves them) and the fused 3-D form (`mlp.experts.gate_up_proj`, `down_proj`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from safeserve.config import TINY_MODEL
from safeserve.engine.parallel import Comm, Layout
from safeserve.model.checkpoint import TINY_CONFIG as TINY_CONFIG  # re-exported
from safeserve.model.checkpoint import (
    LoadError,
    _Checkpoint,
    _expert_names,
    _hf_name,
    load_model_config,
)
from safeserve.model.checkpoint import check_checkpoint as check_checkpoint  # re-exported
from safeserve.model.config import ModelConfig
from safeserve.model.qwen3_moe import Qwen3MoeForCausalLM
from safeserve.model.sharding import ExpertSlice, Slice, shard_specs
from safeserve.moe.dispatch.base import Dispatcher

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
) -> Qwen3MoeForCausalLM:
    """This rank's shard of the model, with its weights filled."""
    cfg = load_model_config(model)
    layout = layout or Layout()
    comm = comm or Comm(layout, torch.device(device))
    torch_dtype = DTYPES[dtype]
    with torch.device("meta"), _NoInitOnMeta():
        net = Qwen3MoeForCausalLM(cfg, layout, comm, dispatcher)
    net = _to_empty(net, device, torch_dtype)
    # Buffers are not parameters: recompute them on the real device.
    net.rotary.__init__(cfg.head_dim, cfg.rope_theta)  # type: ignore[misc]
    net.rotary.to(device)
    for layer in net.layers:
        if layer.is_moe:
            layer.mlp.gate.reset_buffers(device)
    if cfg.tie_word_embeddings:
        net.lm_head.weight = net.embed_tokens.weight
    # Before filling: the per-projection parameters become views of the fused weights.
    net.fuse_projections()
    specs = shard_specs(cfg, layout)
    params = dict(net.named_parameters())
    missing = set(params) - set(specs) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    if missing:
        raise LoadError(f"no shard rule for {sorted(missing)[:3]}")
    if model == TINY_MODEL or load_format == "dummy":
        init_random_weights(params, specs, seed)
    else:
        load_safetensors(params, specs, Path(model), cfg)
    net.eval()
    return net


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
    Qwen3-30B-A3B instead of about 60)."""
    return net._apply(
        lambda t: torch.empty_strided(
            t.size(), t.stride(), dtype=dtype if t.is_floating_point() else t.dtype, device=device
        )
    )


@torch.no_grad()
def init_random_weights(params: dict[str, torch.nn.Parameter], specs: dict, seed: int) -> None:
    """Deterministic weights: the same full model whatever the layout; each rank keeps its slice."""
    for index, name in enumerate(sorted(specs)):
        full_shape, piece = specs[name]
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
        p.copy_(piece.apply(full))
        del full


@torch.no_grad()
def load_safetensors(
    params: dict[str, torch.nn.Parameter], specs: dict, model_dir: Path, cfg: ModelConfig
) -> None:
    ckpt = _Checkpoint(model_dir)
    for name in sorted(specs):
        full_shape, piece = specs[name]
        dst = params[name]
        if isinstance(piece, ExpertSlice):
            _load_experts(ckpt, dst, name, piece, full_shape)
            continue
        hf = _hf_name(name)
        shape = ckpt.shape(hf)
        if shape != full_shape:
            raise LoadError(f"{hf}: checkpoint shape {shape} != expected {full_shape}")
        src = ckpt.get_slice(hf, piece)
        dst.copy_(src)
    logger.info("loaded %d tensors from %s", len(specs), model_dir)


def _load_experts(
    ckpt: _Checkpoint,
    dst: torch.Tensor,
    name: str,
    piece: ExpertSlice,
    full_shape: tuple[int, ...],
) -> None:
    prefix, fused = _expert_names(name, piece)
    if fused in ckpt:
        if ckpt.shape(fused) != full_shape:
            raise LoadError(
                f"{fused}: checkpoint shape {ckpt.shape(fused)} != expected {full_shape}"
            )
        rows = ckpt.get_slice(fused, Slice(0, piece.e0, piece.e1))
        local = ExpertSlice(0, piece.e1 - piece.e0, piece.i0, piece.i1, piece.width, piece.is_w13)
        dst.copy_(local.apply(rows))
        return
    width = piece.i1 - piece.i0
    for local_e, e in enumerate(range(piece.e0, piece.e1)):
        base = f"{prefix}{e}."
        if piece.is_w13:
            dst[local_e, :width].copy_(
                ckpt.get_slice(base + "gate_proj.weight", Slice(0, piece.i0, piece.i1))
            )
            dst[local_e, width:].copy_(
                ckpt.get_slice(base + "up_proj.weight", Slice(0, piece.i0, piece.i1))
            )
        else:
            dst[local_e].copy_(
                ckpt.get_slice(base + "down_proj.weight", Slice(1, piece.i0, piece.i1))
            )
