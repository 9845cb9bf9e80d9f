"""The header-only checkpoint check that `safeserve serve` runs before starting any rank, on
checkpoints written by `transformers` and then broken in one place."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from checkpoints import write_qwen3_moe_checkpoint
from model_checks import broken_copy

from safeserve.model.loader import LoadError, check_checkpoint, load_model_config


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_qwen3_moe_checkpoint(tmp_path_factory.mktemp("ckpt") / "good", seed=3)


def test_accepts_a_transformers_checkpoint(good: Path) -> None:
    check_checkpoint(str(good), load_model_config(str(good)))


def test_names_a_missing_expert_tensor(good: Path, tmp_path: Path) -> None:
    name = "model.layers.0.mlp.experts.3.down_proj.weight"
    ckpt = broken_copy(good, tmp_path / "broken", lambda t: t.pop(name))
    with pytest.raises(LoadError, match=f"no tensor '{name}'"):
        check_checkpoint(str(ckpt), load_model_config(str(ckpt)))


def test_names_a_wrong_shape(good: Path, tmp_path: Path) -> None:
    name = "model.layers.0.self_attn.q_proj.weight"

    def truncate(t: dict) -> None:
        t[name] = t[name][:-1].clone()

    ckpt = broken_copy(good, tmp_path / "broken", truncate)
    with pytest.raises(LoadError, match=f"{name}: checkpoint shape"):
        check_checkpoint(str(ckpt), load_model_config(str(ckpt)))


def test_unreadable_file_is_a_load_error(good: Path, tmp_path: Path) -> None:
    ckpt = broken_copy(good, tmp_path / "broken", lambda t: None)
    (ckpt / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(LoadError, match="cannot read the checkpoint"):
        check_checkpoint(str(ckpt), load_model_config(str(ckpt)))


def _serve(ckpt: Path) -> subprocess.CompletedProcess:
    """`safeserve serve` of `ckpt`, run to its exit."""
    return subprocess.run(
        [sys.executable, "-m", "safeserve.cli", "serve", "--model", str(ckpt), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_serve_refuses_before_starting_any_rank(good: Path, tmp_path: Path) -> None:
    """Exit code 2 is the pre-spawn refusal (a group that fails to start exits 1)."""
    name = "model.layers.0.mlp.gate.weight"
    ckpt = broken_copy(good, tmp_path / "broken", lambda t: t.pop(name))
    r = _serve(ckpt)
    assert r.returncode == 2, r.stderr[-2000:]
    assert name in r.stderr and "rank" not in r.stderr


def test_an_index_that_puts_a_tensor_in_the_wrong_shard_is_named(tmp_path: Path) -> None:
    import json

    ckpt = write_qwen3_moe_checkpoint(tmp_path / "sharded", seed=3, max_shard_size="20KB")
    index_path = ckpt / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = "model.layers.0.self_attn.k_proj.weight"
    shards = sorted(set(index["weight_map"].values()))
    index["weight_map"][name] = next(f for f in shards if f != index["weight_map"][name])
    index_path.write_text(json.dumps(index))
    with pytest.raises(LoadError, match=f"puts tensor '{name}' in"):
        check_checkpoint(str(ckpt), load_model_config(str(ckpt)))
    r = _serve(ckpt)
    assert r.returncode == 2, r.stderr[-2000:]
    assert len(r.stderr.strip().splitlines()) == 1 and name in r.stderr, r.stderr[-2000:]
