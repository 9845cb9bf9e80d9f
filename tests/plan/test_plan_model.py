"""The planner's weights and step reads equal what a built model holds: every family, the layouts
a rank can take (rank 0 and the last rank of each), from a checkpoint `transformers` wrote."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from checkpoints import write_qwen3_moe_checkpoint
from checkpoints_deepseek_v3 import write_deepseek_v3_checkpoint
from checkpoints_families import write_mixtral_checkpoint, write_qwen2_moe_checkpoint

from safeserve.bench.floor import ModelBytes
from safeserve.engine.kv_cache import KVCache
from safeserve.model import registry
from safeserve.model.checkpoint import load_model_config
from safeserve.model.loader import build_model
from safeserve.model.sharding import expert_split
from safeserve.moe.dispatch import make_dispatcher
from safeserve.parallel.comm import Comm
from safeserve.parallel.layout import Layout
from safeserve.plan.model import ModelFacts

WRITERS = {
    "qwen3_moe": write_qwen3_moe_checkpoint,
    "mixtral": write_mixtral_checkpoint,
    "qwen2_moe": write_qwen2_moe_checkpoint,
    "deepseek_v3": write_deepseek_v3_checkpoint,
}
LAYOUTS = [(1, 1, False), (2, 2, False), (2, 2, True), (2, 1, False), (4, 4, True), (4, 2, False)]


@pytest.fixture(scope="module", params=sorted(WRITERS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return WRITERS[request.param](tmp_path_factory.mktemp(request.param))


def built(
    path: Path, layout: Layout, dtype: str, quantization: str | None = None
) -> SimpleNamespace:
    """A rank's model as the engine builds it, and a KV cache of its family's spec."""
    cfg = load_model_config(str(path))
    comm = Comm(layout, torch.device("cpu"))
    placement = expert_split(cfg, layout)[0]
    dispatcher = make_dispatcher("none", placement, comm)
    model = build_model(
        str(path), "dummy", dtype, "cpu", dispatcher, layout, comm, quantization=quantization
    )
    spec = registry.kv_spec(cfg, layout)
    kv = KVCache.from_spec(spec, 2, 16, getattr(torch, dtype), torch.device("cpu"))
    return SimpleNamespace(model=model, kv=kv, config=cfg)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tp,ep,dp", LAYOUTS)
def test_rank_bytes_equal_the_built_model(
    checkpoint: Path, tp: int, ep: int, dp: bool, dtype: str
) -> None:
    cfg = load_model_config(str(checkpoint))
    facts = ModelFacts(cfg, torch.empty(0, dtype=getattr(torch, dtype)).element_size())
    for rank in (0, tp - 1):
        layout = Layout(rank, tp, ep, dp)
        try:
            registry.check_layout(cfg, layout)
        except ValueError:
            pytest.skip(f"the checkpoint does not split as tp {tp} ep {ep}")
        runner = built(checkpoint, layout, dtype)
        want = ModelBytes.of(runner)
        got = facts.rank_bytes(layout)
        seen: set[int] = set()
        total = 0
        for p in runner.model.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel() * p.element_size()
        assert got.total == total, (rank, got, total)
        assert (got.dense, got.embed_row, got.expert, got.kv_token) == (
            want.dense,
            want.embed_row,
            want.expert,
            want.kv_token,
        ), rank
        assert got.local_experts == expert_split(cfg, layout)[0].experts_per_rank


def test_fp8_rank_bytes_equal_the_built_model(checkpoint: Path) -> None:
    """Block FP8 (`--quantization fp8`, one rank): the bench's floor and the planner count the
    same bytes, each expert's float32 tile scales with the expert."""
    cfg = load_model_config(str(checkpoint))
    layout = Layout()
    runner = built(checkpoint, layout, "bfloat16", quantization="fp8")
    want = ModelBytes.of(runner)
    got = ModelFacts(cfg, 2, quantization="fp8").rank_bytes(layout)
    experts = runner.model.layers[-1].mlp.experts
    assert experts.w13.dtype == torch.float8_e4m3fn and experts.block is not None
    scales = (experts.w13_scale_inv[0].numel() + experts.w2_scale_inv[0].numel()) * 4
    assert want.expert == experts.w13[0].numel() + experts.w2[0].numel() + scales
    assert (got.dense, got.embed_row, got.expert, got.kv_token) == (
        want.dense,
        want.embed_row,
        want.expert,
        want.kv_token,
    )
