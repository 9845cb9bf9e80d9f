"""A `config.json` that leaves fields out is read as transformers reads it: for every family and
every field its transformers config class fills in (the family's `DEFAULTS`), the config we parse
from a copy without the field equals transformers' `AutoConfig` of that copy; Mixtral without
`rope_theta` (RoPE base 1e6, not 1e4) serves transformers' logits; and a config that names only
its architecture (no `model_type`) is parsed as that family, its tensors and KV cache too."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from checkpoints import write_qwen3_moe_checkpoint
from checkpoints_families import write_mixtral_checkpoint, write_qwen2_moe_checkpoint
from model_checks import paged_logits_match_transformers

from safeserve.model import registry
from safeserve.parallel.layout import Layout

WRITERS = {
    "qwen3_moe": write_qwen3_moe_checkpoint,
    "mixtral": write_mixtral_checkpoint,
    "qwen2_moe": write_qwen2_moe_checkpoint,
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("defaults")
    return {f: w(base / f, seed=2) for f, w in WRITERS.items()}


def _without(good: Path, out: Path, *keys: str) -> tuple[Path, dict]:
    shutil.copytree(good, out)
    cfg = json.loads((out / "config.json").read_text())
    for k in keys:
        cfg.pop(k, None)
    if "rope_theta" in keys:  # transformers 5 writes it inside rope_parameters
        cfg.get("rope_parameters", {}).pop("rope_theta", None)
    (out / "config.json").write_text(json.dumps(cfg))
    return out, cfg


def _ours(cfg, key: str):  # type: ignore[no-untyped-def]
    return {
        "num_local_experts": cfg.num_experts,
        "num_experts": cfg.num_experts,
        "rope_theta": cfg.rope.theta,
    }.get(key, getattr(cfg, key, None))


def _theirs(hf, key: str):  # type: ignore[no-untyped-def]
    if key == "rope_theta":
        return (hf.rope_parameters or {}).get("rope_theta", getattr(hf, "rope_theta", None))
    if key in ("num_experts", "num_local_experts"):
        return getattr(hf, "num_local_experts", None) or getattr(hf, "num_experts", None)
    return getattr(hf, key)


@pytest.mark.parametrize("family", list(WRITERS))
def test_a_field_left_out_is_what_transformers_fills_in(
    ckpts: dict[str, Path], family: str, tmp_path: Path
) -> None:
    from transformers import AutoConfig

    defaults = registry.spec_module(family).DEFAULTS
    assert defaults
    for key in defaults:
        experts = ("num_experts", "num_local_experts")  # one field, two names
        names = set(experts) if key in experts else {key}
        path, raw = _without(ckpts[family], tmp_path / key, *names)
        # the family's parser alone: a default may not fit this small shape (16 KV heads)
        ours = registry.spec_module(family).parse_config(raw)
        hf = AutoConfig.from_pretrained(path)
        assert _ours(ours, key) == _theirs(hf, key), (family, key)
        assert ours.raw == raw  # as written: nothing added


def test_mixtral_without_rope_theta_serves_transformers_logits(
    ckpts: dict[str, Path], tmp_path: Path
) -> None:
    path, _ = _without(ckpts["mixtral"], tmp_path / "no-theta", "rope_theta", "rms_norm_eps")
    paged_logits_match_transformers(path)


@pytest.mark.parametrize("family", list(WRITERS))
def test_a_config_that_names_only_its_architecture(
    ckpts: dict[str, Path], family: str, tmp_path: Path
) -> None:
    path, raw = _without(ckpts[family], tmp_path / "no-type", "model_type")
    assert "architectures" in raw
    cfg = registry.parse_config(raw)
    assert cfg.model_type == family
    layout = Layout(tp_size=1, ep_size=1)
    assert registry.weight_specs(cfg, layout) and registry.kv_spec(cfg, layout)
    registry.check_layout(cfg, layout)
