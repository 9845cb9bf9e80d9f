"""Block-FP8 DeepSeek-V3 checkpoints: MLA's projections (q_a, q_b or q, kv_a, kv_b, o), the
dense and shared MLPs and the routed experts quantized, as in DeepSeek-V3's own checkpoints.
`kv_b_proj` is absorbed into the query and the output, so it is held dequantized; the rest stays
FP8. The reference is transformers' float32 model on the dequantized copy (within 1e-4)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from checkpoints_deepseek_v3 import write_deepseek_v3_checkpoint
from fp8 import build_ours, same_weights, write_dequantized_copy, write_fp8_checkpoint
from layouts import run_layout
from model_checks import paged_logits, paged_logits_match_transformers
from seeds import seeded
from serving import free_port

from safeserve.layers.linear import BlockFp8Linear
from safeserve.model.checkpoint import check_checkpoint, load_model_config
from safeserve.model.registry import check_layout
from safeserve.model.sharding import LayoutError
from safeserve.parallel.layout import Layout

VARIANTS = {"q_lora": {}, "no_q_lora_bias": dict(q_lora_rank=None, attention_bias=True)}


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny GEMMs on a shared host
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def ckpts(request, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp(f"fp8-ds-{request.param}")
    hp = write_deepseek_v3_checkpoint(base / "hp", seed=2, **VARIANTS[request.param])
    fp8 = write_fp8_checkpoint(hp, base / "fp8")
    return {"hp": hp, "fp8": fp8, "deq": write_dequantized_copy(fp8, base / "deq")}


def test_logits_match_the_dequantized_model(ckpts: dict[str, Path]) -> None:
    check_checkpoint(str(ckpts["fp8"]), load_model_config(str(ckpts["fp8"])))
    net = paged_logits_match_transformers(ckpts["fp8"], reference=ckpts["deq"])
    attn, moe = net.layers[1].self_attn, net.layers[1].mlp
    first = attn.q_a_proj if attn.q_a_proj is not None else attn.q_proj
    for m in (first, attn.kv_a_proj_with_mqa, attn.o_proj, moe.shared_experts.gate_proj):
        assert isinstance(m, BlockFp8Linear)
    assert attn.a_weight is None  # FP8 projections are not fused
    assert attn.kv_b_proj.weight.dtype == torch.float32  # absorbed: held dequantized
    assert moe.experts.w13.dtype == torch.float8_e4m3fn
    assert moe.gate.weight.dtype == torch.float32  # the router is never FP8


def test_online_quantization_equals_the_fp8_checkpoint(ckpts: dict[str, Path]) -> None:
    same_weights(build_ours(ckpts["hp"], quantization="fp8"), build_ours(ckpts["fp8"]))


def test_an_ep_layout_gives_the_logits_of_one_rank(ckpts: dict[str, Path]) -> None:
    """tp2-ep2-alltoall-dp: attention data-parallel, the experts whole per EP rank, so the tiny
    model's odd widths cut no tile."""
    gen = seeded(5)
    seqs = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (11, 7)]
    one = build_ours(ckpts["fp8"])
    single = {i: paged_logits(one, s, [len(s)], 4, list(range(8))) for i, s in enumerate(seqs)}
    got = run_layout(ckpts["fp8"], "tp2-ep2-alltoall-dp", seqs, [6, 3, 1, 1], free_port())
    assert set(got) == {(0, 5), (0, 8), (0, 9), (0, 10), (1, 5), (1, 6)}
    for (i, pos), row in got.items():
        torch.testing.assert_close(row, single[i][pos], atol=1e-4, rtol=0)


def test_tensor_parallel_attention_that_cuts_a_tile_is_refused(ckpts: dict[str, Path]) -> None:
    cfg = load_model_config(str(ckpts["fp8"]))
    check_layout(cfg, Layout(1, 2, 2, dp_attention=True))
    with pytest.raises(LayoutError, match="self_attn.*cuts a 128x128 FP8 block"):
        check_layout(cfg, Layout(1, 2, 2))
