"""DeepSeek-V3 (multi-head latent attention, grouped sigmoid routing with correction biases,
shared experts) in every parallel layout against transformers, on real gloo process groups."""

from __future__ import annotations

from pathlib import Path

import pytest
from checkpoints_deepseek_v3 import write_deepseek_v3_checkpoint
from layouts import LAYOUTS, assert_layout_matches, layout_reference
from serving import free_port


@pytest.fixture(scope="module")
def ds_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_deepseek_v3_checkpoint(tmp_path_factory.mktemp("dsv3"), seed=0)


@pytest.fixture(scope="module")
def reference(ds_checkpoint: Path):
    return layout_reference(ds_checkpoint)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_layout_logits_match_transformers(ds_checkpoint: Path, reference, name: str) -> None:
    assert_layout_matches(ds_checkpoint, name, reference, free_port())
