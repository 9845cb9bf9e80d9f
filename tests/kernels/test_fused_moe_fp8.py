"""The block-FP8 fused MoE (`safeserve.kernels.fused_moe_fp8`, W8A8) against the torch
reference that dequantizes (`fp8_reference.grouped_experts_fp8` with activations quantized): on
a GPU, or on CPU under Triton's interpreter (TRITON_INTERPRET=1). The activation quantizer gives
the torch quantizer's scales and FP8 values exactly. The MoE result is within 5e-3 relative (norm
of the error over norm of the result) of the reference in float32 and 1e-2 with bf16
activations and result: the two sum their products in different orders, and a float32
difference of one ulp can move an intermediate value to the next FP8 step (6 % of that value).
Both bounds are below the 2e-2 that separates W8A8 from W8A16 on these inputs, so a kernel that
skipped a quantization would fail (measured under the interpreter: 2e-7 to 6e-7)."""

from __future__ import annotations

import os

import pytest
import torch
from seeds import seeded

from safeserve.kernels import fp8_quant
from safeserve.kernels import fused_moe_fp8 as f8
from safeserve.kernels.fp8_reference import (
    FP8,
    block_quantize,
    grouped_experts_fp8,
    token_group_quantize,
)

HAS_CUDA = torch.cuda.is_available() and f8.HAS_TRITON
INTERPRET = f8.HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"
interp = pytest.mark.skipif(not INTERPRET, reason="needs Triton and TRITON_INTERPRET=1")
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and Triton")


def _activations(rows: int, k: int, seed: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    gen = seeded(seed)
    x = torch.randn(rows, k, generator=gen) * torch.exp(torch.randn(rows, 1, generator=gen))
    x[0, :] = 0.0  # an all-zero row: its groups' scales are the floor, its values 0
    x[-1, : min(k, 5)] = torch.tensor([448.0 * 3, -1e-3, 2.5e-3, 1e-8, -7.0])[: min(k, 5)]
    return x.to(dtype).to(device)


def _experts(e: int, h: int, inter: int, seed: int, device: str):  # type: ignore[no-untyped-def]
    gen = seeded(seed)
    gate = torch.randn(e, inter, h, generator=gen) * 0.05
    up = torch.randn(e, inter, h, generator=gen) * 0.05
    down = torch.randn(e, h, inter, generator=gen) * 0.05
    gq, gs = block_quantize(gate)
    uq, us = block_quantize(up)
    w2, w2s = block_quantize(down)
    w13 = torch.cat([gq.float(), uq.float()], dim=1).to(FP8)
    w13s = torch.cat([gs, us], dim=1)
    return w13.to(device), w13s.to(device), w2.to(device), w2s.to(device)


def _routing(tokens: int, e: int, k: int, seed: int, device: str):  # type: ignore[no-untyped-def]
    gen = seeded(seed)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(tokens)]).to(torch.int32)
    if tokens > 2:
        ids[1, 0] = -1  # a slot of another rank's expert
    weights = torch.rand(tokens, k, generator=gen)
    return ids.to(device), weights.to(device)


def _check_quant(device: str, dtype: torch.dtype) -> None:
    for rows, k in ((1, 128), (5, 200), (33, 384)):
        x = _activations(rows, k, rows + k, dtype, device)
        q, s = fp8_quant.token_group_quant(x)
        rq, rs = token_group_quantize(x)
        assert q.dtype == FP8 and s.dtype == torch.float32 and s.shape == (rows, -(-k // 128))
        assert torch.equal(s.cpu(), rs.cpu()), (rows, k)
        # equal values (the interpreter's conversion drops a zero's sign; -0 and 0 are equal)
        assert torch.equal(q.cpu().float(), rq.cpu().float()), (rows, k)


def _check_moe(device: str, dtype: torch.dtype, tol: float, cases) -> None:  # type: ignore[no-untyped-def]
    for tokens, e, h, inter, k in cases:
        w13, w13s, w2, w2s = _experts(e, h, inter, tokens + inter, device)
        ids, weights = _routing(tokens, e, k, tokens, device)
        x = _activations(tokens, h, 7 * tokens, dtype, device) * 0.1
        got = f8.fused_moe_fp8(x, w13, w13s, w2, w2s, weights, ids)
        want = grouped_experts_fp8(x.float(), w13, w13s, w2, w2s, ids, weights, quantize_input=True)
        assert got.dtype == dtype and got.shape == (tokens, h)
        assert not got.isnan().any()
        err = (got.float() - want).norm() / want.norm()
        assert err <= tol, (tokens, e, h, inter, k, float(err))
        # with every slot dropped a token's row is 0
        if tokens > 2:
            assert torch.count_nonzero(got[0]) == 0  # the zero row: nothing routed through it


# tokens, experts, hidden, intermediate, top-k: intermediate and hidden not multiples of the
# 128-wide block (partial scale tiles), one token, and counts that leave experts empty
CASES = [(1, 4, 256, 128, 2), (5, 4, 200, 192, 2), (33, 6, 256, 320, 3)]


@interp
def test_interpreter_token_group_quant_equals_torch() -> None:
    _check_quant("cpu", torch.float32)


@interp
def test_interpreter_fused_moe_fp8_matches_reference() -> None:
    _check_moe("cpu", torch.float32, 5e-3, CASES)


def test_round_to_e4m3_rule_matches_torch_conversion() -> None:
    """The float32 rounding the kernels use, written in torch: equal to torch's conversion on
    every float32 whose magnitude is at most 448 (a sweep across every binade and the
    subnormals, ties included)."""
    v = torch.cat(
        [
            torch.linspace(-448.0, 448.0, 200001),
            torch.tensor([0.0, -0.0, 2.0**-10, -(2.0**-11), 3 * 2.0**-10, 2.0**-6, 1.0625]),
            torch.tensor([1.1875, 447.0, 440.0, -1e-30]),
            torch.exp2(torch.linspace(-12.0, 8.7, 5001)),
        ]
    ).float()
    bits = v.view(torch.int32)
    exp = ((bits >> 23) & 0xFF) - 127
    exp = exp.clamp(min=-6)
    step = ((exp - 3 + 127) << 23).view(torch.float32)
    inv = ((127 - (exp - 3)) << 23).view(torch.float32)
    magic = torch.tensor(12582912.0)
    r = (((v.abs() * inv + magic) - magic) * step).clamp(max=448.0)
    r = torch.where(bits < 0, -r, r)
    want = v.to(FP8).float()
    assert torch.equal(r, want) and torch.equal(r.signbit(), want.signbit())


@needs_cuda
@pytest.mark.gpu
def test_gpu_token_group_quant_equals_torch() -> None:
    _check_quant("cuda", torch.bfloat16)
    _check_quant("cuda", torch.float32)


@needs_cuda
@pytest.mark.gpu
def test_gpu_fused_moe_fp8_matches_reference() -> None:
    _check_moe("cuda", torch.float32, 5e-3, CASES)
    shapes = [(1, 128, 2048, 768, 8), (7, 128, 2048, 768, 8), (300, 128, 2048, 768, 8)]
    _check_moe("cuda", torch.bfloat16, 1e-2, CASES + shapes)


def test_fp8_tile_table_lookup(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A table nearest by token count, from the override or the shipped name; a bad table is
    refused with the file and entry named; the bf16 tables' lookup never reads an FP8 one."""
    import json

    from safeserve.kernels import moe_config as mc

    small = {"BLOCK_M": 16, "BLOCK_N2": 64, "GROUP_M": 1, "num_warps": 4, "stages": 4}
    large = {"BLOCK_M": 64, "BLOCK_N2": 128, "GROUP_M": 8, "num_warps": 8, "stages": 3}
    name = f8.fp8_config_file_name(128, 2048, 768, "cpu")
    assert name == "fp8_w8a8_128x128_E128_H2048_I768_cpu.json"
    table = {"configs": {"1": {**small, "tuned_us": 30.0}, "1024": large}, "meta": {}}
    (tmp_path / name).write_text(json.dumps(table))
    cpu = torch.device("cpu")
    assert f8.get_fp8_config(3, 128, 2048, 768, cpu, tmp_path) == small
    assert f8.get_fp8_config(900, 128, 2048, 768, cpu, tmp_path) == large
    # no table of this shape: the defaults
    assert f8.get_fp8_config(3, 64, 2048, 768, cpu, tmp_path)["BLOCK_M"] == 16
    override = tmp_path / "mine.json"
    override.write_text(json.dumps({"8": large}))
    monkeypatch.setenv(f8.FP8_CONFIG_ENV, str(override))
    assert f8.get_fp8_config(3, 64, 2048, 768, cpu) == large
    monkeypatch.setenv(f8.FP8_CONFIG_ENV, str(tmp_path / "missing.json"))
    with pytest.raises(mc.ConfigTableError, match="no such file"):
        f8.get_fp8_config(3, 64, 2048, 768, cpu)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"8": {**large, "BLOCK_N2": 256}}))
    with pytest.raises(mc.ConfigTableError, match="bad.json, 8 tokens: BLOCK_N2 256"):
        f8.load_fp8_table(str(bad))
    # a bf16 table of the same shape beside it is still what the bf16 lookup finds
    bf16 = {"configs": {"1": mc.default_config(1, 128, 8)}, "meta": {"capability": "9.0"}}
    (tmp_path / mc.config_file_name(128, 2048, 768, "NVIDIA H100")).write_text(json.dumps(bf16))
    found = mc.same_capability_table(str(tmp_path), 128, 2048, 768, "9.0")
    assert found is not None and set(found) == {1}
