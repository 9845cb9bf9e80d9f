"""Build a model and fill its weights: from safetensors, randomly (`dummy`), or the tiny model.

Each rank reads only the experts its placement holds. Both checkpoint layouts of Qwen3-MoE
experts are read: one tensor per expert and projection (`mlp.experts.{e}.gate_proj.weight`, as
transformers saves them) and the fused 3-D form (`mlp.experts.gate_up_proj`, `down_proj`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from safeserve.config import TINY_MODEL
from safeserve.model.config import ModelConfig
from safeserve.model.qwen3_moe import Qwen3MoeForCausalLM
from safeserve.moe.dispatch.base import Dispatcher
from safeserve.moe.placement import ExpertPlacement

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# The built-in tiny model: Qwen3-MoE shaped, byte-level vocabulary (256 bytes + 3 specials).
TINY_CONFIG: dict = {
    "model_type": "qwen3_moe",
    "vocab_size": 259,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [2],
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "eos_token_id": [256, 258],
}


class LoadError(ValueError):
    pass


def load_model_config(model: str) -> ModelConfig:
    if model == TINY_MODEL:
        return ModelConfig.from_dict(TINY_CONFIG)
    path = Path(model)
    if not path.is_dir():
        raise LoadError(f"--model {model!r} is neither 'tiny' nor a local checkpoint directory")
    return ModelConfig.from_file(path / "config.json")


def build_model(
    model: str,
    load_format: str,
    dtype: str,
    device: str,
    placement: ExpertPlacement,
    dispatcher: Dispatcher,
    seed: int = 0,
) -> Qwen3MoeForCausalLM:
    cfg = load_model_config(model)
    torch_dtype = DTYPES[dtype]
    with torch.device("meta"):
        net = Qwen3MoeForCausalLM(cfg, placement, dispatcher)
    net = net.to_empty(device=device).to(torch_dtype)
    # Buffers are not parameters: recompute them on the real device.
    net.rotary.__init__(cfg.head_dim, cfg.rope_theta)  # type: ignore[misc]
    net.rotary.to(device)
    for layer in net.layers:
        if layer.is_moe:
            layer.mlp.gate.logical_to_physical = torch.arange(cfg.num_experts, device=device)
    if cfg.tie_word_embeddings:
        net.lm_head.weight = net.embed_tokens.weight
    if model == TINY_MODEL or load_format == "dummy":
        init_random_weights(net, seed)
    else:
        load_safetensors(net, Path(model), placement)
    net.eval()
    return net


@torch.no_grad()
def init_random_weights(net: Qwen3MoeForCausalLM, seed: int) -> None:
    """Deterministic weights: every rank with the same seed builds the same model."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(net.named_parameters(), key=lambda kv: kv[0]):
        if name.endswith("norm.weight"):
            p.fill_(1.0)
            continue
        if name.endswith(".bias"):
            p.zero_()
            continue
        if name.endswith("experts.w13") or name.endswith("experts.w2"):
            # Draw all experts so every rank's slice equals the same experts of a one-rank run.
            placement = net.placement
            full = torch.randn((placement.num_physical_experts, *p.shape[1:]), generator=gen) * 0.02
            p.copy_(full[placement.local_start : placement.local_start + p.shape[0]])
            continue
        p.copy_(torch.randn(p.shape, generator=gen) * 0.02)


class _Checkpoint:
    """Lazy access to tensors across one or several safetensors files."""

    def __init__(self, model_dir: Path) -> None:
        index = model_dir / "model.safetensors.index.json"
        if index.exists():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in model_dir.glob("*.safetensors"))
            if not files:
                raise LoadError(f"no *.safetensors files in {model_dir}")
            weight_map = {}
        self.handles = {f: safe_open(str(model_dir / f), framework="pt") for f in files}
        if not weight_map:
            for f, h in self.handles.items():
                for k in h.keys():
                    weight_map[k] = f
        self.weight_map = weight_map

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def get(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise LoadError(f"checkpoint has no tensor {name!r}")
        return self.handles[self.weight_map[name]].get_tensor(name)

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self.handles[self.weight_map[name]].get_slice(name)[start:stop]

    def names(self) -> Iterator[str]:
        return iter(self.weight_map)


@torch.no_grad()
def load_safetensors(net: Qwen3MoeForCausalLM, model_dir: Path, placement: ExpertPlacement) -> None:
    ckpt = _Checkpoint(model_dir)
    cfg = net.config
    loaded: set[str] = set()

    def copy(dst: torch.Tensor, name: str) -> None:
        src = ckpt.get(name)
        if tuple(src.shape) != tuple(dst.shape):
            raise LoadError(
                f"{name}: checkpoint shape {tuple(src.shape)} != model {tuple(dst.shape)}"
            )
        dst.copy_(src)
        loaded.add(name)

    copy(net.embed_tokens.weight, "model.embed_tokens.weight")
    copy(net.norm.weight, "model.norm.weight")
    if not cfg.tie_word_embeddings:
        copy(net.lm_head.weight, "lm_head.weight")
    for i, layer in enumerate(net.layers):
        pre = f"model.layers.{i}."
        attn = layer.self_attn
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            copy(getattr(attn, proj).weight, f"{pre}self_attn.{proj}.weight")
            if cfg.attention_bias:
                copy(getattr(attn, proj).bias, f"{pre}self_attn.{proj}.bias")
        copy(attn.q_norm.weight, f"{pre}self_attn.q_norm.weight")
        copy(attn.k_norm.weight, f"{pre}self_attn.k_norm.weight")
        copy(layer.input_layernorm.weight, f"{pre}input_layernorm.weight")
        copy(layer.post_attention_layernorm.weight, f"{pre}post_attention_layernorm.weight")
        if not layer.is_moe:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                copy(getattr(layer.mlp, proj).weight, f"{pre}mlp.{proj}.weight")
            continue
        copy(layer.mlp.gate.weight, f"{pre}mlp.gate.weight")
        _load_experts(ckpt, layer.mlp.experts, f"{pre}mlp.experts.", placement, cfg, loaded)
    logger.info("loaded %d tensors from %s", len(loaded), model_dir)


def _load_experts(
    ckpt: _Checkpoint,
    runner: torch.nn.Module,
    prefix: str,
    placement: ExpertPlacement,
    cfg: ModelConfig,
    loaded: set[str],
) -> None:
    inter = cfg.moe_intermediate_size
    lo, hi = placement.local_start, placement.local_start + placement.experts_per_rank
    fused = f"{prefix}gate_up_proj"
    if fused in ckpt:
        runner.w13.copy_(ckpt.get_rows(fused, lo, hi))
        runner.w2.copy_(ckpt.get_rows(f"{prefix}down_proj", lo, hi))
        loaded.update({fused, f"{prefix}down_proj"})
        return
    for local, expert in enumerate(range(lo, hi)):
        e = f"{prefix}{expert}."
        runner.w13[local, :inter].copy_(ckpt.get(f"{e}gate_proj.weight"))
        runner.w13[local, inter:].copy_(ckpt.get(f"{e}up_proj.weight"))
        runner.w2[local].copy_(ckpt.get(f"{e}down_proj.weight"))
        loaded.update(f"{e}{p}.weight" for p in ("gate_proj", "up_proj", "down_proj"))
