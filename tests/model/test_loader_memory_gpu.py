"""Building a model on the GPU holds about its own size, never a float32 copy of it: the KV
cache is sized from the device's free memory right after, so a transient copy (cached by the
allocator) would come out of the KV cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from safeserve.model.loader import build_model
from safeserve.moe.dispatch import LocalDispatcher
from safeserve.moe.placement import ExpertPlacement

pytestmark = pytest.mark.gpu

CONFIG = Path(__file__).parents[2] / "kernels" / "configs" / "qwen3-30b-a3b" / "config.json"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_weight_fill_peak_is_near_the_weights(tmp_path: Path, dtype: str) -> None:
    cfg = json.loads(CONFIG.read_text())
    cfg["num_hidden_layers"] = 8  # the real shapes, 8 of the 48 layers: about 11 GB in 16 bits
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    net = build_model(
        str(tmp_path), "dummy", dtype, "cuda", LocalDispatcher(ExpertPlacement(cfg["num_experts"]))
    )
    weights = sum(p.numel() * p.element_size() for p in net.parameters())
    assert all(p.dtype == getattr(torch, dtype) for p in net.parameters())
    peak = torch.cuda.max_memory_allocated() - base
    # The fill's float32 temporaries are of one tensor at a time (the largest: one layer's
    # gate/up experts, 1.6 GB; the random draw and its scaled copy); a float32 copy of the
    # model (22 GB here) would be twice the weights.
    largest = max(p.numel() for p in net.parameters()) * 4
    assert peak <= weights + 3 * largest < 2 * weights, (peak / 2**30, weights / 2**30)
    del net
    torch.cuda.empty_cache()
