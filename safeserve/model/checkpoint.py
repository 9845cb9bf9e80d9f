"""What the frontend reads of a model before any rank starts, without torch: its config (or the
built-in tiny model's) and the tensor names and shapes in its safetensors headers.

`safeserve.model.loader` builds the model and fills its weights (in the ranks).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import safe_open

from safeserve.config import TINY_MODEL
from safeserve.engine.layout import Layout
from safeserve.model.config import ModelConfig
from safeserve.model.sharding import ExpertSlice, Slice, shard_specs

if TYPE_CHECKING:
    import torch

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


class _Checkpoint:
    """Lazy access to tensors across one or several safetensors files, as tensors of
    `framework` (safetensors' name: "pt" for torch)."""

    def __init__(self, model_dir: Path, framework: str = "pt") -> None:
        index = model_dir / "model.safetensors.index.json"
        if index.exists():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in model_dir.glob("*.safetensors"))
            if not files:
                raise LoadError(f"no *.safetensors files in {model_dir}")
            weight_map = {}
        self.handles = {f: safe_open(str(model_dir / f), framework=framework) for f in files}
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

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.weight_map:
            raise LoadError(f"checkpoint has no tensor {name!r}")
        return tuple(self.handles[self.weight_map[name]].get_slice(name).get_shape())

    def get_slice(self, name: str, piece: Slice) -> torch.Tensor:
        """Reads only the rows (or columns) this rank holds."""
        if piece.dim is None:
            return self.get(name)
        index = tuple([slice(None)] * piece.dim + [slice(piece.start, piece.stop)])
        return self.handles[self.weight_map[name]].get_slice(name)[index]


# The start-up check reads headers only (names, shapes: the same under every framework, bf16 and
# fp8 tensors included), through NumPy where it is installed: torch's would import torch into
# the frontend, seconds of its start-up.
_HEADER_FRAMEWORK = "numpy" if importlib.util.find_spec("numpy") is not None else "pt"


def check_checkpoint(model: str, cfg: ModelConfig) -> None:
    """Header-only check, before any rank starts, that the checkpoint holds every tensor the
    model needs with its full shape (no tensor data is read). A broken checkpoint then fails in
    a second with the tensor named, instead of after every group's start-up and restarts."""
    try:
        ckpt = _Checkpoint(Path(model), _HEADER_FRAMEWORK)
    except LoadError:
        raise
    except Exception as e:  # unreadable index or safetensors header
        raise LoadError(f"cannot read the checkpoint in {model}: {e}") from e
    h, w = cfg.hidden_size, cfg.moe_intermediate_size

    def expect(name: str, shape: tuple[int, ...]) -> None:
        if name not in ckpt:
            raise LoadError(f"checkpoint in {model} has no tensor {name!r}")
        if ckpt.shape(name) != shape:
            raise LoadError(f"{name}: checkpoint shape {ckpt.shape(name)} != expected {shape}")

    for name, (full_shape, piece) in sorted(shard_specs(cfg, Layout()).items()):
        if not isinstance(piece, ExpertSlice):
            expect(_hf_name(name), full_shape)
            continue
        prefix, fused = _expert_names(name, piece)
        if fused in ckpt:
            expect(fused, full_shape)
            continue
        for e in range(cfg.num_experts):
            if piece.is_w13:
                expect(f"{prefix}{e}.gate_proj.weight", (w, h))
                expect(f"{prefix}{e}.up_proj.weight", (w, h))
            else:
                expect(f"{prefix}{e}.down_proj.weight", (h, w))


def _hf_name(name: str) -> str:
    if name == "lm_head.weight":
        return name
    if name.endswith("self_attn.o_bias"):
        return "model." + name.replace("o_bias", "o_proj.bias")
    return "model." + name


def _expert_names(name: str, piece: ExpertSlice) -> tuple[str, str]:
    """For our stacked expert parameter `name`: the checkpoint's per-expert prefix
    (`model.layers.L.mlp.experts.`) and its fused tensor's name (gate_up_proj / down_proj)."""
    prefix = "model." + name.rsplit(".", 1)[0] + "."
    return prefix, prefix + ("gate_up_proj" if piece.is_w13 else "down_proj")
