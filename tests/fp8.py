"""Block-FP8 checkpoints for tests, made from a checkpoint `transformers` wrote, by a quantizer
written here from the format's definition (not safeserve's): every linear weight `X.weight`
[out, in] of the decoder layers becomes float8_e4m3fn with `X.weight_scale_inv` float32
[ceil(out / 128), ceil(in / 128)], one scale per 128 x 128 tile (the last ones partial), and
the weight is fp8 * the scale of its tile. The quantizer takes scale = max|tile| / 448 (448:
float8_e4m3fn's largest value), as DeepSeek-V3's does; and its float32 reference is a copy of
the checkpoint holding the dequantized weights."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from safeserve.parallel.layout import Layout

BLOCK = 128
FP8_MAX = 448.0
QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [BLOCK, BLOCK],
}


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, scale_inv) of a 2-D weight, tile by tile."""
    rows, cols = w.shape
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    s = torch.empty(math.ceil(rows / BLOCK), math.ceil(cols / BLOCK))
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            tile = (slice(i * BLOCK, (i + 1) * BLOCK), slice(j * BLOCK, (j + 1) * BLOCK))
            t = w[tile].float()
            s[i, j] = t.abs().max().clamp(min=1e-10) / FP8_MAX
            q[tile] = (t / s[i, j]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, s


def dequantize(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The float32 weight of the definition: each element times its tile's scale."""
    w = torch.empty(q.shape)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            tile = (slice(i * BLOCK, (i + 1) * BLOCK), slice(j * BLOCK, (j + 1) * BLOCK))
            w[tile] = q[tile].float() * s[i, j]
    return w


def is_linear(name: str) -> bool:
    """A linear weight of a decoder layer (attention, dense MLP, experts, Mixtral's w1/w2/w3;
    not the routers)."""
    ends = ("_proj.weight", "_mqa.weight", ".w1.weight", ".w2.weight", ".w3.weight")
    return name.startswith("model.layers.") and name.endswith(ends)


def _copy_other_files(src: Path, out: Path, config: dict) -> None:
    out.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            (out / f.name).write_bytes(f.read_bytes())
    (out / "config.json").write_text(json.dumps(config, indent=1))


def write_fp8_checkpoint(src: Path, out: Path, keep: tuple[str, ...] = (), shards: int = 1) -> Path:
    """The block-FP8 copy of the (single-file) checkpoint `src` at `out`; the modules named in
    `keep` stay in float32 and are listed in `modules_to_not_convert`. `shards` > 1: that many
    files, tensors dealt round-robin (a weight and its scale apart), with an index."""
    from safetensors.torch import load_file, save_file

    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {**QUANTIZATION_CONFIG, "modules_to_not_convert": list(keep)}
    _copy_other_files(src, out, config)
    tensors = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if is_linear(name) and name.rsplit(".", 1)[0] not in keep:
            tensors[name], tensors[name + "_scale_inv"] = quantize(t)
        else:
            tensors[name] = t
    if shards == 1:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        return out
    files = [f"model-{k + 1:05d}-of-{shards:05d}.safetensors" for k in range(shards)]
    weight_map = {name: files[k % shards] for k, name in enumerate(sorted(tensors))}
    for f in files:
        part = {n: t for n, t in tensors.items() if weight_map[n] == f}
        save_file(part, str(out / f), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return out


def write_dequantized_copy(fp8: Path, out: Path) -> Path:
    """The float32 checkpoint of an FP8 one's weights (no quantization_config): the reference
    that transformers runs."""
    from safetensors.torch import load_file, save_file

    config = json.loads((fp8 / "config.json").read_text())
    config.pop("quantization_config")
    _copy_other_files(fp8, out, config)
    stored = load_file(str(fp8 / "model.safetensors"))
    tensors = {}
    for name, t in stored.items():
        if name.endswith("_scale_inv"):
            continue
        scale = stored.get(name + "_scale_inv")
        tensors[name] = dequantize(t, scale) if scale is not None else t
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def fake_quant(x: torch.Tensor) -> torch.Tensor:
    """Activations as the `dynamic` scheme quantizes them, dequantized: per token and per
    group of 128 columns (the last partial) scale = max|x| / 448, x / scale rounded to fp8."""
    out = torch.empty_like(x, dtype=torch.float32)
    for j in range(0, x.shape[-1], BLOCK):
        g = x[..., j : j + BLOCK].float()
        scale = g.abs().amax(dim=-1, keepdim=True).clamp(min=1e-10) / FP8_MAX
        q = (g / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        out[..., j : j + BLOCK] = q.float() * scale
    return out.to(x.dtype)


def _fake_quant_experts(self, hidden_states, top_k_index, top_k_weights):  # type: ignore[no-untyped-def]
    """transformers' eager experts (`Qwen3MoeExperts.forward`) with both GEMMs' inputs
    fake-quantized."""
    out = torch.zeros_like(hidden_states)
    for e in range(self.num_experts):
        tok, pos = torch.where(top_k_index == e)
        if tok.numel() == 0:
            continue
        gate_up = torch.nn.functional.linear(fake_quant(hidden_states[tok]), self.gate_up_proj[e])
        gate, up = gate_up.chunk(2, dim=-1)
        y = torch.nn.functional.linear(fake_quant(self.act_fn(gate) * up), self.down_proj[e])
        out.index_add_(0, tok, y * top_k_weights[tok, pos, None])
    return out


def w8a8_reference(model: torch.nn.Module, quantized: set[str]) -> torch.nn.Module:
    """A transformers model (loaded from `write_dequantized_copy`) made to compute as W8A8
    does: the inputs of the linears whose weights were quantized (`quantized`: module names)
    and of the routed experts are fake-quantized."""
    import types

    for name, m in model.named_modules():
        if name in quantized and isinstance(m, torch.nn.Linear):
            m.register_forward_pre_hook(lambda _m, args: (fake_quant(args[0]),))
        elif hasattr(m, "gate_up_proj") and hasattr(m, "num_experts"):
            m.forward = types.MethodType(_fake_quant_experts, m)
    return model


def quantized_modules(fp8: Path) -> set[str]:
    """The modules whose weights the FP8 checkpoint stores quantized."""
    from safetensors import safe_open

    with safe_open(str(fp8 / "model.safetensors"), "pt") as f:
        return {k.removesuffix(".weight_scale_inv") for k in f.keys() if k.endswith("_scale_inv")}


def build_ours(model: Path | str, layout: Layout | None = None, **kw: Any) -> torch.nn.Module:
    """Our model (`build_model`, float32 on CPU) on one rank of `layout` (a
    None: the single rank); `kw`: build_model's options."""
    from safeserve.model.checkpoint import load_model_config
    from safeserve.model.loader import build_model
    from safeserve.moe.dispatch import LocalDispatcher, make_dispatcher
    from safeserve.moe.placement import ExpertPlacement
    from safeserve.parallel.comm import Comm

    experts = load_model_config(str(model)).num_experts
    if layout is None:
        d = LocalDispatcher(ExpertPlacement(experts))
        return build_model(str(model), "auto", "float32", "cpu", d, **kw)
    comm = Comm(layout, torch.device("cpu"))  # never initialized: loading runs no collective
    placement = ExpertPlacement(experts, layout.ep_size, layout.ep_rank)
    d = make_dispatcher("none", placement, comm)
    return build_model(str(model), "auto", "float32", "cpu", d, layout, comm, **kw)


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    """The two models hold the same parameters: names, dtypes and bits."""
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name, t in sa.items():
        assert t.dtype == sb[name].dtype, name
        assert torch.equal(t.view(torch.uint8), sb[name].view(torch.uint8)), name
