"""The FP8 KV cache (float8_e4m3fn, scale 1) in the kernels: the store kernels against the torch
quantization (`kv_quant.to_cache`), the decode and prefill kernels against their torch
references, which dequantize the cache as the engine's CPU path does. On a GPU, or under
Triton's interpreter (TRITON_INTERPRET=1) on CPU.

Bounds: a store writes exactly the bytes torch's clamp-and-round writes (the fused norm/RoPE
store within one e4m3 step: its float32 k may differ from torch's in the last bit, across a
rounding boundary); attention over an FP8 cache computes over the same dequantized values as
its float64 reference, so only float noise remains: relative error 1e-5 in float32 (1e-2 in
bfloat16, GPU only: the interpreter mis-computes bf16 tl.dot).
"""

from __future__ import annotations

import os

import pytest
import torch
from seeds import seeded

from safeserve.kernels import norm_rope as nr
from safeserve.kernels import paged_attention as pa
from safeserve.kernels import paged_prefill as pp
from safeserve.kernels.common import HAS_TRITON
from safeserve.kernels.kv_quant import KV_FP8, KV_FP8_MAX, to_cache

HAS_CUDA = torch.cuda.is_available() and HAS_TRITON
INTERPRET = HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if HAS_CUDA else "cpu"

_kernel_runs = pytest.mark.skipif(
    not (HAS_CUDA or INTERPRET), reason="needs a CUDA device (or TRITON_INTERPRET=1)"
)


def needs_kernel(test):  # type: ignore[no-untyped-def]
    """Runs the kernel on a GPU, or under Triton's interpreter on CPU (marked `kernel`)."""
    return pytest.mark.kernel(_kernel_runs(test))


def _wide(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Values over the whole e4m3 range and beyond: normal ones, beyond +-448 (clamped),
    subnormal ones (below 2^-6) and zeros of both signs."""
    x = torch.randn(*shape, generator=gen)
    scale = 10.0 ** torch.randint(-4, 4, shape, generator=gen).float()
    x = x * scale
    flat = x.view(-1)
    flat[:4] = torch.tensor([1000.0, -600.0, 0.0, -0.0])
    return x


def _fp8_cache(slots: int, heads: int, dim: int, gen: torch.Generator) -> torch.Tensor:
    return to_cache(3 * torch.randn(slots, heads, dim, generator=gen), KV_FP8).to(DEVICE)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def test_to_cache_clamps_rounds_and_keeps_other_dtypes() -> None:
    x = torch.tensor([1000.0, -449.0, 1.0 + 2**-5, 1.0 + 3 * 2**-5, 2**-9, 2**-11, -0.0])
    got = to_cache(x, KV_FP8)
    assert got.dtype == KV_FP8
    # clamped, then round to nearest even (1 + 2^-5 is a tie -> 1; 1 + 3 * 2^-5 -> 1.125),
    # the smallest subnormal kept, one below half of it gone, the sign of zero kept
    want = [KV_FP8_MAX, -KV_FP8_MAX, 1.0, 1.125, 2**-9, 0.0, -0.0]
    assert got.float().tolist() == want
    assert torch.signbit(got.float()[-1])
    assert torch.equal(to_cache(x, torch.bfloat16), x.to(torch.bfloat16))


@needs_kernel
def test_fp8_store_kernel_matches_torch_quantization() -> None:
    gen = seeded(3)
    k = _wide((7, 4, 96), gen).to(DEVICE)
    v = _wide((7, 4, 96), gen).to(DEVICE)
    slots = torch.tensor([12, -1, 0, 33, -1, 7, 50], device=DEVICE)
    kc = _fp8_cache(64, 4, 96, gen)
    vc = _fp8_cache(64, 4, 96, gen)
    kr, vr = kc.clone(), vc.clone()
    pa.store_kv(k, v, kc, vc, slots)
    pa.store_kv_torch(k, v, kr, vr, slots)
    # bytes: the same values, zeros of the same sign, nothing else touched
    assert torch.equal(kc.view(torch.uint8), kr.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), vr.view(torch.uint8))
    assert torch.isfinite(kc.float()).all() and torch.isfinite(vc.float()).all()


@needs_kernel
@pytest.mark.parametrize("tokens", [1, 13])
def test_fp8_norm_rope_store_kernel_matches_torch_quantization(tokens: int) -> None:
    """The fused q/k norm + RoPE + store (the model's store on the kernel path) into FP8
    caches: v exactly as torch quantizes it, k within one e4m3 step of torch's quantized k."""
    gen = seeded(tokens)
    hq, hkv, d = 4, 2, 16
    qkv = 4 * torch.randn(tokens, (hq + 2 * hkv) * d, generator=gen)
    qw, kw = 1 + 0.3 * torch.randn(d, generator=gen), 1 + 0.3 * torch.randn(d, generator=gen)
    pos = torch.randint(0, 4096, (tokens,), generator=gen).float()
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    ang = torch.cat([pos[:, None] * inv[None, :]] * 2, dim=1)
    cos, sin = ang.cos(), ang.sin()
    num_slots = 2 * tokens + 3
    slots = torch.randperm(num_slots, generator=gen)[:tokens]
    if tokens > 1:
        slots[tokens // 2] = -1
    kc = torch.zeros(num_slots, hkv, d, dtype=KV_FP8)
    vc = torch.zeros(num_slots, hkv, d, dtype=KV_FP8)
    args = (qkv, qw, kw, cos, sin, 1e-6, hq, hkv)
    devs = [t.to(DEVICE) for t in args[:5]]
    kc, vc, slots_d = kc.to(DEVICE), vc.to(DEVICE), slots.to(DEVICE)
    nr.qk_norm_rope_store(*devs, 1e-6, hq, hkv, kc, vc, slots_d)
    _, kr, vr = nr.qk_norm_rope_torch(*args)
    ok = slots >= 0
    got_k, got_v = kc.cpu()[slots[ok]], vc.cpu()[slots[ok]]
    assert torch.equal(got_v.view(torch.uint8), to_cache(vr[ok], KV_FP8).view(torch.uint8))
    want_k = to_cache(kr[ok], KV_FP8).float()
    step = torch.where(want_k.abs() < 2**-6, 2**-9, want_k.abs() * 2**-3)
    assert ((got_k.float() - want_k).abs() <= step).all()
    assert (got_k.float() == want_k).float().mean() > 0.99  # boundary cases only
    untouched = torch.ones(num_slots, dtype=torch.bool)
    untouched[slots[ok]] = False
    assert (kc.cpu()[untouched].float() == 0).all()


DECODE_CASES = [
    # context lengths, Hq, Hkv, D, block size
    ([1], 8, 2, 64, 16),  # one token
    ([17, 1, 45, 0], 8, 2, 64, 16),  # contexts that are no multiple of the block; a padding row
    ([130, 3], 8, 1, 64, 16),  # GQA group 8; 130 tokens: 3 splits of 64
    ([9, 70], 6, 2, 80, 1),  # head dim not a power of two, one token per block
]


@needs_kernel
@pytest.mark.parametrize("case", range(len(DECODE_CASES)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_decode_kernel_matches_dequantizing_reference(case: int, dtype: torch.dtype) -> None:
    ctxs, hq, hkv, d, bs = DECODE_CASES[case]
    if not HAS_CUDA and dtype == torch.bfloat16:
        pytest.skip("Triton 3.6's interpreter mis-computes bf16 tl.dot (checked on the GPU)")
    gen = seeded(case + 5)
    widths = [max(1, -(-c // bs)) for c in ctxs]
    num_blocks = sum(widths) + 2
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, i = [], 0
    for w in widths:
        tables.append(perm[i : i + w] + [0] * (max(widths) - w))
        i += w
    kc = _fp8_cache(num_blocks * bs, hkv, d, gen)
    vc = _fp8_cache(num_blocks * bs, hkv, d, gen)
    q = torch.randn(len(ctxs), hq, d, generator=gen).to(DEVICE, dtype)
    bt = torch.tensor(tables, dtype=torch.int32, device=DEVICE)
    ctx = torch.tensor(ctxs, dtype=torch.int32, device=DEVICE)
    scale = d**-0.5
    ref = pa.paged_decode_torch(q.double(), kc, vc, bt, ctx, bs, scale)
    out = torch.full_like(q, float("nan"))
    pa.paged_decode(q, kc, vc, bt, ctx, bs, scale, out=out)
    assert not out.isnan().any()
    assert _rel_err(out, ref) <= (1e-2 if dtype == torch.bfloat16 else 1e-5)
    for b, c in enumerate(ctxs):
        if c == 0:
            assert out[b].abs().sum() == 0


PREFILL_CASES = [
    # query lengths, context lengths, Hq, Hkv, D, block size
    ([1], [1], 8, 2, 64, 16),  # one token
    ([5], [5], 8, 2, 64, 16),
    ([17, 1, 3], [17, 30, 40], 8, 2, 64, 16),  # chunks over earlier context, a 1-token chunk
    ([9, 2], [9, 70], 4, 4, 80, 1),  # MHA, head dim not a power of two, one token per block
]


@needs_kernel
@pytest.mark.parametrize("case", range(len(PREFILL_CASES)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_prefill_kernel_matches_dequantizing_reference(case: int, dtype: torch.dtype) -> None:
    q_lens, ctxs, hq, hkv, d, bs = PREFILL_CASES[case]
    if not HAS_CUDA and dtype == torch.bfloat16:
        pytest.skip("Triton 3.6's interpreter mis-computes bf16 tl.dot (checked on the GPU)")
    gen = seeded(case + 50)
    widths = [-(-c // bs) for c in ctxs]
    num_blocks = sum(widths) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, i = [], 0
    for w in widths:
        tables.append(perm[i : i + w] + [0] * (max(widths) - w))
        i += w
    kc = _fp8_cache(num_blocks * bs, hkv, d, gen)
    vc = _fp8_cache(num_blocks * bs, hkv, d, gen)
    q = torch.randn(sum(q_lens), hq, d, generator=gen).to(DEVICE, dtype)
    bt = torch.tensor(tables, dtype=torch.int32, device=DEVICE)
    starts = [sum(q_lens[:s]) for s in range(len(q_lens))]
    info = pp.prefill_info(starts, q_lens, ctxs).to(DEVICE)
    scale = d**-0.5
    qd = q.double()
    ref = pp.paged_prefill_torch(qd, kc, vc, bt, info, bs, scale, torch.zeros_like(qd))
    out = torch.full_like(q, float("nan"))
    pp.paged_prefill(q, kc, vc, bt, info, max(q_lens), bs, scale, out)
    assert not out.isnan().any()  # every query row written
    assert _rel_err(out, ref) <= (1e-2 if dtype == torch.bfloat16 else 1e-5)
