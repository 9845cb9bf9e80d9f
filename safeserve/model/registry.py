"""Model families: a Hugging Face `model_type` (or `architectures` entry) -> its family package.

A family package `safeserve/model/<family>/` holds `spec.py` (torch-free: the config parser
`parse_config`, the weight specification `weight_specs`, the KV-cache specification `kv_spec`,
and `MODEL`, the name of its model class) and `model.py` (the torch model). The frontend reads
specs only; the ranks import the model. Families are imported on first use.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from safeserve.model.config import ModelConfig, ModelConfigError
from safeserve.model.quant import StoredDtype, fp8_specs
from safeserve.model.spec import KVSpec, WeightSpecs
from safeserve.moe.expert_map import ExpertMap
from safeserve.parallel.layout import Layout

FAMILIES: dict[str, str] = {
    "qwen3_moe": "safeserve.model.qwen3_moe",
    "mixtral": "safeserve.model.mixtral",
    "qwen2_moe": "safeserve.model.qwen2_moe",
    "deepseek_v3": "safeserve.model.deepseek_v3",
}
ARCHITECTURES: dict[str, str] = {
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}


def supported() -> str:
    return ", ".join(f"{t} ({a})" for a, t in ARCHITECTURES.items())


def family_name(d: dict[str, Any]) -> str:
    """The family of a `config.json`: its `model_type`, else its first known architecture."""
    model_type = d.get("model_type") or ""
    if model_type in FAMILIES:
        return model_type
    for arch in d.get("architectures") or []:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    named = model_type or ", ".join(d.get("architectures") or []) or "none given"
    raise ModelConfigError(f"model_type {named!r} is not supported (supported: {supported()})")


def spec_module(name: str) -> ModuleType:
    return importlib.import_module(FAMILIES[name] + ".spec")


def parse_config(d: dict[str, Any]) -> ModelConfig:
    """The family's config of a `config.json` dict; ModelConfigError (one line) if unservable."""
    family = family_name(d)
    cfg: ModelConfig = spec_module(family).parse_config(d)
    # the family it was chosen as, which every later lookup dispatches on (a config may name
    # only its architecture, or a `model_type` of its own: Kimi K2's `kimi_k2`)
    cfg.model_type = family
    cfg.check()
    return cfg


def weight_specs(
    cfg: ModelConfig,
    layout: Layout,
    expert_map: ExpertMap | None = None,
    stored: StoredDtype | None = None,
) -> WeightSpecs:
    """Every parameter of the family's model on this rank, its routed experts placed by
    `expert_map` (None: the trivial map); LayoutError where it cannot be laid out so. Under
    FP8 (`cfg.quant`) the FP8 weights are marked, by the checkpoint's dtypes (`stored`) where
    they are known (`model/quant.py`)."""
    specs = spec_module(cfg.model_type).weight_specs(cfg, layout, expert_map)
    if cfg.quant is not None:
        specs = fp8_specs(specs, cfg.quant, stored)
    return specs


def kv_spec(cfg: ModelConfig, layout: Layout) -> KVSpec:
    return spec_module(cfg.model_type).kv_spec(cfg, layout)


def model_class(cfg: ModelConfig) -> type:
    """The family's torch model class (imports torch)."""
    module, _, name = spec_module(cfg.model_type).MODEL.partition(":")
    return getattr(importlib.import_module(module), name)


def check_layout(cfg: ModelConfig, layout: Layout, stored: StoredDtype | None = None) -> None:
    """Raises LayoutError (one line) when the model cannot be laid out so (`stored`: the
    checkpoint's dtypes, which decide what is FP8, as `weight_specs`')."""
    weight_specs(cfg, layout, stored=stored)
    kv_spec(cfg, layout)
