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
from safeserve.model import registry
from safeserve.model.config import Fp8Config, ModelConfig, ModelConfigError
from safeserve.model.quant import FP8_DTYPE, StoredDtype, weight_name
from safeserve.model.spec import ExpertSource, Slice, WeightSpec
from safeserve.parallel.layout import Layout

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


def load_model_config(model: str, quantization: str | None = None) -> ModelConfig:
    """The family's config of `--model` (ModelConfigError, one line, where it is unservable);
    `quantization` (`--quantization`): "fp8" quantizes a high-precision checkpoint at load (a
    checkpoint already in FP8 is read as it is)."""
    cfg = _model_config(model)
    if quantization == "fp8" and cfg.quant is None:
        cfg.quant = Fp8Config(online=True)
    return cfg


def _model_config(model: str) -> ModelConfig:
    if model == TINY_MODEL:
        return registry.parse_config(TINY_CONFIG)
    path = Path(model)
    if not path.is_dir():
        raise LoadError(f"--model {model!r} is neither 'tiny' nor a local checkpoint directory")
    config = path / "config.json"
    try:
        d = json.loads(config.read_text())
    except FileNotFoundError as e:
        raise ModelConfigError(f"no config.json at {config}") from e
    except json.JSONDecodeError as e:
        raise ModelConfigError(f"{config} is not valid JSON: {e}") from e
    return registry.parse_config(d)


class _Checkpoint:
    """Lazy access to tensors across one or several safetensors files, as tensors of
    `framework` (safetensors' name: "pt" for torch)."""

    def __init__(self, model_dir: Path, framework: str = "pt") -> None:
        self.model_dir = model_dir
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
        if weight_map:  # the index must say where each tensor is (headers only)
            held = {f: set(h.keys()) for f, h in self.handles.items()}
            for name, f in weight_map.items():
                if name not in held[f]:
                    raise LoadError(
                        f"{index.name} puts tensor {name!r} in {f}, which has no such tensor"
                    )
        else:
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

    def dtype(self, name: str) -> str | None:
        """The stored dtype (safetensors' name, e.g. "BF16", "F8_E4M3"), None if absent."""
        if name not in self.weight_map:
            return None
        return str(self.handles[self.weight_map[name]].get_slice(name).get_dtype())

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


def stored_dtypes(model: str, cfg: ModelConfig) -> StoredDtype | None:
    """The stored dtypes of an FP8 checkpoint's tensors (headers only), which decide what is
    FP8 (`model/quant.py`); None for other checkpoints."""
    if cfg.quant is None or cfg.quant.online:
        return None
    try:
        return _Checkpoint(Path(model), _HEADER_FRAMEWORK).dtype
    except LoadError:
        raise
    except Exception as e:  # unreadable index or safetensors header
        raise LoadError(f"cannot read the checkpoint in {model}: {e}") from e


def check_checkpoint(model: str, cfg: ModelConfig) -> None:
    """Header-only check, before any rank starts, that the checkpoint holds every tensor the
    model needs with its full shape (no tensor data is read), FP8 weights with their block
    scales. A broken checkpoint then fails in a second with the tensor named, instead of after
    every group's start-up and restarts."""
    try:
        ckpt = _Checkpoint(Path(model), _HEADER_FRAMEWORK)
    except LoadError:
        raise
    except Exception as e:  # unreadable index or safetensors header
        raise LoadError(f"cannot read the checkpoint in {model}: {e}") from e

    def expect(name: str, shape: tuple[int, ...]) -> None:
        if name not in ckpt:
            raise LoadError(f"checkpoint in {model} has no tensor {name!r}")
        if ckpt.shape(name) != shape:
            raise LoadError(f"{name}: checkpoint shape {ckpt.shape(name)} != expected {shape}")

    def expect_spec(spec: WeightSpec) -> None:
        if isinstance(spec.source, str):
            expect(spec.source, spec.shape)
            return
        if spec.source.fused is not None and spec.source.fused in ckpt:
            expect(spec.source.fused, spec.shape)
            return
        for e in range(spec.shape[0]):
            for name, shape in zip(
                spec.source.expert_names(e), expert_shapes(spec.source, spec.shape), strict=True
            ):
                expect(name, shape)

    stored = ckpt.dtype if cfg.quant is not None and not cfg.quant.online else None
    for _, spec in sorted(registry.weight_specs(cfg, Layout(), stored=stored).items()):
        expect_spec(spec)
        name = weight_name(spec.source, ckpt.dtype)
        scale = spec.fp8.scale if spec.fp8 is not None else None
        if scale is None:
            # An FP8 tensor read as a high-precision one would lose its scales unnoticed.
            if ckpt.dtype(name) == FP8_DTYPE:
                raise LoadError(
                    f"{name} is stored as FP8, which is read only for linear weights of a "
                    "checkpoint whose config.json has an fp8 quantization_config"
                )
            continue
        if isinstance(spec.source, ExpertSource) and name == spec.source.fused:
            raise LoadError(
                f"{name}: FP8 experts are read from per-expert tensors (with per-expert "
                "weight_scale_inv), not from a fused 3-D tensor"
            )
        expect_spec(scale)


def expert_shapes(source: ExpertSource, full: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The shape of each per-expert tensor of a stacked parameter of shape `full`: gate and up
    [I, H] each of w13 [E, 2I, H] (two names), or down [H, I] of w2 [E, H, I] (one name)."""
    rows, cols = full[1], full[2]
    parts = len(source.per_expert)
    return [(rows // parts, cols)] * parts
