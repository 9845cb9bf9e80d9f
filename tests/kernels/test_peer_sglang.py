"""The benchmark's peer, SGLang's Triton fused MoE in block-FP8 mode run by kernels/peer_sglang.py,
on our experts' layout: only where a copy of SGLang's files is in .peer/sglang/
(kernels/fetch_peer_sglang.sh; never committed, so these tests skip in CI), on a GPU or on CPU
under Triton's interpreter (TRITON_INTERPRET=1).

Two references: `fp8_reference.grouped_experts_fp8` (W8A8, float32 in between), which the
benchmark also reports the peer's error against, and a torch model of the peer's own roundings
(`_like_peer`): SGLang keeps the gate/up result, SiLU-and-mul and the down result in the
activations' dtype (its compute type: bf16 for bf16, fp16 for float32 activations) before the
FP8 quantization and the top-k sum, so it is up to a few 1e-2 from the float32-intermediate
reference (a 16-bit rounding moves some intermediate values to the next FP8 step), while the
harness must match the model of its roundings up to float32 summation order (which can flip a
16-bit rounding, and through it an FP8 one).

Under the interpreter the activations are float32 (its float-to-bf16 cast truncates and its
float-to-FP8 cast does not round to nearest, so bf16 and the peer's quantizer are checked on a
GPU): the MoE runs with the torch quantizer (`torch_quant=True`, the same math), and the peer's
quantizer kernel is checked on values that it converts exactly. Measured under the interpreter
over 30 seeds (SAFESERVE_TEST_SEED 0..29): within 6.4e-4 of `_like_peer` (1.6e-6 at offset 0),
2.4e-4 to 2.2e-2 of `grouped_experts_fp8` (4.8e-4 to 4.6e-3 at offset 0)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from seeds import seeded

from safeserve.kernels.common import HAS_TRITON
from safeserve.kernels.fp8_reference import (
    FP8,
    block_dequantize,
    block_quantize,
    grouped_experts_fp8,
    token_group_dequantize,
    token_group_quantize,
)

ROOT = Path(__file__).resolve().parents[2]
PEER_DIR = ROOT / ".peer" / "sglang"
pytestmark = pytest.mark.skipif(
    not (PEER_DIR / "COMMIT").is_file(),
    reason="no SGLang copy in .peer/sglang (kernels/fetch_peer_sglang.sh; never committed)",
)
HAS_CUDA = torch.cuda.is_available() and HAS_TRITON
INTERPRET = HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"
interp = pytest.mark.skipif(not INTERPRET, reason="needs Triton and TRITON_INTERPRET=1")
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and Triton")


def _module():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(
        "peer_sglang", ROOT / "kernels" / "peer_sglang.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ps = _module()

# SGLang's keys: the H200 table's small-batch tile (swap_ab on an H200), a tile wider than the
# 128-row scale block (per-column weight scales), and None: the peer's own choice
CONFIGS = [
    (None, None),
    (
        {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1}
        | {"num_warps": 4, "num_stages": 3},
        True,
    ),
    (
        {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 256, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 8}
        | {"num_warps": 4, "num_stages": 3},
        False,
    ),
]
# tokens, experts, hidden, intermediate, top-k (top-1 writes into the result, top-2 adds, more sum)
CASES = [(1, 4, 256, 256, 2), (5, 4, 256, 256, 2), (5, 4, 256, 128, 3), (3, 4, 128, 256, 1)]


def _experts(e: int, h: int, inter: int, seed: int, device: str):  # type: ignore[no-untyped-def]
    gen = seeded(seed)
    gq, gs = block_quantize(torch.randn(e, inter, h, generator=gen) * 0.05)
    uq, us = block_quantize(torch.randn(e, inter, h, generator=gen) * 0.05)
    w2, w2s = block_quantize(torch.randn(e, h, inter, generator=gen) * 0.05)
    w13 = torch.cat([gq.float(), uq.float()], dim=1).to(FP8)  # gate rows, then up rows
    w13s = torch.cat([gs, us], dim=1)
    return w13.to(device), w13s.to(device), w2.to(device), w2s.to(device)


def _inputs(tokens: int, e: int, h: int, k: int, seed: int, dtype: torch.dtype, device: str):  # type: ignore[no-untyped-def]
    gen = seeded(seed)
    x = torch.randn(tokens, h, generator=gen) * torch.exp(torch.randn(tokens, 1, generator=gen))
    logits = torch.randn(tokens, e, generator=gen)
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)
    return (
        x.to(dtype).to(device),
        weights.contiguous().to(device),
        ids.to(torch.int32).contiguous().to(device),
    )


def _like_peer(x, w13, w13s, w2, w2s, weights, ids) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """SGLang's block-FP8 fused MoE in torch, with its roundings: x quantized; gate/up in float32
    rounded to the compute type (bf16 for bf16 x, else fp16) and kept in x's dtype; SiLU-and-mul
    in x's dtype, quantized; down in float32 times the routing weight, rounded likewise; the top-k
    sum in x's dtype."""
    compute = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float16
    tokens, k = ids.shape
    inter = w13.shape[1] // 2
    xq = token_group_dequantize(*token_group_quantize(x.float()))
    flat = ids.reshape(-1).long()
    y = torch.zeros(tokens * k, w2.shape[1], dtype=x.dtype, device=x.device)
    for e in flat.unique().tolist():
        pairs = (flat == e).nonzero().squeeze(1)
        h = (xq[pairs // k] @ block_dequantize(w13[e], w13s[e]).T).to(compute).to(x.dtype)
        a = F.silu(h[:, :inter]) * h[:, inter:]
        aq = token_group_dequantize(*token_group_quantize(a.float()))
        down = aq @ block_dequantize(w2[e], w2s[e]).T * weights.reshape(-1)[pairs, None].float()
        y[pairs] = down.to(compute).to(x.dtype)
    return y.view(tokens, k, -1).sum(dim=1).float()


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).norm() / want.norm())


def _check_moe(device: str, dtype: torch.dtype, cases, tol_model: float, tol_ref: float, **kw):  # type: ignore[no-untyped-def]
    peer = ps.load(PEER_DIR)
    for i, (tokens, e, h, inter, k) in enumerate(cases):
        w13, w13s, w2, w2s = _experts(e, h, inter, 10 + i, device)
        x, weights, ids = _inputs(tokens, e, h, k, 20 + i, dtype, device)
        model = _like_peer(x, w13, w13s, w2, w2s, weights, ids)
        ref = grouped_experts_fp8(x.float(), w13, w13s, w2, w2s, ids, weights, quantize_input=True)
        for config, swap_ab in CONFIGS:
            got = peer(x, w13, w13s, w2, w2s, weights, ids, config, swap_ab=swap_ab, **kw)
            assert got.dtype == dtype and got.shape == (tokens, h)
            where = (tokens, e, h, inter, k, config, swap_ab)
            assert _rel(got, model) <= tol_model, (*where, _rel(got, model))
            assert _rel(got, ref) <= tol_ref, (*where, _rel(got, ref))


def _exact_groups(rows: int, groups: int, device: str) -> torch.Tensor:
    """Activations whose every group quantizes exactly: e4m3 values times a power of two, each
    group's largest magnitude 448 times its power (so its scale is that power)."""
    gen = seeded(5)
    q = (torch.randn(rows, groups, 128, generator=gen) * 100).clamp(-448, 448).to(FP8).float()
    q[..., 0] = 448.0
    power = torch.exp2(torch.randint(-12, 4, (rows, groups, 1), generator=gen).float())
    return (q * power).flatten(1).to(device)


def test_peer_loads_without_sglang() -> None:
    if not HAS_TRITON:
        pytest.skip("needs Triton")
    peer = ps.load(PEER_DIR)
    assert peer.commit == (PEER_DIR / "COMMIT").read_text().split()[0]
    assert not any(m == "sglang" or m.startswith("sglang.") for m in sys.modules)


def test_peer_config_lookup(tmp_path: Path) -> None:
    name = "E=4,N=256,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128, 128]"
    tile = {"BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1}
    for version, table in (
        ("triton_3_2_0", {"1": {"BLOCK_SIZE_M": 16}, "65": {"BLOCK_SIZE_M": 64}}),
        ("triton_3_3_1", {"1": {"BLOCK_SIZE_M": 32}, "8": {"BLOCK_SIZE_M": 32}}),
        ("triton_3_1_0", {"1": {"BLOCK_SIZE_M": 128}}),
    ):
        (tmp_path / version).mkdir()
        entries = {t: {**c, **tile} for t, c in table.items()}
        (tmp_path / version / f"{name}.json").write_text(json.dumps(entries))
    look = ps.lookup_config
    # the running Triton's directory first, else the newest; the nearest key, the first on a tie
    assert look(tmp_path, 3, 4, 256, "NVIDIA H200", "3.2.0")["up"]["BLOCK_SIZE_M"] == 16
    got = look(tmp_path, 4, 4, 256, "NVIDIA H200", "3.6.0")
    assert got["up"]["BLOCK_SIZE_M"] == 32 and got["table"] == f"triton_3_3_1/{name}.json"
    assert got["down"] is None
    assert look(tmp_path, 40, 4, 256, "NVIDIA H200", "3.2.0")["up"]["BLOCK_SIZE_M"] == 64
    assert look(tmp_path, 33, 4, 256, "NVIDIA H200", "3.2.0")["up"]["BLOCK_SIZE_M"] == 16
    # no table for the device: SGLang's default for block FP8
    assert look(tmp_path, 4, 4, 256, "NVIDIA H100", "3.6.0") == {
        "up": ps.DEFAULT_CONFIG,
        "down": None,
        "table": None,
    }
    # a down table serves the down GEMM
    (tmp_path / "triton_3_2_0" / f"{name}_down.json").write_text(
        json.dumps({"1": {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64}})
    )
    ps._table.cache_clear()
    assert look(tmp_path, 3, 4, 256, "NVIDIA H200", "3.2.0")["down"]["BLOCK_SIZE_N"] == 64
    # the copied tables: Qwen3-30B-A3B's layer on an H200 under Triton 3.6 falls back to 3.2.0's
    copied = look(PEER_DIR / "configs", 4, 128, 768, "NVIDIA H200", "3.6.0")
    assert copied["table"] is not None, "no block-FP8 table of E=128, N=768 for an H200"
    assert copied["up"]["BLOCK_SIZE_K"] == 128


@interp
def test_interpreter_peer_quantizer_layout() -> None:
    peer = ps.load(PEER_DIR)
    x = _exact_groups(5, 3, "cpu")
    q, s = peer._quant(x)
    rq, rs = token_group_quantize(x)
    assert s.shape == (5, 3) and torch.equal(s, rs)
    assert torch.equal(q.float(), rq.float())


@interp
def test_interpreter_peer_matches_references() -> None:
    _check_moe("cpu", torch.float32, CASES, 3e-3, 4e-2, torch_quant=True)


@needs_cuda
@pytest.mark.gpu
def test_gpu_peer_quantizer() -> None:
    peer = ps.load(PEER_DIR)
    x = _exact_groups(7, 16, "cuda")
    q, s = peer._quant(x)
    rq, rs = token_group_quantize(x)
    assert torch.equal(s, rs) and torch.equal(q.float(), rq.float())
    x = torch.randn(300, 2048, generator=seeded(6)).to(torch.bfloat16).cuda()
    q, s = peer._quant(x)
    rq, rs = token_group_quantize(x)
    torch.testing.assert_close(s, rs, rtol=1e-6, atol=0)
    assert (q.float() != rq.float()).float().mean() <= 1e-3


@needs_cuda
@pytest.mark.gpu
def test_gpu_peer_matches_references() -> None:
    qwen = [(t, 128, 2048, 768, 8) for t in (1, 7, 64, 300)]
    _check_moe("cuda", torch.bfloat16, CASES + qwen, 5e-3, 5e-2)
